"""Graphs rewritten in memory at load (an fp32 export's GroupQueryAttention twin, an int8 cache's graph), kept on disk
for the next process: a later process reads the rewritten graph back and hands it to ONNX Runtime with the export's
own weights (onnx.mapped), importing no onnx (its import took 0.8-2 s of a fresh process's first token; onnx/wire.py).

An entry is the rewritten graph without its large weights (they stay in the export's file: the graph names them, held
outside it) and a JSON record: what the graph attends with, the names of the weights it takes, and the SHA-256 of the
graph's bytes, checked on every read. Its key hashes what the rewrite depends on: the rewrite's kind and inputs (the
export's recorded file digests and sizes), the source of the code that rewrites, and onnx's version. An entry that
does not check out is rewritten again; nothing is ever used unchecked. GPT2X_GRAPHS names the folder ("off": none).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..fileio import cache_folder
from .artifact import ExportInfo

GRAPHS_ENV = "GPT2X_GRAPHS"
# The modules whose source a rewritten graph depends on (optimize.py's twin, kvcache.py's int8 cache, their names).
REWRITERS = ("optimize.py", "kvcache.py", "names.py", "mapped.py")


@dataclass(frozen=True)
class InMemoryGraph:
    """A graph for ONNX Runtime made from an export's file in memory: `graph` (serialized) marks each large weight as
    held outside it, and `weights` holds them (name -> array, views of the bytes read from the file)."""

    graph: bytes
    weights: dict[str, np.ndarray]
    attention: dict  # artifact.attention_layout of the graph


def recorded_file(info: ExportInfo, path: Path) -> dict:
    """What the export recorded of one of its files: its SHA-256 and size (what a graph rewritten from it depends on)."""
    name = path.name
    return {"name": name, "sha256": info.meta["files"].get(name), "size": (info.meta.get("sizes") or {}).get(name)}


def kept_or_made(keys: list[str | None], weights: dict[str, np.ndarray],
                 make: Callable[[], tuple[InMemoryGraph, ...] | None]) -> tuple[InMemoryGraph, ...] | None:
    """The graphs kept under `keys` (with those of `weights` they take) where every one checks out, else `make`'s, kept
    under them for the next process; None where `make` has none."""
    kept = tuple(load_graph(key, weights) for key in keys)
    if all(graph is not None for graph in kept):
        return kept
    made = make()
    for key, graph in zip(keys, made or ()):
        save_graph(key, graph)
    return made


def graphs_root() -> Path | None:
    """GPT2X_GRAPHS, else gpt2x/graphs in the user's cache; None when it is "off"."""
    return cache_folder(GRAPHS_ENV, "graphs")


def graph_key(kind: str, inputs: dict) -> str | None:
    """The key of a rewrite of `kind` on `inputs` (the export's file digests and sizes it reads), or None where the
    rewriting code's source cannot be read."""
    h = hashlib.sha256(json.dumps([kind, inputs], sort_keys=True).encode())
    try:
        for name in REWRITERS:
            h.update(Path(__file__).with_name(name).read_bytes())
        h.update(importlib.metadata.version("onnx").encode())
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    return h.hexdigest()[:32]


def load_graph(key: str | None, weights: dict[str, np.ndarray]) -> InMemoryGraph | None:
    """The rewritten graph kept under `key`, with those of `weights` (the export's, onnx.mapped) it takes; None where
    none is kept, or it does not check out (its record or bytes cut, changed, or naming a weight not there)."""
    root = graphs_root()
    if key is None or root is None:
        return None
    try:
        record = json.loads((root / f"{key}.json").read_text())
        graph = (root / f"{key}.onnx").read_bytes()
        if hashlib.sha256(graph).hexdigest() != record["sha256"]:
            return None
        names = record["weights"]
        if not all(name in weights for name in names):
            return None
        return InMemoryGraph(graph, {name: weights[name] for name in names}, dict(record["attention"]))
    except (OSError, ValueError, KeyError, TypeError):  # missing, cut short, or another layout
        return None


def save_graph(key: str | None, graph: InMemoryGraph) -> None:
    """Keep `graph` under `key` for the next process: the graph, then its record, each written whole (a temporary
    file renamed into place). A folder that cannot be written keeps nothing (the next process rewrites again)."""
    root = graphs_root()
    if key is None or root is None:
        return
    record = {"sha256": hashlib.sha256(graph.graph).hexdigest(), "weights": sorted(graph.weights),
              "attention": graph.attention}
    suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for name, data in ((f"{key}.onnx", graph.graph), (f"{key}.json", json.dumps(record).encode())):
            tmp = root / (name + suffix)
            tmp.write_bytes(data)
            os.replace(tmp, root / name)
    except OSError:
        return
