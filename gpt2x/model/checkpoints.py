"""Finding GPT-2 checkpoints: the bundled model, hub repos (huggingface_hub), local folders and files,
and `random:NAME` architectures. Only locates and describes them (configs, file lists, fingerprints):
reading the tensors into a model is weights.py, the one part that needs torch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import HubError, ModelNotFoundError, WeightsError
from ..fileio import sha256
from .config import PRESETS, GPT2Config
from .hf_format import config_from_hf, read_json

BUNDLED = "shakespeare"
RANDOM_PREFIX = "random:"  # `random:gpt2` = the gpt2 architecture with seeded random weights (for benchmarks)


@dataclass
class ModelSource:
    """Where a model came from, in words a user recognises (stored in export metadata)."""

    name: str  # what the user asked for (`shakespeare`, `gpt2`, a repo id or a path)
    kind: str  # "bundled", "hub" or "local"
    path: Path  # the folder or file the weights were read from
    revision: str | None = None  # hub revision, when from the hub


def bundled_dir() -> Path:
    return Path(str(resources.files("gpt2x") / "data" / BUNDLED))


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


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors in a .safetensors file, from its header (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"cannot read {path}: {e}") from None


def config_from_shapes(path: Path) -> GPT2Config:
    """Config of a lone .safetensors file without config.json: from shapes, with GPT-2's head size 64."""
    shapes = {k.removeprefix("transformer."): v for k, v in tensor_shapes(path).items()}
    try:
        vocab, n_embd = shapes["wte.weight"]
        n_positions = shapes["wpe.weight"][0]
    except KeyError as e:
        raise WeightsError(f"{path}: no {e.args[0]} tensor; not GPT-2 weights") from None
    n_layer = len({k.split(".")[1] for k in shapes if k.startswith("h.")})
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

    # Without DNS, huggingface_hub's five retries are ~25 s of warnings: the cache alone, as HF_HUB_OFFLINE=1.
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
            f"{repo} is not in the local cache and {why}; use the bundled model {BUNDLED!r} (offline), "
            "or the path of a local Hugging Face folder or .safetensors file"
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
        cfg = config_from_hf(read_json(beside), str(beside)) if beside.is_file() else config_from_shapes(path)
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


def weights_fingerprint(source: ModelSource) -> str | None:
    """sha256 over the weight files of a bundled or local model (None for hub and random models,
    which their name, revision and config identify)."""
    if source.kind not in ("bundled", "local"):
        return None
    files = weights_files(source.path) if source.path.is_dir() else [source.path]
    h = hashlib.sha256()
    for f in files:
        h.update(sha256(f).encode())
    return h.hexdigest()
