"""Files written whole or not at all: a temporary file (or folder) beside the target, renamed into place."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

from .errors import OutputError


def sha256(path: Path) -> str:
    """sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and one rename: readers see
    the old file or the new one, never a half-written one. OutputError when it cannot be written."""
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
    """Move the finished folder `tmp` to `out`, replacing what is there: the old folder is renamed
    aside first and removed only once the new one is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_partials(out: Path) -> None:
    """Remove what a writer of `out` killed outright (SIGKILL, power loss) left: `.NAME.partial-PID-*`
    folders whose process is gone. They never look like a finished folder (hidden name)."""
    for folder in out.parent.glob(f".{out.name}.partial-*"):
        pid = folder.name[len(f".{out.name}.partial-") :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
