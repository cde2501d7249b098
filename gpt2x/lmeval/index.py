"""lm-eval's task index, kept between runs: lm-eval's TaskManager parses every task file of every folder it is given
on each start (its own ~14,000 take seconds), to learn which names exist. Here each folder's index is kept in
GPT2X_LMEVAL_INDEX (default: gpt2x/lm-eval-index in the user's cache; "off": never) beside the fingerprint of the
folder's task files (their paths, sizes and modification times) and lm-eval's version; a later run whose
fingerprint matches reads it back instead of parsing the files again. The index holds names, kinds and tags: lm-eval
parses a task's file afresh when it loads the task. (A file included from outside the folder is not in the
fingerprint: a name or tag it alone changes shows once a file of the folder changes.)

`kept_index()` puts this in place of lm-eval's `TaskIndex.build` while a TaskManager is made (lm-eval is pinned in
the `eval` extra; tests/lmeval/test_index.py checks the names and the signatures)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import marshal
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lm_eval.tasks import manager as lm_manager
from lm_eval.tasks._index import Entry, Kind, TaskIndex

from ..errors import OutputError
from ..fileio import cache_folder, write_atomic

INDEX_ENV = "GPT2X_LMEVAL_INDEX"  # the folder of kept task indexes, or "off"
_FORMAT = 1  # the layout of a kept file: another is read as missing
_lm_log = logging.getLogger("lm_eval.tasks._index")  # its override warning, under lm-eval's logger (quieted with it)


def index_root() -> Path | None:
    """GPT2X_LMEVAL_INDEX, else gpt2x/lm-eval-index in the user's cache; None when it is "off"."""
    return cache_folder(INDEX_ENV, "lm-eval-index")


def _fingerprint(root: Path) -> str:
    """lm-eval's version, the folder and each task file's path, size and modification time, hashed: the files of
    lm-eval's own walk (TaskIndex._iter_yaml_files), in its order."""
    h = hashlib.sha256(f"{importlib.metadata.version('lm_eval')}\0{root}".encode())
    for p in TaskIndex._iter_yaml_files(root):
        st = p.stat()
        h.update(f"\0{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _dump(fingerprint: str, index: dict[str, Entry]) -> bytes:
    """marshal (builtins only: a task file's values, the paths as strings): read back in a fraction of the parse."""
    entries = [(e.name, e.kind.name, None if e.yaml_path is None else str(e.yaml_path), e.cfg, sorted(e.tags))
               for e in index.values()]
    return marshal.dumps((_FORMAT, fingerprint, entries))


def _load(data: bytes, fingerprint: str) -> dict[str, Entry] | None:
    """The kept index if it is whole, of this layout and of these files; else None."""
    try:
        fmt, kept, entries = marshal.loads(data)
        if fmt != _FORMAT or kept != fingerprint:
            return None
        return {name: Entry(name=name, kind=Kind[kind], yaml_path=None if path is None else Path(path), cfg=cfg,
                            tags=set(tags)) for name, kind, path, cfg, tags in entries}
    except (EOFError, ValueError, TypeError, KeyError):  # cut short, or another layout
        return None


def _folder_index(root: Path, build, resolve_includes: bool) -> dict[str, Entry]:
    """One folder's index: kept, else built by lm-eval (`build`) and kept for the next run."""
    folder = index_root()
    root = Path(root).expanduser().resolve()
    if folder is None or not root.is_dir():
        return build([root], resolve_includes=resolve_includes)
    try:
        fingerprint = _fingerprint(root)
    except OSError:  # a file gone meanwhile: lm-eval's own walk, as if nothing were kept
        return build([root], resolve_includes=resolve_includes)
    kept = folder / f"{hashlib.sha256(f'{root}{resolve_includes}'.encode()).hexdigest()[:24]}.marshal"
    try:
        index = _load(kept.read_bytes(), fingerprint)
    except OSError:  # none kept yet
        index = None
    if index is not None:
        return index
    index = build([root], resolve_includes=resolve_includes)
    try:
        data = _dump(fingerprint, index)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(kept, data)
    except (ValueError, OSError, OutputError):  # a value marshal cannot hold, or a cache that cannot be written
        pass
    return index


@contextmanager
def kept_index() -> Iterator[None]:
    """TaskManagers made meanwhile read each folder's kept index, or build and keep it; the folders' indexes merge as
    lm-eval merges them (a later folder's name replaces an earlier's, with lm-eval's warning)."""
    build = TaskIndex.build

    def kept_build(paths: Iterable[Path], *, resolve_includes=True) -> dict[str, Entry]:
        index: dict[str, Entry] = {}
        for root in paths:
            for name, entry in _folder_index(root, build, resolve_includes).items():
                if name in index:
                    _lm_log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                    index[name].yaml_path)
                index[name] = entry
        return index

    lm_manager.TaskIndex.build = staticmethod(kept_build)
    try:
        yield
    finally:
        lm_manager.TaskIndex.build = staticmethod(build)
