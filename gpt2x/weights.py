"""Finding and loading GPT-2 weights: the bundled model, hub repos, local folders and files.

Hugging Face's GPT-2 stores its four projection matrices as `Conv1D` weights shaped [in, out];
our `nn.Linear` wants [out, in], so those are transposed on load (and back on save).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import HubError, ModelNotFoundError, WeightsError
from .model import GPT2, PRESETS, GPT2Config

BUNDLED = "shakespeare"
RANDOM_PREFIX = "random:"  # `random:gpt2` = the gpt2 architecture with seeded random weights (for benchmarks)
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


@dataclass
class ModelSource:
    """Where a model came from, in words a user recognises (stored in export metadata)."""

    name: str  # what the user asked for (`shakespeare`, `gpt2`, a repo id or a path)
    kind: str  # "bundled", "hub" or "local"
    path: Path  # the folder or file the weights were read from
    revision: str | None = None  # hub revision, when from the hub


def bundled_dir() -> Path:
    return Path(str(resources.files("gpt2x") / "data" / BUNDLED))


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


# ---------------------------------------------------------------- state dicts


def hf_to_gpt2x(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
        if sd["lm_head.weight"].shape != out["wte.weight"].shape or not torch.equal(sd["lm_head.weight"], out["wte.weight"]):
            raise WeightsError("lm_head.weight differs from wte.weight: gpt2x needs the unembedding tied to wte")
    return out


def gpt2x_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face layout (no `transformer.` prefix, as the gpt2 repo stores it)."""
    return {k: (t.t() if k.endswith(CONV1D_SUFFIXES) else t).contiguous() for k, t in sd.items()}


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


def weights_files(folder: Path) -> list[Path]:
    """The weights of a Hugging Face folder: single file or shards, safetensors before .bin."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            shards = sorted(set(read_json(folder / index).get("weight_map", {}).values()))
            return [folder / s for s in shards]
    raise ModelNotFoundError(f"{folder}: no model.safetensors or pytorch_model.bin in this folder")


def load_folder(folder: Path) -> tuple[GPT2Config, list[Path]]:
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{folder}: no config.json (expected a Hugging Face GPT-2 folder)")
    cfg = config_from_hf(read_json(folder / "config.json"), str(folder / "config.json"))
    return cfg, weights_files(folder)


def config_from_shapes(path: Path, sd: dict[str, torch.Tensor]) -> GPT2Config:
    """Config of a lone .safetensors file without config.json: from shapes, with GPT-2's head size 64."""
    sd = hf_to_gpt2x(sd)
    try:
        vocab, n_embd = sd["wte.weight"].shape
        n_positions = sd["wpe.weight"].shape[0]
    except KeyError as e:
        raise WeightsError(f"{path}: no {e.args[0]} tensor; not GPT-2 weights") from None
    n_layer = len({k.split(".")[1] for k in sd if k.startswith("h.")})
    if n_embd % 64:
        raise WeightsError(f"{path}: cannot infer n_head (n_embd {n_embd} is not a multiple of 64); put a config.json beside it")
    return GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_embd // 64)


# ---------------------------------------------------------------- the hub


def hub_repo(name: str) -> str:
    return PRESETS[name][0] if name in PRESETS else name


