"""This process's resident memory, from /proc (Linux; None elsewhere): what the bench reports as
peak RSS and what a serving replica reports in /health."""

from __future__ import annotations

from pathlib import Path


def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float | None:
    """Peak resident memory (VmHWM) in MiB."""
    return _status_mb("VmHWM")


def rss_mb() -> float | None:
    """Resident memory now (VmRSS) in MiB."""
    return _status_mb("VmRSS")


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) of this process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
