"""gpt2x's CLI in a subprocess that imports this checkout's gpt2x (PYTHONPATH passed on when set), with modules made
unimportable as helpers.BLOCKED_RUNNER does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpt2x.onnx.artifact import EXPORTS_ENV

from .helpers import BLOCKED_RUNNER


def gpt2x_cli(*args: str, cwd, block: str | None = None) -> subprocess.CompletedProcess:
    """gpt2x ARGS in `cwd` (exports by model name in cwd/exported); `block`: modules made unimportable (comma list)."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", EXPORTS_ENV: str(Path(cwd) / "exported"),
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
           **({"BLOCKED": block} if block else {})}
    cmd = [sys.executable, "-c", BLOCKED_RUNNER, *args] if block else [sys.executable, "-m", "gpt2x", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
