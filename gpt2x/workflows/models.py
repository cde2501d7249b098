"""Models in PyTorch: loading one by name (with a LoRA adapter merged in, gated), and whether PyTorch is here at all."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..choices import Precision, Progress, no_progress
from ..errors import ArtifactError, MissingDependencyError, ParityError
from ..evaluate.metrics import logit_stats
from ..evaluate.parity import TOLERANCES
from ..fileio import sha256
from ..model.checkpoints import BUNDLED, RANDOM_PREFIX, ModelSource, resolve, resolve_config
from ..runtime.registry import require_export_extra, require_modules

if TYPE_CHECKING:
    from ..model.adapters import LoraAdapter, Merged
    from ..model.gpt2 import GPT2

DEFAULT_MODEL = BUNDLED
ADAPTERS_EXTRA = ("peft", "transformers")  # merging a LoRA adapter: PEFT merges it, on transformers' GPT-2
ADAPTERS_INSTALL = "pip install 'gpt2x[adapters]'"
# The merge is PyTorch fp32 against PyTorch fp32, whatever the export's precision: fp32's tolerance.
MERGE_TOLERANCE = TOLERANCES[Precision.fp32]


def load_model(name: str = DEFAULT_MODEL, revision: str | None = None) -> tuple[GPT2, ModelSource]:
    """The PyTorch model and where it came from (bundled, hub, local or random:). Its weights are found (downloaded)
    before PyTorch is imported: a name that resolves nowhere is one line in a second, not after torch's import."""
    resolved = None if name.startswith(RANDOM_PREFIX) else resolve(name, revision)
    require_export_extra(f"loading {name} into PyTorch")
    from ..model.weights import load_model as load_weights

    return load_weights(name, revision, resolved=resolved)


def adapted_name(name: str, adapter: Path) -> str:
    """The name of model `name` with the adapter in folder `adapter` merged in: NAME+FOLDER (what its export records
    as the model's name, and its default folder's)."""
    return f"{name}+{Path(adapter).expanduser().resolve().name}"


def load_adapted(name: str, adapter: Path, revision: str | None = None,
                 progress: Progress = no_progress) -> tuple[GPT2, ModelSource, dict]:
    """Model `name` with the PEFT LoRA adapter in folder `adapter` merged in by PEFT (model.adapters), gated by
    gate_merge; where the merged model came from (named by adapted_name; its base's kind, path and revision) and the
    adapter's record for the export's metadata. The adapter is checked against the base's config before the base
    loads."""
    lora = check_adapter(name, adapter, revision)  # first: it checks the extras the import below needs
    from ..model.adapters import merge_adapter

    progress(f"loading {name}")
    model, source = load_model(name, revision)
    progress(f"merging the LoRA adapter {lora.folder} with PEFT")
    merged = merge_adapter(model, lora)
    record = lora.record(source.name) | {"parity": gate_merge(merged)}
    return merged.model, ModelSource(adapted_name(name, lora.folder), source.kind, source.path, source.revision), record


def check_adapter(name: str, adapter: Path, revision: str | None = None) -> LoraAdapter:
    """The PEFT LoRA adapter in folder `adapter`, checked against model `name`'s config from the files' headers
    (model.adapters.read_adapter: one line for a folder that is not one, or does not fit); nothing is loaded."""
    require_export_extra("merging a LoRA adapter")
    require_modules("merging a LoRA adapter", ADAPTERS_EXTRA, ADAPTERS_INSTALL)
    from ..model.adapters import read_adapter

    return read_adapter(adapter, resolve_config(name, revision))


def check_adapter_export(record: dict, adapter: Path, folder: Path) -> None:
    """An ArtifactError where the export in `folder`, whose metadata records the merged adapter `record`, was made from
    other files than the adapter now in folder `adapter` (retrained, or another adapter whose folder has its name)."""
    from ..model.adapters import CONFIG_FILE, WEIGHTS_FILE

    adapter = Path(adapter).expanduser().resolve()
    now = (sha256(adapter / WEIGHTS_FILE), sha256(adapter / CONFIG_FILE))
    if (record.get("sha256"), record.get("config_sha256")) != now:
        raise ArtifactError(f"{folder} was exported with another adapter than {adapter} ({record.get('path')} as it was "
                            "then): export it again, replacing the folder (gpt2x export --adapter ... --force)")


def gate_merge(merged: Merged) -> dict:
    """The merge's gate: the merged gpt2x model's logits against PEFT's merged model's, and against the adapter applied
    at run time by PEFT's PeftModel, each within fp32's max_rel; its record, or ParityError (one line) outside it.
    `change`: how far the adapter moves the base's logits (0: it changes nothing, as PEFT's default initialisation)."""
    vocab = merged.merged.shape[-1]
    ours = merged.merged.reshape(-1, vocab)
    against = {"peft_merged": logit_stats(merged.peft_merged.reshape(-1, vocab), ours),
               "peft": logit_stats(merged.peft.reshape(-1, vocab), ours)}
    what = {"peft_merged": "PEFT's merged model (merge_and_unload)", "peft": "the adapter applied at run time (PeftModel)"}
    failures = [f"against {what[k]} max |Δlogit| {s['max_abs']:.3g} is {s['max_rel']:.3g} of the logit scale"
                for k, s in against.items() if s["max_rel"] > MERGE_TOLERANCE.max_rel]
    if failures:
        raise ParityError(f"the merged model is out of tolerance: {'; '.join(failures)} (gate {MERGE_TOLERANCE.max_rel:g})")
    change = logit_stats(merged.base.reshape(-1, vocab), ours)["max_rel"]
    return {"status": "passed", "tolerance": {"max_rel": MERGE_TOLERANCE.max_rel}, "positions": int(ours.shape[0]), **against,
            "change": change}


def torch_available() -> bool:
    try:
        require_export_extra("PyTorch")
    except MissingDependencyError:
        return False
    return True
