"""LoRA adapters saved by PEFT (`PeftModel.save_pretrained`), merged into GPT-2's weights by PEFT itself: the base
becomes transformers' GPT2LMHeadModel, PEFT loads the adapter onto it and merges it (`merge_and_unload`, which knows
that GPT-2's Conv1D layers hold their weights [in, out]: fan_in_fan_out), and the merged weights come back into gpt2x's
model. Reading an adapter folder checks it against the base from its files' headers, before anything is loaded; the
merge returns the logits a caller gates it on (workflows.models). It imports peft and transformers (the adapters
extra): workflows.models imports it only after checking they are installed."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import init_empty_weights  # peft's own dependency
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import GPT2Config as HFConfig
from transformers import GPT2LMHeadModel

from ..errors import ModelNotFoundError, WeightsError
from ..fileio import sha256
from .checkpoints import tensor_shapes
from .config import GPT2Config
from .gpt2 import GPT2
from .hf_format import config_to_hf, gpt2x_to_hf, read_json
from .weights import build_model

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"  # older PEFT's default: gpt2x unpickles no adapter
LORA = "LORA"  # PEFT's peft_type of a LoRA adapter (DoRA and rsLoRA are LoRA with options)
# The layers gpt2x merges an adapter into, and each one's (in, out) features in units of n_embd: the blocks' Conv1D
# layers. LoRA on wte would change the tied unembedding too once merged, and on lm_head would untie it from wte:
# neither is the model the adapter was trained as.
MERGEABLE = {"attn.c_attn": (1, 3), "attn.c_proj": (1, 1), "mlp.c_fc": (1, 4), "mlp.c_proj": (4, 1)}
# PEFT's prefix of every tensor name in the file, before the model's own (transformer.h.0.attn.c_attn ...).
PREFIX = "base_model.model."
# A tensor's layer and its part: lora_A.weight, lora_B.weight (and lora_B.bias with lora_bias), DoRA's
# lora_magnitude_vector, or the layer's own bias trained beside them (bias="lora_only" or "all": base_layer.bias).
KEY = re.compile(r"^(?P<module>.+?)\.(?P<part>lora_[A-Za-z_]+(\.[A-Za-z_]+)?|(base_layer\.)?bias)$")
BLOCK_MODULE = re.compile(r"^transformer\.h\.(?P<layer>\d+)\.(?P<layer_module>[a-z_]+\.[a-z_]+)$")
# PEFT options that add or replace whole modules (or the architecture) beside the low-rank deltas: a merge does not
# turn them into changes of the Conv1D weights.
UNSUPPORTED = ("modules_to_save", "trainable_token_indices", "layer_replication", "target_parameters")
# The merge's gate runs these token ids (seeded, every position's logits).
GATE_ROWS, GATE_TOKENS, GATE_SEED = 3, 16, 0


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter folder, checked against a base's config (read_adapter)."""

    folder: Path
    config: dict  # adapter_config.json
    modules: tuple[str, ...]  # the base's modules its weights adapt, in gpt2x's names (h.0.attn.c_attn)
    sha256: str  # of adapter_model.safetensors
    config_sha256: str  # of adapter_config.json: its lora_alpha (and patterns) change the merged weights too

    @property
    def name(self) -> str:
        return self.folder.name

    def record(self, base: str) -> dict:
        """What an export made with it records under "model": the adapter and the base it was merged into."""
        targets = self.config.get("target_modules")
        return {
            "path": str(self.folder),
            "sha256": self.sha256,
            "config_sha256": self.config_sha256,
            "base": base,
            "base_model_name_or_path": self.config.get("base_model_name_or_path"),  # what it was trained on, as PEFT saved it
            "r": self.config.get("r"),
            "lora_alpha": self.config.get("lora_alpha"),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets,  # a list, or PEFT's regex
            "modules": list(self.modules),
        }