def hub_resolvable() -> bool:
    """Whether the hub endpoint's host name resolves (False: certainly offline)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def hub_download(repo: str, revision: str | None) -> Path:
    """Config and weights of a hub repo into huggingface_hub's cache; returns the snapshot folder."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # Without DNS for the hub there is no point in huggingface_hub's five retries (~25 s of
    # warnings): use the cache alone, exactly as HF_HUB_OFFLINE=1 would.
    cache_only = not hub_resolvable()

    def get(filename: str) -> Path:
        return Path(hf_hub_download(repo, filename, revision=revision, local_files_only=cache_only))

    try:
        folder = get("config.json").parent
        config_from_hf(read_json(folder / "config.json"), f"{repo}/config.json")  # refuse before a big download
        for filename in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
            try:
                path = get(filename)
            except LocalEntryNotFoundError:
                raise  # offline and not cached: reported below, not taken for "the repo lacks it"
            except EntryNotFoundError:
                continue
            if filename.endswith(".index.json"):
                for shard in sorted(set(read_json(path).get("weight_map", {}).values())):
                    get(shard)
            return folder
        raise ModelNotFoundError(f"{repo}: the repo has no model.safetensors or pytorch_model.bin")
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached (no network?)"
        raise HubError(
            f"{repo} is not in the local cache and {why}; use --model {BUNDLED} (bundled, offline) "
            "or --model PATH to a local Hugging Face folder or .safetensors file"
        ) from None
    except GatedRepoError:
        raise HubError(f"{repo} is gated: accept its terms on the hub and log in (`hf auth login`)") from None
    except (RepositoryNotFoundError, HFValidationError):
        raise ModelNotFoundError(
            f"unknown model {repo!r}: not a preset ({', '.join([BUNDLED, *PRESETS])}), a local path, or a hub repo id"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo}: revision {revision!r} not found") from None
    except HfHubHTTPError as e:
        raise HubError(f"hub error for {repo}: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------- entry points


def resolve(name: str, revision: str | None = None) -> tuple[ModelSource, GPT2Config, list[Path]]:
    """Where the weights of `name` are (downloading from the hub when needed), and its config."""
    if name == BUNDLED:
        folder = bundled_dir()
        cfg, files = load_folder(folder)
        return ModelSource(name, "bundled", folder), cfg, files
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            cfg, files = load_folder(path)
            return ModelSource(name, "local", path.resolve()), cfg, files
        if path.suffix != ".safetensors":
            raise ModelNotFoundError(f"{path}: expected a folder or a .safetensors file")
        beside = path.parent / "config.json"
        cfg = config_from_hf(read_json(beside), str(beside)) if beside.is_file() else config_from_shapes(path, load_tensors(path))
        return ModelSource(name, "local", path.resolve()), cfg, [path]
    if name.startswith((".", "/", "~")) or name.endswith((".safetensors", ".bin", ".json")) or name.count("/") > 1:
        raise ModelNotFoundError(f"no such file or directory: {name}")
    folder = hub_download(hub_repo(name), revision)
    cfg, files = load_folder(folder)
    return ModelSource(name, "hub", folder, revision), cfg, files


def random_preset(name: str) -> GPT2Config:
    preset = name[len(RANDOM_PREFIX) :]
    if preset not in PRESETS:
        raise ModelNotFoundError(f"unknown architecture {preset!r} in {name!r}; one of: {', '.join(PRESETS)}")
    return PRESETS[preset][1]


def resolve_config(name: str, revision: str | None = None) -> GPT2Config:
    """The config alone: presets need no download, hub repos only their config.json."""
    if name.startswith(RANDOM_PREFIX):
        return random_preset(name)
    if name in PRESETS and not Path(name).exists():
        return PRESETS[name][1]
    return resolve(name, revision)[1]


def load_model(name: str, revision: str | None = None, dtype: torch.dtype = torch.float32) -> tuple[GPT2, ModelSource]:
    if name.startswith(RANDOM_PREFIX):
        model = GPT2(random_preset(name)).init_weights(seed=0).to(dtype).eval()
        return model, ModelSource(name, "random", Path("."), None)
    source, cfg, files = resolve(name, revision)
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise WeightsError(f"weights shard {f} is missing")
        sd.update(load_tensors(f))
    return build_model(cfg, sd, dtype), source


def save_hf(model: GPT2, folder: Path, dtype: torch.dtype = torch.float32, metadata: dict[str, str] | None = None) -> None:
    """Save in Hugging Face layout (config.json + model.safetensors), loadable by transformers too."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(gpt2x_to_hf(sd), str(tmp), metadata={"format": "pt", **(metadata or {})})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "model.safetensors").chmod(0o644)  # an ordinary data file, whatever the writer chose
    tmp = folder / "config.json.tmp"
    tmp.write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    os.replace(tmp, folder / "config.json")
