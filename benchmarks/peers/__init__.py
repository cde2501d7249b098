"""The contenders of benchmarks/compare_peers.py, one module per peer, on a shared timing core
(core.py: the contender protocol, the run context, interleaved timing, token check).

A peer module is one file here with KEY (its --contenders name), ORDER (its place in the run),
LABEL (how a skip of the whole module is named) and load(ctx) -> list of contenders; modules()
finds every such file, so a new peer is a new file and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def modules() -> list[ModuleType]:
    """Every peer module in this package, in run order (ORDER)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if callable(getattr(module, "load", None)) and hasattr(module, "KEY"):
            found.append(module)
    return sorted(found, key=lambda m: (m.ORDER, m.KEY))
