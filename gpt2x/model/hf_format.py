"""Hugging Face's GPT-2 format: config.json <-> GPT2Config, state dicts <-> our layout (HF's Conv1D weights are
[in, out], nn.Linear's [out, in]: transposed on load and save). No torch: only the given tensors' methods.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import WeightsError
from .config import GPT2Config

if TYPE_CHECKING:
    from torch import Tensor

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some checkpoints carry that are not parameters (the causal mask of old GPT-2 code).
IGNORED_KEYS = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# Supported GPT-2 variants: anything else changes the maths our model implements.
HF_REQUIRED = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "add_cross_attention": (False,),
    "tie_word_embeddings": (True,),
}




def config_from_hf(hf: dict, where: str) -> GPT2Config:
    """Our config from a Hugging Face `config.json` dict; refuses what is not plain GPT-2."""
    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise WeightsError(f"{where}: not a GPT-2 config (model_type={model_type!r}; gpt2x runs model_type 'gpt2')")
    for key, allowed in HF_REQUIRED.items():
        if key in hf and hf[key] not in allowed:
            raise WeightsError(f"{where}: unsupported GPT-2 variant ({key}={hf[key]!r}; gpt2x supports {allowed[0]!r})")
    n_embd = hf.get("n_embd", 768)
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise WeightsError(f"{where}: unsupported MLP width n_inner={hf['n_inner']} (gpt2x supports 4 * n_embd)")
    try:
        return GPT2Config(
            vocab_size=hf.get("vocab_size", 50257),
            n_positions=hf.get("n_positions", hf.get("n_ctx", 1024)),
            n_embd=n_embd,
            n_layer=hf.get("n_layer", 12),
            n_head=hf.get("n_head", 12),
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        )
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{where}: invalid GPT-2 config: {e}") from None


def config_to_hf(cfg: GPT2Config) -> dict:
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_ctx": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "tie_word_embeddings": True,
    }


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object")
    return data


def hf_to_gpt2x(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face GPT-2 tensors -> our parameter names and layouts."""
    out = {}
    for key, t in sd.items():
        if key.startswith("transformer."):
            key = key[len("transformer.") :]
        if IGNORED_KEYS.match(key):
            continue
        if key == "lm_head.weight":
            continue  # tied to wte (checked below when both are present)
        out[key] = t.t().contiguous() if key.endswith(CONV1D_SUFFIXES) else t
    if "lm_head.weight" in sd and "wte.weight" in out:
        if sd["lm_head.weight"].shape != out["wte.weight"].shape or not sd["lm_head.weight"].equal(out["wte.weight"]):
            raise WeightsError("lm_head.weight differs from wte.weight: gpt2x needs the unembedding tied to wte")
    return out


def gpt2x_to_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face layout (no `transformer.` prefix, as the gpt2 repo stores it)."""
    return {k: (t.t() if k.endswith(CONV1D_SUFFIXES) else t).contiguous() for k, t in sd.items()}


