"""Reading GPT-2 weights into the PyTorch model (and saving them in Hugging Face layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import WeightsError
from ..fileio import temp_path_beside, write_atomic
from .checkpoints import RANDOM_PREFIX, ModelSource, random_preset, resolve
from .config import GPT2Config
from .gpt2 import GPT2
from .hf_format import config_to_hf, gpt2x_to_hf, hf_to_gpt2x


def _names(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")


def build_model(cfg: GPT2Config, hf_sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> GPT2:
    """A GPT2 with the given Hugging Face tensors, after checking names and shapes."""
    sd = hf_to_gpt2x(hf_sd)
    with torch.device("meta"):
        model = GPT2(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = want.keys() - sd.keys()
    unexpected = sd.keys() - want.keys()
    wrong = [f"{k} {tuple(sd[k].shape)} (expected {want[k]})" for k in want.keys() & sd.keys() if tuple(sd[k].shape) != want[k]]
    problems = []
    if missing:
        problems.append(f"missing {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    if wrong:
        problems.append(f"wrong shape {_names(wrong)}")
    if problems:
        raise WeightsError("weights do not match the config: " + "; ".join(problems))
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    return model.eval()


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file (preferred) or a pickled .bin (weights only, never code)."""
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read {path}: {e}") from None
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError ... for bad pickles
        raise WeightsError(
            f"refused to load {path}: it is not a plain weights pickle ({type(e).__name__}); "
            "gpt2x never unpickles code. Convert it to safetensors"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise WeightsError(f"{path}: expected a dict of tensors")
    return sd


def load_model(name: str, revision: str | None = None, dtype: torch.dtype = torch.float32,
               resolved: tuple[ModelSource, GPT2Config, list[Path]] | None = None) -> tuple[GPT2, ModelSource]:
    """`resolved`: checkpoints.resolve's answer for `name`, where the caller has it already."""
    if name.startswith(RANDOM_PREFIX):
        model = GPT2(random_preset(name)).init_weights(seed=0).to(dtype).eval()
        return model, ModelSource(name, "random", Path("."), None)
    source, cfg, files = resolved or resolve(name, revision)
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise WeightsError(f"weights shard {f} is missing")
        sd.update(load_tensors(f))
    return build_model(cfg, sd, dtype), source


def save_hf(model: GPT2, folder: Path, dtype: torch.dtype = torch.float32, metadata: dict[str, str] | None = None) -> None:
    """Save in Hugging Face layout (config.json + model.safetensors), loadable by transformers too;
    each file is written to a temporary name and renamed into place."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    target = folder / "model.safetensors"
    tmp = temp_path_beside(target)
    try:
        save_file(gpt2x_to_hf(sd), str(tmp), metadata={"format": "pt", **(metadata or {})})
        tmp.chmod(0o644)  # an ordinary data file, whatever the writer chose
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    write_atomic(folder / "config.json", json.dumps(config_to_hf(model.config), indent=2) + "\n")
