"""What this machine is: CPU, GPU, package versions, providers that really load, cache locations,
and this process's peak memory. Recorded with every benchmark result and shown by `gpt2x info`."""

from __future__ import annotations

import platform
import shutil
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..onnx.artifact import exports_root
from ..runtime.providers import available_providers, physical_cores
from ..version import __version__
from .results import Environment


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> str | None:
    """GPU name and driver from nvidia-smi, or None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def installed_versions(*names: str) -> dict[str, str]:
    """Versions of the named distributions that are installed (the others are left out)."""
    result = {}
    for name in names:
        try:
            result[name] = version(name)
        except PackageNotFoundError:
            continue
    return result


def package_versions() -> dict[str, str]:
    return {"gpt2x": __version__, "python": platform.python_version()} | installed_versions(
        "torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "numpy", "transformers", "tiktoken")


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def environment() -> Environment:
    """This machine and its software, as a bench result records them."""
    from huggingface_hub import constants

    providers = available_providers()
    return Environment(
        gpt2x=__version__,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        platform=platform.platform(),
        cpu=cpu_model(),
        cores=physical_cores(),
        gpu=gpu_info() or "none found",
        packages=package_versions(),
        providers_listed=", ".join(providers["listed"]),
        providers_loadable=providers["loadable"],
        hub_cache=constants.HF_HUB_CACHE,
        hub_offline=bool(constants.HF_HUB_OFFLINE),
        exports=str(exports_root()),  # GPT2X_EXPORTS, else the user's cache: where commands find exports
        git=git_revision() or "n/a",
    )


def system_info() -> dict:
    """environment() as the JSON object every result file and `gpt2x info` hold."""
    return environment().to_dict()
