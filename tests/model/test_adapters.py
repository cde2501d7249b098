"""`gpt2x export --adapter`: a random PEFT LoRA adapter on a tiny GPT-2 merged by PEFT, gated, exported and recorded;
the exported graph's logits are PEFT's merged model's (and not the base's); every adapter gpt2x refuses is one line
with its exit code and leaves no folder; and the gate fails on a merge that got GPT-2's Conv1D layout wrong, in PEFT
or in gpt2x."""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel

from gpt2x.choices import Precision
from gpt2x.cli.app import main
from gpt2x.errors import ArtifactError, MissingDependencyError, ModelNotFoundError, ParityError, UsageError, WeightsError
from gpt2x.evaluate.metrics import logit_stats
from gpt2x.evaluate.parity import TOLERANCES
from gpt2x.fileio import sha256
from gpt2x.model import adapters
from gpt2x.model.checkpoints import resolve, weights_fingerprint
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import EXPORTS_ENV, default_export_dir, read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.workflows.exports import check_export_matches, export_by_name
from gpt2x.workflows.models import load_adapted

from ..helpers import assert_one_line_error, cli, make_hf_model

TOL = TOLERANCES[Precision.fp32].max_rel
CONFIG = {"n_positions": 96}  # tiny_export's: one traced graph serves both


def hf_base(folder: Path):
    return GPT2LMHeadModel.from_pretrained(folder).eval()


def make_lora(folder: Path, model, seed: int = 1, perturb: bool = False, **config) -> Path:
    """A random LoRA adapter (not a no-op: init_lora_weights=False) on transformers' `model`, saved by PEFT. `perturb`:
    noise on every trainable tensor too, as training leaves them (DoRA's magnitudes, trained biases)."""
    torch.manual_seed(seed)
    settings = {"target_modules": ["c_attn", "c_proj", "c_fc"], "r": 4, "lora_alpha": 8, "init_lora_weights": False, **config}
    peft_model = get_peft_model(model, LoraConfig(**settings))
    if perturb:
        with torch.no_grad():
            for p in peft_model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    make_hf_model(folder, seed=7, **CONFIG)
    return folder


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, base_dir) -> Path:
    return make_lora(tmp_path_factory.mktemp("adapters") / "my-lora", hf_base(base_dir))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, base_dir, lora_dir):
    """The adapter exported once, by the CLI as a user runs it, to its default folder: (exit code, stdout, folder)."""
    root = tmp_path_factory.mktemp("exports")
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(io.StringIO()) as stdout:
        mp.setenv(EXPORTS_ENV, str(root))
        mp.setattr(sys, "argv", ["gpt2x", "export", "--model", str(base_dir), "--adapter", str(lora_dir)])
        with pytest.raises(SystemExit) as exc:
            main()
    return exc.value.code, stdout.getvalue(), default_export_dir(f"{base_dir}+my-lora", Precision.fp32, root)


def pefts_logits(base_dir: Path, lora_dir: Path, ids: np.ndarray, merged: bool = True) -> np.ndarray:
    """PEFT's own model (merge_and_unload, or the adapter at run time) on transformers' GPT-2 read from the base's
    folder: independent of how gpt2x builds it."""
    model = PeftModel.from_pretrained(hf_base(base_dir), str(lora_dir)).eval()
    if merged:
        model = model.merge_and_unload()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


def test_the_cli_exports_the_merged_model_to_its_own_folder(exported, base_dir, lora_dir):
    code, stdout, folder = exported
    assert code == 0, stdout
    lines = stdout.strip().splitlines()
    assert lines[0] == f"exported {base_dir}+my-lora (fp32) to {folder}"
    assert lines[1].startswith(f"LoRA adapter {lora_dir} (r 4, lora_alpha 8, 8 layers) merged into {base_dir}: parity "
                               "passed against PEFT's merged model"), lines[1]
    assert any(line.startswith("parity passed on cpu") for line in lines[2:]), stdout
    assert folder.name.endswith("+my-lora-fp32")


