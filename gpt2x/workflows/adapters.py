"""LoRA adapters served beside their base (`gpt2x serve --model BASE --adapter NAME=FOLDER`): each one named, checked
against the base before any export, then exported once with the adapter merged in (workflows.exports.ensure_export:
cached by its adapted name and precision, so that a restart reuses it) and served as a model of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .models import check_adapter

OPTION = "adapter"


@dataclass(frozen=True)
class ServedAdapter:
    """One --adapter NAME=FOLDER: the model id clients send, and the PEFT adapter folder (resolved)."""

    name: str
    folder: Path


def parse_adapters(values: list[str], models: list[str], onnx_dirs: list[Path], models_dir: Path | None,
                   names: list[str]) -> list[ServedAdapter]:
    """Each NAME=FOLDER of --adapter, checked without reading any file: one UsageError line for a value without its
    NAME or FOLDER, a NAME given twice or that the base is served as (`names`: --served-model-name's, else the
    --model), two folders of one name (their exports would share a folder: ensure_export names it by adapted_name),
    or a base other than one --model (adapters are merged into its weights: an --onnx folder has none to merge into)."""
    adapters = []
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name.strip() or not folder.strip():
            raise UsageError(f"--adapter takes NAME=FOLDER (the model id clients send, a PEFT LoRA adapter folder), "
                             f"got {value!r}", option=OPTION)
        adapters.append(ServedAdapter(name.strip(), Path(folder.strip()).expanduser().resolve()))
    if not adapters:
        return []
    if len(models) != 1 or onnx_dirs or models_dir is not None:
        given = f"{len(models)} --model, {len(onnx_dirs)} --onnx" + (", --models-dir" if models_dir is not None else "")
        raise UsageError(f"--adapter merges each adapter into the weights of one base: give exactly one --model and no "
                         f"--onnx or --models-dir (got {given})", option=OPTION)
    taken = set(names or models)
    for adapter in adapters:
        if adapter.name in taken:
            raise UsageError(f"--adapter {adapter.name}=...: the name {adapter.name!r} is served already (another "
                             "adapter, or the base): give each adapter a name of its own", option=OPTION)
        taken.add(adapter.name)
    folders: dict[str, Path] = {}
    for adapter in adapters:
        other = folders.setdefault(adapter.folder.name, adapter.folder)
        if other != adapter.folder:
            raise UsageError(f"--adapter: {other} and {adapter.folder} have one folder name, {other.name!r}, and their "
                             "exports would share one folder (named by it): rename one", option=OPTION)
    return adapters


def check_adapters(adapters: list[ServedAdapter], base: str, revision: str | None = None) -> None:
    """Each adapter read against the base's config from its files' headers (workflows.models.check_adapter), before
    any export: one line for a folder that is not a PEFT LoRA adapter, or one made for another architecture."""
    for adapter in adapters:
        check_adapter(base, adapter.folder, revision)
