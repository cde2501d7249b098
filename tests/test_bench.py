"""The bench's arithmetic against hand-computed cases, its JSON, and its parity gate."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from gpt2x.bench import roofline
from gpt2x.bench import run as bench
from gpt2x.bench.report import bench_tables
from gpt2x.choices import BackendKind, Precision
from gpt2x.evaluate import metrics
from gpt2x.evaluate.metrics import kl_divergence, logit_stats
from gpt2x.evaluate.parity import check
from gpt2x.model.config import PRESETS
from gpt2x.model.weights import load_model
from gpt2x.onnx.artifact import default_export_dir, is_export
from gpt2x.runtime import pytorch
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.tokenizer import encode

from .conftest import make_hf_model
from .test_cli import assert_one_line_error, cli


def test_percentiles_hand_computed():
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert metrics.percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    s = metrics.summarize_latencies([0.001, 0.002, 0.003])
    assert s["p50_ms"] == pytest.approx(2.0) and s["mean_ms"] == pytest.approx(2.0)


def test_kl_and_cross_entropy_hand_computed():
    p = np.log(np.array([[0.5, 0.5]]))
    q = np.log(np.array([[0.25, 0.75]]))
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(p, q)[0] == pytest.approx(want)
    assert kl_divergence(p, p)[0] == pytest.approx(0.0)
    logits = np.log(np.array([[0.2, 0.8], [0.6, 0.4]]))
    assert metrics.cross_entropy(logits, np.array([1, 0])) == pytest.approx(-(math.log(0.8) + math.log(0.6)) / 2)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    vocab = 7
    ppl = metrics.perplexity(lambda x: np.zeros((1, x.shape[1], vocab)), [i % vocab for i in range(50)], window=8)
    assert ppl == pytest.approx(vocab)


def test_perplexity_counts_every_target_once():
    seen = []

    def fake(x):
        seen.append(x.shape[1])
        return np.zeros((1, x.shape[1], 3))

    metrics.perplexity(fake, [i % 3 for i in range(21)], window=8)
    assert seen == [8, 8, 4]  # 20 targets in windows of 8, 8 and 4


def test_roofline_matches_the_briefs_figures():
    """44 GB/s reads: 89 tok/s for fp32 GPT-2 124M, 357 for int8 (figures given by the issue)."""
    cfg = PRESETS["gpt2"][1]
    # The figures are rounded (and count biases slightly differently): agree within 1%.
    assert roofline.roofline_tokens_per_s(44e9, cfg, Precision.fp32, 1, 0) == pytest.approx(89, rel=0.01)
    # int8 as stored: 1 byte per weight plus one fp32 scale per 128 weights (the 357 counted none).
    assert roofline.roofline_tokens_per_s(44e9, cfg, Precision.int8, 1, 0) == pytest.approx(357 / (1 + 4 / 128), rel=0.01)
    # The KV cache adds 2 * layers * context * C * 4 bytes per row.
    extra = roofline.decode_bytes_per_step(cfg, Precision.fp32, 2, 100) - roofline.decode_bytes_per_step(cfg, Precision.fp32, 2, 0)
    assert extra == 2 * 12 * 2 * 100 * 768 * 4


def test_logit_stats_hand_computed():
    ref = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    got = np.array([[1.0, 2.5, 3.0], [0.0, 0.0, 4.0]])
    s = logit_stats(ref, got)
    assert s["max_abs"] == 0.5 and s["scale"] == 4.0 and s["max_rel"] == 0.125
    assert s["top1_agreement"] == 1.0
    assert logit_stats(ref, np.array([[3.0, 2.0, 1.0], [0.0, 0.0, 4.0]]))["top1_agreement"] == 0.5


NUM = (int, float)
OPT_NUM = (int, float, type(None))
LOGITS = {"positions": int, "max_abs": NUM, "p99_abs": NUM, "scale": NUM, "max_rel": NUM, "worst_row_max_abs": NUM,
          "top1_agreement": NUM, "mean_kl": NUM, "present_max_rel": NUM, "cases": list}
TOLERANCE = {"max_rel": NUM, "max_kl": NUM, "min_top1": OPT_NUM, "min_greedy": NUM, "why": str}
# Every field of `gpt2x bench --json` (README, "gpt2x bench"): a dict is a nested object, [x] a list of x.
class Opt:
    """A field that may be absent; where present, of the type given."""

    def __init__(self, schema):
        self.schema = schema


BENCH_SCHEMA = {
    "schema_version": int,
    "settings": {"model": str, "provider": str, "backends": [str], "precisions": [str], "batches": [int],
                 "prompt_len": int, "new_tokens": int, "repeat": int, "warmup": int, "threads": int, "text": str,
                 "greedy_tokens": int, "drafts": [str], "draft_tokens": int, "prompt_text": (str, type(None))},
    "environment": dict,
    "model": {"name": str, "config": {"vocab_size": int, "n_positions": int, "n_embd": int, "n_layer": int, "n_head": int,
                                      "layer_norm_epsilon": float}, "parameters": int},
    "bandwidth": {"kind": str, "samples_bytes_per_s": [float], "bytes_per_s": float},
    "reference": {"backend": str, "precision": str, "perplexity": float, "text_tokens": int},
    "parity": [{"backend": str, "precision": str, "source": str, "passed": bool, "message": str, "logits": LOGITS,
                "greedy": {"tokens": int, "identical_prefix": [int], "share": NUM}, "tolerance": TOLERANCE,
                "perplexity": float, "perplexity_rel_change": float}],
    "speed": [{"backend": str, "precision": str, "batch": int, "cold_start_s": float, "ttft_ms": float,
               "decode_latency": {"p50_ms": float, "p90_ms": float, "p99_ms": float, "mean_ms": float},
               "decode_tokens_per_s": float, "e2e_tokens_per_s": float, "roofline_tokens_per_s": float,
               "roofline_share": float, "peak_rss_mb": float,
               "latency_by_context": [{"context": int, "ms": float}],
               # against ort at the same precision and batch, in rows of other backends where ort ran
               "native_share": Opt(float), "native_ttft_ratio": Opt(float),
               # the web backend's rows (tests/test_web.py)
               "page_memory_mb": Opt(float), "page": Opt(dict), "page_ttft_ms": Opt(float),
               "page_decode_tokens_per_s": Opt(float), "page_decode_latency": Opt(dict), "page_native_share": Opt(float)}],
    "speculative": [{"backend": str, "precision": str, "draft": str, "draft_name": str, "draft_tokens": int, "adaptive": bool,
                     "prompt_len": int, "new_tokens": int, "timed_runs": int,
                     "acceptance_rate": OPT_NUM, "mean_acceptance_length": OPT_NUM,
                     "drafted": int, "accepted": int, "drafts": int, "plain_steps": int,
                     "decode_tokens_per_s": float, "plain_decode_tokens_per_s": float, "speedup": float,
                     "ttft_ms": float, "plain_ttft_ms": float, "step_cost_ms": [float], "step_cost_ratio": [float],
                     "greedy_identical": bool, "first_difference": (int, type(None))}],
    "skipped": [{"backend": str, "precision": str, "reason": str}],
    "passed": bool,
}
ENVIRONMENT = {"gpt2x": str, "date": str, "platform": str, "cpu": str, "cores": int, "gpu": str, "packages": dict,
               "providers listed": str, "providers loadable": dict, "hub cache": str, "hub offline": bool,
               "exports": str, "git": str}


def validate(value, schema, where: str = "result") -> None:
    """`value` has exactly the fields of `schema`, each of its type (recursively)."""
    if isinstance(schema, dict):
        assert isinstance(value, dict), where
        required = {key for key, sub in schema.items() if not isinstance(sub, Opt)}
        assert required <= set(value) <= set(schema), \
            f"{where}: fields {sorted((set(value) - set(schema)) | (required - set(value)))} differ"
        for key, sub in schema.items():
            if key in value:
                validate(value[key], sub.schema if isinstance(sub, Opt) else sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            validate(item, schema[0], f"{where}[{i}]")
    else:
        assert isinstance(value, schema) and not (schema is int and isinstance(value, bool)), f"{where}: {value!r}"


def test_bench_environment_fields():
    from gpt2x.bench.system import system_info

    validate(json.loads(json.dumps(system_info())), ENVIRONMENT, "environment")


class Perturbed(TorchBackend):
    """A backend whose logits carry noise: the gate must catch it."""

    def run(self, *args):
        logits, present = super().run(*args)
        return logits + np.random.default_rng(0).normal(0, 0.5, logits.shape).astype(np.float32), present

    def step(self, *args):
        logits, present = super().step(*args)
        return logits + np.random.default_rng(1).normal(0, 0.5, logits.shape).astype(np.float32), present


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-bench")
    make_hf_model(folder, seed=21)
    return load_model(str(folder))


def test_perturbed_backend_fails_the_gate_and_a_clean_one_passes(tiny):
    model, _ = tiny
    assert check(TorchBackend(model), TorchBackend(model), Precision.fp32)["status"] == "passed"
    bad = check(TorchBackend(model), Perturbed(model), Precision.fp32)
    assert bad["status"] == "failed" and "max |Δlogit|" in bad["message"]


def test_run_bench_json_schema_and_gate(tiny, tmp_path, monkeypatch):
    model, source = tiny
    monkeypatch.chdir(tmp_path)  # exports land in ./exported
    s = bench.BenchSettings(model="tiny", backends=[BackendKind.torch, BackendKind.ort],
                            precisions=[Precision.fp32], batches=[1, 2], prompt_len=4, new_tokens=6, repeat=1)
    result = bench.run_bench(s, {"cpu": "test", "cores": 1}, loaded=(model, source))
    assert result["passed"] is True
    # Rows of a backend other than ort, where ort ran at the same precision and batch: the share of native.
    natives = {(e["precision"], e["batch"]): e for e in result["speed"] if e["backend"] == "ort"}
    for e in result["speed"]:
        if e["backend"] == "torch":
            ort = natives[(e["precision"], e["batch"])]
            assert e["native_share"] == pytest.approx(e["decode_tokens_per_s"] / ort["decode_tokens_per_s"])
            assert e["native_ttft_ratio"] == pytest.approx(e["ttft_ms"] / ort["ttft_ms"])
        else:
            assert "native_share" not in e
    validate(json.loads(json.dumps(result)), BENCH_SCHEMA)  # serialisable as is, every field the README names
    assert result["schema_version"] == 3 and result["speculative"] == []  # no --draft: no rows, the list is there
    assert [(p["backend"], p["precision"]) for p in result["parity"]] == [("torch", "fp32"), ("ort", "fp32")]
    assert len(result["speed"]) == 4 and result["skipped"] == []
    for e in result["speed"]:
        assert e["decode_tokens_per_s"] > 0 and 0 < e["roofline_share"]
        assert set(e["decode_latency"]) == {"p50_ms", "p90_ms", "p99_ms", "mean_ms"}
        assert e["latency_by_context"][0]["context"] >= 5
    ort_ppl = result["parity"][1]["perplexity"]
    assert ort_ppl == pytest.approx(result["reference"]["perplexity"], rel=1e-4)

    # Every torch backend the bench opens is perturbed, the reference included; the reference is
    # compared with itself only through a second instance, so the noise (seeded per call) differs.
    monkeypatch.setattr(pytorch, "TorchBackend", Perturbed)
    s.backends = [BackendKind.ort]
    assert bench.run_bench(s, {"cores": 1}, loaded=(model, source))["passed"] is False


def test_combos_say_what_is_left_out():
    s = bench.BenchSettings(precisions=[Precision.fp32, Precision.int8, Precision.fp16])
    pairs, skipped = bench.combos(s)
    assert pairs == [(BackendKind.torch, Precision.fp32), (BackendKind.ort, Precision.fp32), (BackendKind.ort, Precision.int8)]
    assert {(x["backend"], x["precision"]) for x in skipped} == {("torch", "int8"), ("torch", "fp16"), ("ort", "fp16")}


@pytest.mark.parametrize("precision", [Precision.int8, Precision.int4])
def test_roofline_counts_the_bytes_the_export_stores(tiny, tmp_path, precision):
    """The roofline's bytes for the quantized matrices equal the bytes of the MatMulNBits weights and
    scales in a real export (an independent count, from the ONNX file)."""
    import onnx
    from onnx import numpy_helper

    from gpt2x.workflows import export_model

    model, source = tiny
    info = export_model(model, source, tmp_path / precision.value, precision)
    proto = onnx.load(str(info.model_path))
    inits = {i.name: i for i in proto.graph.initializer}
    stored = sum(numpy_helper.to_array(inits[name]).nbytes for n in proto.graph.node if n.op_type == "MatMulNBits"
                 for name in n.input[1:3] if name in inits)
    cfg = model.config
    zero = {"batch": 1, "context": 0}
    fp32 = roofline.decode_bytes_per_step(cfg, Precision.fp32, **zero)
    matrices_fp32 = (cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd) * 4
    assert roofline.decode_bytes_per_step(cfg, precision, **zero) == pytest.approx(fp32 - matrices_fp32 + stored, rel=1e-6)


# ---------------------------------------------------------------- speculative decoding (--draft)

GROUNDED = "to be or not to be, that is the question: to be or not to be, that is"


def rendered(result: dict) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=300)
    for table in bench_tables(result):
        console.print(table)
    return console.file.getvalue()


@pytest.mark.parametrize("kwargs,option", [
    ({"warmup": -1}, "warmup"), ({"batches": [0]}, "batch"), ({"draft_tokens": 0}, "draft_tokens"),
    ({"draft_tokens": 33}, "draft_tokens"), ({"prompt_text": ""}, "prompt_text"),
])
def test_bench_settings_refuse_bad_values(kwargs, option):
    from gpt2x.errors import UsageError

    with pytest.raises(UsageError) as e:
        bench.BenchSettings(**kwargs)
    assert e.value.option == option


def test_first_difference():
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2


def test_run_bench_speculative_rows(tiny, tmp_path, monkeypatch):
    """--draft: one row per backend x precision that rolls back x draft, measured at batch 1 whatever
    the batches, each against plain decoding of the same target in the same run; a backend that cannot
    roll back has none, and says why."""
    model, source = tiny
    monkeypatch.chdir(tmp_path)  # exports, the int8 draft's too, land in ./exported
    monkeypatch.setattr(bench, "cpu_read_bandwidth", lambda threads: 20e9)  # not what this test checks
    s = bench.BenchSettings(model=source.name, backends=[BackendKind.torch, BackendKind.ort], precisions=[Precision.fp32],
                            batches=[2], prompt_len=4, new_tokens=10, repeat=1, drafts=["ngram", "int8"], draft_tokens=3,
                            prompt_text=GROUNDED)
    result = bench.run_bench(s, {"cpu": "test", "cores": 1}, loaded=(model, source))
    validate(json.loads(json.dumps(result)), BENCH_SCHEMA)
    assert is_export(default_export_dir(source.name, Precision.int8))  # exported on first use, here
    assert [e["batch"] for e in result["speed"]] == [2, 2]
    rows = result["speculative"]
    assert [(r["backend"], r["precision"], r["draft"]) for r in rows] == [
        ("torch", "fp32", "ngram"), ("torch", "fp32", "int8"), ("ort", "fp32", "ngram"), ("ort", "fp32", "int8")]
    for r in rows:
        assert (r["prompt_len"], r["new_tokens"], r["draft_tokens"], r["adaptive"]) == (len(encode(GROUNDED)), 10, 3, True)
        assert 0 <= r["accepted"] <= r["drafted"] <= 3 * r["drafts"]
        if r["drafts"]:
            assert 0 <= r["acceptance_rate"] <= 1 and r["acceptance_rate"] == r["accepted"] / r["drafted"]
            assert r["mean_acceptance_length"] == 1 + r["accepted"] / r["drafts"]
        else:
            assert r["acceptance_rate"] is None and r["mean_acceptance_length"] is None
        assert r["decode_tokens_per_s"] > 0 and r["plain_decode_tokens_per_s"] > 0 and r["ttft_ms"] > 0
        assert r["speedup"] == pytest.approx(r["decode_tokens_per_s"] / r["plain_decode_tokens_per_s"])
        assert len(r["step_cost_ms"]) == 8 and min(r["step_cost_ms"]) > 0
        assert r["step_cost_ratio"][0] == 1.0 and r["step_cost_ratio"][7] == pytest.approx(r["step_cost_ms"][7] / r["step_cost_ms"][0])
        if r["draft"] == "ngram":  # an fp32 target with prompt lookup: plain greedy decoding's tokens
            assert r["greedy_identical"] is True and r["first_difference"] is None
        else:  # a model draft proposes from the first speculative round on (the second decode step)
            assert r["drafts"] >= 1 and r["draft_name"] == f"{source.name} int8"
    text = rendered(result)
    assert "Speculative decoding" in text and "int8" in text and "step cost" in text

    monkeypatch.setattr(OrtBackend, "rolls_back", False)
    s.backends, s.drafts = [BackendKind.ort], ["ngram"]
    again = bench.run_bench(s, {"cpu": "test", "cores": 1}, loaded=(model, source))
    assert again["speculative"] == [] and len(again["speed"]) == 1
    [skip] = again["skipped"]
    assert (skip["backend"], skip["precision"], skip["draft"]) == ("ort", "fp32", "ngram") and "roll back" in skip["reason"]
    assert "not run: ort/fp32 with ngram" in rendered(again)


def test_bench_cli_draft_json(tiny, tmp_path, monkeypatch, capsys):
    """`gpt2x bench --draft ngram --json F` writes the speculative rows (torch: no export to make)."""
    _, source = tiny
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "cpu_read_bandwidth", lambda threads: 20e9)
    out_json = tmp_path / "b.json"
    code, out, err = cli(capsys, "bench", "--model", source.name, "--backends", "torch", "--precisions", "fp32",
                         "--prompt-len", "4", "--new-tokens", "6", "--repeat", "1", "--draft", "ngram",
                         "--draft-tokens", "2", "--json", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert result["schema_version"] == 3 and result["settings"]["drafts"] == ["ngram"]
    [row] = result["speculative"]
    assert (row["backend"], row["draft"], row["draft_tokens"], row["prompt_len"]) == ("torch", "ngram", 2, 4)
    assert "Speculative decoding" in out


@pytest.mark.parametrize("args,error,fragment", [
    (["--draft", "foo"], None, "draft foo is neither ngram"),
    (["--draft", "fp16"], "ProviderError", "draft fp16"),
    (["--draft", "ngram", "--draft-tokens", "0"], "UsageError", "--draft-tokens"),
    (["--draft", "ngram", "--prompt-text", ""], "UsageError", "--prompt-text"),
])
def test_bench_cli_bad_draft_is_one_line(tmp_path, monkeypatch, capsys, args, error, fragment):
    """Refused before any work: nothing is loaded or exported (the export folder stays absent)."""
    from gpt2x import errors

    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "bench", "--backends", "ort", *args)
    if error is None:  # the model lookup's error: HubError offline, ModelNotFoundError online
        assert code in (errors.HubError.exit_code, errors.ModelNotFoundError.exit_code), err
        assert_one_line_error(code, err, code, fragment)
    else:
        assert_one_line_error(code, err, getattr(errors, error).exit_code, fragment)
    assert not (tmp_path / "exported").exists()