def read_adapter(folder: Path, cfg: GPT2Config) -> LoraAdapter:
    """The adapter in `folder`, checked against a base of config `cfg` from its config and its tensors' names and
    shapes (none is read): one line, naming the module at fault, for a folder that is not a PEFT LoRA adapter, one
    for other shapes, or one that adapts layers gpt2x does not merge."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise ModelNotFoundError(f"no such adapter folder: {folder}")
    folder = folder.resolve()
    if not (folder / CONFIG_FILE).is_file():
        raise WeightsError(f"{folder} is not a PEFT adapter folder (no {CONFIG_FILE}; PeftModel.save_pretrained writes one)")
    config = read_json(folder / CONFIG_FILE)
    kind = config.get("peft_type")
    if kind != LORA:
        raise WeightsError(f"{folder} holds an adapter of peft_type {kind}; gpt2x merges LoRA adapters only")
    used = [key for key in UNSUPPORTED if config.get(key)]
    if used:
        raise WeightsError(f"{folder}: {', '.join(used)} set in {CONFIG_FILE}; gpt2x merges the low-rank weights of "
                           "LoRA adapters only, not whole modules they add or replace")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        why = f"only {WEIGHTS_FILE} is read, gpt2x never unpickles: save it with safe_serialization=True" \
            if (folder / PICKLED_WEIGHTS_FILE).is_file() else f"no {WEIGHTS_FILE}"
        raise WeightsError(f"{folder}: {why}")
    modules = check_shapes(tensor_shapes(weights), cfg, folder)
    return LoraAdapter(folder, config, modules, sha256(weights), sha256(folder / CONFIG_FILE))


def check_shapes(shapes: dict[str, tuple[int, ...]], cfg: GPT2Config, folder: Path) -> tuple[str, ...]:
    """The gpt2x modules the adapter's tensors adapt, each checked against `cfg`: a layer the base has, one gpt2x
    merges, lora_A [r, in] and lora_B [out, r] of its features."""
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = KEY.match(key.removeprefix(PREFIX))
        if match is None:
            raise WeightsError(f"{folder}: {key} is not a LoRA tensor PEFT names")
        parts.setdefault(match["module"], {})[match["part"]] = shape
    if not parts:
        raise WeightsError(f"{folder}: {WEIGHTS_FILE} holds no tensors")
    modules = []
    for module, tensors in sorted(parts.items()):
        name = module.removeprefix("transformer.")
        block = BLOCK_MODULE.match(module)
        if block is None or block["layer_module"] not in MERGEABLE:
            raise WeightsError(f"{folder} adapts {name}, which gpt2x does not merge: LoRA on the blocks' "
                               f"{', '.join(MERGEABLE)} layers only (wte and lm_head are tied in GPT-2)")
        if int(block["layer"]) >= cfg.n_layer:
            raise WeightsError(f"{folder} does not fit the base: it adapts {name}, and the base has {cfg.n_layer} layers")
        fan_in, fan_out = (cfg.n_embd * k for k in MERGEABLE[block["layer_module"]])
        a, b = tensors.get("lora_A.weight"), tensors.get("lora_B.weight")
        if a is None or b is None:
            raise WeightsError(f"{folder}: {name} lacks its lora_A or lora_B weight")
        if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b[0] != fan_out or a[0] != b[1]:
            raise WeightsError(f"{folder} does not fit the base: {name} has lora_A {list(a)} and lora_B {list(b)}, the "
                               f"base's layer takes {fan_in} features to {fan_out} (lora_A [r, {fan_in}], lora_B [{fan_out}, r])")
        wrong = [part for part, shape in tensors.items() if part.endswith("bias") and shape != (fan_out,)]
        if wrong:
            raise WeightsError(f"{folder} does not fit the base: {name}'s {wrong[0]} has shape {list(tensors[wrong[0]])}, "
                               f"the base's layer has {fan_out} outputs")
        modules.append(name)
    return tuple(modules)


@dataclass
class Merged:
    """The merged gpt2x model, and the gate's logits (gate_ids, every position): of the base, of PEFT's PeftModel
    (the adapter applied at run time), of PEFT's merged model, and of the merged gpt2x model."""

    model: GPT2
    base: np.ndarray
    peft: np.ndarray
    peft_merged: np.ndarray
    merged: np.ndarray


def gate_ids(cfg: GPT2Config) -> np.ndarray:
    """The merge gate's token ids: GATE_ROWS rows of random ids, seeded."""
    rng = np.random.default_rng(GATE_SEED)
    return rng.integers(0, cfg.vocab_size, (GATE_ROWS, min(GATE_TOKENS, cfg.n_positions)), dtype=np.int64)


@torch.no_grad()
def merge_adapter(model: GPT2, adapter: LoraAdapter) -> Merged:
    """`adapter` merged into a copy of `model` (fp32, in eval mode) by PEFT's merge_and_unload, back in gpt2x's model;
    and the logits to gate it on. `model` itself is left as it was."""
    cfg = model.config
    ids = torch.from_numpy(gate_ids(cfg))
    base_logits = model(ids)[0].numpy()
    hf = hf_model(model)
    with warnings.catch_warnings():
        # PEFT corrects an adapter saved with fan_in_fan_out=False for Conv1D layers itself (and says so): the
        # gate below checks the result.
        warnings.filterwarnings("ignore", message=r"fan_in_fan_out is set to False", category=UserWarning)
        # Layers that target_modules names and the weights lack are refused below, in one line.
        warnings.filterwarnings("ignore", message=r"Found missing adapter keys", category=UserWarning)
        # transformers' notices of its own deprecations to PEFT's calls: nothing a user of gpt2x can act on.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
        try:
            peft_model = PeftModel.from_pretrained(hf, str(adapter.folder), is_trainable=False).eval()
        except (RuntimeError, ValueError, KeyError) as e:  # what PEFT raises for an adapter its loader refuses
            raise WeightsError(f"PEFT cannot load {adapter.folder}: {str(e).strip().splitlines()[0]}") from None
    adapted = sorted(name.removeprefix(f"{PREFIX}transformer.") for name, m in peft_model.named_modules()
                     if isinstance(m, LoraLayer))
    if adapted != sorted(adapter.modules):  # target_modules and the weights name other layers: some would be left random
        raise WeightsError(f"{adapter.folder}: its target_modules adapt {_few(adapted)}, its weights "
                           f"{_few(adapter.modules)}; they must name the same layers")
    peft_logits = peft_model(input_ids=ids).logits.numpy()
    merged_hf = peft_model.merge_and_unload()
    peft_merged = merged_hf(input_ids=ids).logits.numpy()
    merged = build_model(cfg, merged_hf.state_dict())
    return Merged(merged, base_logits, peft_logits, peft_merged, merged(ids)[0].numpy())


def _few(names) -> str:
    names = list(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "") if names else "none"


def hf_model(model: GPT2):
    """transformers' GPT2LMHeadModel with a copy of `model`'s weights (the merge changes its tensors in place)."""
    # No random initialisation: every parameter is assigned below. Buffers stay real (older transformers compute
    # GPT-2's causal mask as one).
    with init_empty_weights(include_buffers=False):
        hf = GPT2LMHeadModel(HFConfig.from_dict(config_to_hf(model.config)))
    hf.transformer.load_state_dict({k: v.clone() for k, v in gpt2x_to_hf(model.state_dict()).items()}, assign=True)
    hf.tie_weights()  # lm_head is wte again (assign replaced wte's parameter)
    return hf.eval()