def test_the_export_records_its_base_and_adapter(exported, base_dir, lora_dir):
    info = read_export(exported[2])
    model = info.meta["model"]
    assert model["name"] == f"{base_dir}+my-lora" and model["kind"] == "local"
    assert model["weights_sha256"] == weights_fingerprint(resolve(str(base_dir))[0])  # the base's files
    record = model["adapter"]
    assert record["path"] == str(lora_dir) and record["base"] == str(base_dir)
    assert record["sha256"] == sha256(lora_dir / adapters.WEIGHTS_FILE)
    assert record["config_sha256"] == sha256(lora_dir / adapters.CONFIG_FILE)
    assert (record["r"], record["lora_alpha"], record["target_modules"]) == (4, 8, ["c_attn", "c_fc", "c_proj"])
    assert record["modules"] == [f"h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    gate = record["parity"]
    assert gate["status"] == "passed" and gate["tolerance"]["max_rel"] == TOL
    assert gate["peft_merged"]["max_rel"] <= TOL and gate["peft"]["max_rel"] <= TOL
    assert gate["change"] > 100 * TOL  # the random adapter moves the logits
    assert info.meta["parity"]["status"] == "passed"  # the ONNX gate, on the merged model


def test_the_exported_logits_are_pefts_merged_model_not_the_bases(exported, base_dir, lora_dir):
    ids = np.random.default_rng(5).integers(0, 50257, (2, 11))
    mask = np.ones_like(ids)
    with OrtBackend(read_export(exported[2])) as backend:
        got, _ = backend.run(ids, mask, positions(mask, ids.shape[1]), None)
    want = pefts_logits(base_dir, lora_dir, ids)
    assert logit_stats(want.reshape(-1, want.shape[-1]), got.reshape(-1, got.shape[-1]))["max_rel"] <= TOL
    with torch.no_grad():
        base = hf_base(base_dir)(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert logit_stats(base.reshape(-1, base.shape[-1]), got.reshape(-1, got.shape[-1]))["max_rel"] > 100 * TOL


def test_an_adapter_export_is_not_its_bases(exported, base_dir):
    info = read_export(exported[2])
    with pytest.raises(ArtifactError, match=r"with the LoRA adapter .* merged in, not"):
        check_export_matches(info, str(base_dir))
    check_export_matches(info, info.meta["model"]["name"])  # the name it records


def test_an_adapter_saved_with_fan_in_fan_out_false_is_merged_right(tmp_path, base_dir, lora_dir):
    """GPT-2's Conv1D layers hold [in, out]: PEFT corrects an adapter that says otherwise, and the gate checks it did."""
    folder = tmp_path / "said-false"
    folder.mkdir()
    config = json.loads((lora_dir / adapters.CONFIG_FILE).read_text())
    (folder / adapters.CONFIG_FILE).write_text(json.dumps(config | {"fan_in_fan_out": False}))
    (folder / adapters.WEIGHTS_FILE).write_bytes((lora_dir / adapters.WEIGHTS_FILE).read_bytes())
    model, _, record = load_adapted(str(base_dir), folder)
    assert record["parity"]["peft"]["max_rel"] <= TOL
    ids = adapters.gate_ids(model.config)
    with torch.no_grad():
        ours = model(torch.from_numpy(ids))[0].numpy()
    want = pefts_logits(base_dir, lora_dir, ids, merged=False)
    assert logit_stats(want.reshape(-1, want.shape[-1]), ours.reshape(-1, ours.shape[-1]))["max_rel"] <= TOL


@pytest.mark.parametrize("variant", [{"use_dora": True}, {"use_rslora": True, "rank_pattern": {"c_fc": 2}, "alpha_pattern": {"c_attn": 3}},
                                     {"bias": "lora_only", "lora_bias": True}, {"layers_to_transform": [1]}],
                         ids=["dora", "rslora-patterns", "biases", "one-layer"])
def test_pefts_lora_variants_merge_to_the_adapter_at_run_time(tmp_path, base_dir, variant):
    folder = make_lora(tmp_path / "variant", hf_base(base_dir), perturb=True, **variant)
    model, _, record = load_adapted(str(base_dir), folder)
    assert record["parity"]["change"] > 100 * TOL
    ids = np.random.default_rng(6).integers(0, 50257, (2, 9))
    with torch.no_grad():
        ours = model(torch.from_numpy(ids))[0].numpy()
    want = pefts_logits(base_dir, folder, ids, merged=False)
    assert logit_stats(want.reshape(-1, want.shape[-1]), ours.reshape(-1, ours.shape[-1]))["max_rel"] <= TOL


def _transposed_square_deltas(monkeypatch):
    """PEFT's merge with fan_in_fan_out ignored: the delta of each square Conv1D layer (attn.c_proj) added transposed
    (the other layers' would not fit), as a merge that forgets GPT-2's Conv1D layout does."""
    original = LoraLinear.get_delta_weight

    def transposed(self, adapter):
        delta = original(self, adapter)
        return delta.T if delta.shape[0] == delta.shape[1] else delta

    monkeypatch.setattr(LoraLinear, "get_delta_weight", transposed)
    return "against the adapter applied at run time (PeftModel)"


def _gpt2x_keeps_conv1d_layout(monkeypatch):
    """gpt2x reading the merged Conv1D weights without transposing the square ones."""
    build = adapters.build_model

    def untransposed(cfg, sd):
        return build(cfg, {k: v.T if k.endswith("attn.c_proj.weight") else v for k, v in sd.items()})

    monkeypatch.setattr(adapters, "build_model", untransposed)
    return "against PEFT's merged model (merge_and_unload)"


@pytest.mark.parametrize("bug", [_transposed_square_deltas, _gpt2x_keeps_conv1d_layout])
def test_the_gate_fails_a_merge_that_got_conv1d_wrong_and_nothing_is_written(monkeypatch, tmp_path, base_dir, lora_dir, bug):
    caught_by = bug(monkeypatch)
    out = tmp_path / "never"
    with pytest.raises(ParityError, match="the merged model is out of tolerance") as e:
        export_by_name(str(base_dir), out, adapter=lora_dir)
    assert caught_by in str(e.value) and len(str(e.value).splitlines()) == 1
    assert not out.exists()


@pytest.fixture
def shaped(tmp_path):
    """shaped(name, config=None, **lora): an adapter (make_lora's, with `lora` for LoraConfig) made by PEFT on another
    tiny GPT-2, of `config`'s overrides."""
    def make(name: str, config: dict | None = None, **lora) -> Path:
        model = make_hf_model(tmp_path / f"{name}-base", seed=3, **{**CONFIG, **(config or {})})
        return make_lora(tmp_path / name, model, **lora)

    return make


def test_an_adapter_of_another_shape_is_one_line_naming_the_module(capsys, shaped, base_dir, tmp_path):
    wide = shaped("wide", {"n_embd": 64})
    capsys.readouterr()  # transformers' progress bars while saving it
    out = tmp_path / "out"
    code, _, err = cli(capsys, "export", "--model", str(base_dir), "--adapter", str(wide), "--out", str(out))
    assert_one_line_error(code, err, WeightsError.exit_code, "does not fit the base: h.0.attn.c_attn has lora_A [4, 64]")
    assert not out.exists()
    deeper = shaped("deeper", {"n_layer": 3})
    with pytest.raises(WeightsError, match=r"it adapts h\.2\.attn\.c_attn, and the base has 2 layers"):
        load_adapted(str(base_dir), deeper)


def test_what_is_not_a_peft_lora_adapter_is_refused(tmp_path, base_dir, lora_dir, shaped):
    with pytest.raises(ModelNotFoundError, match="no such adapter folder"):
        load_adapted(str(base_dir), tmp_path / "nowhere")
    with pytest.raises(WeightsError, match=r"not a PEFT adapter folder \(no adapter_config\.json"):
        load_adapted(str(base_dir), base_dir)  # a model's folder

    ia3 = tmp_path / "ia3"
    get_peft_model(hf_base(base_dir), IA3Config(target_modules=["c_attn", "mlp.c_proj"],
                                                 feedforward_modules=["mlp.c_proj"])).save_pretrained(ia3)
    with pytest.raises(WeightsError, match="holds an adapter of peft_type IA3"):
        load_adapted(str(base_dir), ia3)

    with pytest.raises(WeightsError, match=r"adapts wte, which gpt2x does not merge"):
        load_adapted(str(base_dir), shaped("embedding", target_modules=["wte"]))
    with pytest.raises(WeightsError, match=r"modules_to_save set"):
        load_adapted(str(base_dir), shaped("saves", modules_to_save=["ln_f"]))

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / adapters.CONFIG_FILE).write_bytes((lora_dir / adapters.CONFIG_FILE).read_bytes())
    (corrupt / adapters.WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(WeightsError, match="cannot read"):
        load_adapted(str(base_dir), corrupt)
    (corrupt / adapters.WEIGHTS_FILE).unlink()
    (corrupt / adapters.PICKLED_WEIGHTS_FILE).write_bytes(b"a pickle")
    with pytest.raises(WeightsError, match="gpt2x never unpickles"):
        load_adapted(str(base_dir), corrupt)


def test_weights_for_fewer_layers_than_target_modules_name_are_refused(tmp_path, base_dir, lora_dir):
    """PEFT would leave the layers whose weights are missing at their initialisation (random here) and warn."""
    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / adapters.CONFIG_FILE).write_bytes((lora_dir / adapters.CONFIG_FILE).read_bytes())
    tensors = load_file(lora_dir / adapters.WEIGHTS_FILE)
    save_file({k: v for k, v in tensors.items() if ".c_fc." not in k}, folder / adapters.WEIGHTS_FILE)
    with pytest.raises(WeightsError, match=r"target_modules adapt .*h\.0\.mlp\.c_fc.*they must name the same layers"):
        load_adapted(str(base_dir), folder)


def test_layout_transformers_js_and_a_missing_peft_are_one_line(capsys, monkeypatch, base_dir, lora_dir):
    code, _, err = cli(capsys, "export", "--model", str(base_dir), "--adapter", str(lora_dir), "--layout", "transformers.js")
    assert_one_line_error(code, err, UsageError.exit_code, "--adapter applies to --layout gpt2x")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails, as without the adapters extra
    with pytest.raises(MissingDependencyError, match=r"pip install 'gpt2x\[adapters\]'"):
        load_adapted(str(base_dir), lora_dir)
