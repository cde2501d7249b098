"""Files written whole or not at all: a temporary file (or folder) beside the target, renamed into place."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import OutputError


def cache_folder(env: str, name: str) -> Path | None:
    """The folder the environment variable `env` names, else gpt2x/`name` in the user's cache ($XDG_CACHE_HOME or
    ~/.cache); None when `env` is "off"."""
    named = os.environ.get(env)
    if named == "off":
        return None
    if named:
        return Path(named).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return (Path(cache).expanduser() / "gpt2x" / name).resolve()


def sha256(path: Path) -> str:
    """sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def folder_lock(folder: Path, wait: bool = True) -> Iterator[None]:
    """An OS lock on a hidden file beside `folder` (released if the process dies): makers of one folder take turns;
    with `wait` False, a folder another process is making is refused (OutputError) instead. A folder whose parent
    cannot be written (a read-only file system) is one OutputError line too."""
    folder = Path(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {folder.parent}: {e.strerror or e}") from None
    lock = FileLock(folder.with_name(f".{folder.name}.lock"))
    try:
        lock.acquire(timeout=-1 if wait else 0)
    except Timeout:
        raise OutputError(f"another process is writing {folder} now; wait for it, or write elsewhere") from None
    except OSError as e:
        raise OutputError(f"cannot write to {folder.parent}: {e.strerror or e}") from None
    try:
        yield
    finally:
        lock.release()


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write through a temporary file and one rename: readers see the old file or the new, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def temp_path_beside(path: Path, suffix: str = "") -> Path:
    """A temporary name in `path`'s folder (same file system, so os.replace is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp{suffix}")


def replace_folder(tmp: Path, out: Path) -> None:
    """Move `tmp` to `out`; the old folder is renamed aside and removed only once the new one is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_partials(out: Path) -> None:
    """Remove the hidden `.NAME.partial-PID-*` folders of writers of `out` that were killed outright."""
    for folder in out.parent.glob(f".{out.name}.partial-*"):
        pid = folder.name[len(f".{out.name}.partial-") :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def folder_written_whole(out: Path, force: bool, what: str) -> Iterator[Path]:
    """Yields a temporary folder beside `out` to fill; on success its files get the umask's permissions (mkdtemp and
    onnx's external data make them owner-only) and it replaces `out`, else it is removed (an OSError becomes
    OutputError). An existing `out` is refused unless `force`."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} exists; pass --force to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"cannot write to {out.parent}: {e.strerror}") from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield tmp
        tmp.chmod(0o777 & ~umask)
        for path in tmp.rglob("*"):
            if path.is_file():
                path.chmod(0o666 & ~umask)
        replace_folder(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"{what} failed: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
