"""The bench's arithmetic against hand-computed cases, its JSON, and its parity gate."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import numpy as np
import pytest

from gpt2x.bench import roofline
from gpt2x.bench import run as bench
from gpt2x.bench.report import bench_tables
from gpt2x.bench.results import BenchResult
from gpt2x.choices import BackendKind, KvCache, Precision, ProviderKind
from gpt2x.errors import UsageError
from gpt2x.evaluate import metrics
from gpt2x.evaluate.metrics import kl_divergence, logit_stats
from gpt2x.evaluate.parity import check
from gpt2x.model.config import PRESETS
from gpt2x.model.weights import load_model
from gpt2x.onnx.artifact import EXPORTS_ENV, default_export_dir, is_export
from gpt2x.runtime import pytorch
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.runtime.registry import REGISTRY
from gpt2x.tokenizer import encode

from ..helpers import BENCH_SCHEMA, REPO, StepClock, assert_one_line_error, cli, greedy_counts, make_hf_model, validate


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


def test_kl_is_torchs_float64_kl_on_vocabulary_wide_rows():
    """Against torch's kl_div in float64 on GPT-2-wide rows: random logits, logits near a row's own (the fp32 gate's
    KL of 1e-6 and far below: the subtraction of the two log-sum-exps must not swamp it), a peaked row, equal rows."""
    import torch

    rng = np.random.default_rng(5)
    p = rng.normal(0, 4, (6, 50257)).astype(np.float32)
    q = p + rng.normal(0, 1, p.shape).astype(np.float32) * np.array([1, 1e-2, 1e-4, 1e-6, 0, 1], np.float32)[:, None]
    p[5, 7] = q[5, 7] = 60.0  # nearly all of the row's mass on one token
    lp = torch.log_softmax(torch.from_numpy(p).double(), -1)
    lq = torch.log_softmax(torch.from_numpy(q).double(), -1)
    want = torch.nn.functional.kl_div(lq, lp, reduction="none", log_target=True).sum(-1).numpy()
    got = kl_divergence(p, q)
    assert want[3] < 1e-11 and want[4] == 0.0  # the cases meant
    # float64's rounding over 50,257 terms of order one: a few 1e-15 (as for log-softmaxes subtracted entry by entry)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-14)


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




ENVIRONMENT = {"gpt2x": str, "date": str, "platform": str, "cpu": str, "cores": int, "gpu": str, "packages": dict,
               "providers listed": str, "providers loadable": dict, "hub cache": str, "hub offline": bool,
               "exports": str, "git": str}




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


@pytest.fixture
def quick_bench(monkeypatch, tmp_path):
    """For bench tests that check neither the bandwidth nor the perplexity: the bandwidth a constant (its measure
    takes seconds a run), and a short text (its path, for BenchSettings.text)."""
    monkeypatch.setattr(bench, "cpu_read_bandwidth", lambda threads: 20e9)
    text = tmp_path / "short.txt"
    text.write_text(GROUNDED * 4, encoding="utf-8")
    return text


def test_perturbed_backend_fails_the_gate_and_a_clean_one_passes(tiny):
    model, _ = tiny
    assert check(TorchBackend(model), TorchBackend(model), Precision.fp32)["status"] == "passed"
    bad = check(TorchBackend(model), Perturbed(model), Precision.fp32)
    assert bad["status"] == "failed" and "max |Δlogit|" in bad["message"]


def test_run_bench_json_schema_and_gate(tiny, tmp_path, monkeypatch):
    model, source = tiny
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    # The bandwidth still measured, on 64 MiB twice (the bench's 1 GiB seven times took 8 s a sample), and the
    # perplexity scored on a short text: both still go through the bench's own path into the result.
    monkeypatch.setattr(bench, "cpu_read_bandwidth", lambda threads: roofline.cpu_read_bandwidth(threads, megabytes=64, repeats=2))
    text = tmp_path / "short.txt"
    text.write_text(GROUNDED * 4, encoding="utf-8")
    s = bench.BenchSettings(model="tiny", backends=[BackendKind.torch, BackendKind.ort], text=text,
                            precisions=[Precision.fp32], batches=[1, 2], prompt_len=4, new_tokens=6, repeat=1)
    # A forward costs 3 + 1 per new position ms on torch, 1 + 1 on ort: the 4-token prefill 7 and 5 ms,
    # a decode step 4 and 2 ms (250 and 500 tokens/s per row).
    StepClock(monkeypatch, {TorchBackend: (3, 1), OrtBackend: (1, 1)})
    result = bench.run_bench(s, {"cpu": "test", "cores": 1}, loaded=(model, source))
    assert result.passed is True
    want = {BackendKind.torch: (7.0, 4.0), BackendKind.ort: (5.0, 2.0)}  # (time to first token, decode step) in ms
    for e in result.speed:
        ttft_ms, step_ms = want[e.backend]
        assert e.ttft_ms == pytest.approx(ttft_ms) and e.decode_latency["p50_ms"] == pytest.approx(step_ms)
        assert e.decode_tokens_per_s == pytest.approx(e.batch * 1e3 / step_ms)
        # Rows of a backend other than ort, where ort ran at the same precision and batch: the share of native.
        if e.backend is BackendKind.torch:
            assert e.native_share == pytest.approx(2 / 4) and e.native_ttft_ratio == pytest.approx(7 / 5)
        else:
            assert e.native_share is None and e.native_ttft_ratio is None
    written = json.loads(result.to_json())
    validate(written, BENCH_SCHEMA)  # every field the README names, and no other
    assert [("native_share" in e, "native_ttft_ratio" in e) for e in written["speed"]] == \
        [(e["backend"] == "torch",) * 2 for e in written["speed"]]  # ort's rows have no share of themselves
    # ort's rows say which runtime ran the prompt (this fp32 export has no OpenVINO prefill graph)
    assert [e.get("prefill") for e in written["speed"]] == [None if e["backend"] == "torch" else "onnxruntime" for e in written["speed"]]
    assert BenchResult.from_json(result.to_json()) == result  # read back, every figure as it was
    assert written["schema_version"] == 4 and result.speculative == []  # no --draft: no rows, the list is there
    assert written["speculative"] == []
    assert [(p.backend, p.precision) for p in result.parity] == [(BackendKind.torch, Precision.fp32), (BackendKind.ort, Precision.fp32)]
    assert len(result.speed) == 4 and result.skipped == []
    for e in result.speed:
        assert e.decode_tokens_per_s > 0 and 0 < e.roofline_share
        assert set(e.decode_latency) == {"p50_ms", "p90_ms", "p99_ms", "mean_ms"}
        assert e.latency_by_context[0].context >= 5
    ort_ppl = result.parity[1].perplexity
    assert ort_ppl == pytest.approx(result.reference.perplexity, rel=1e-4)
    # The clock above makes ort's batch-2 rows the most tokens/s (2 rows per 2 ms step) and its batch-1
    # prefill the first token soonest (5 ms against torch's 7).
    assert written["fastest"] == [
        {"goal": "decode", "backend": "ort", "precision": "fp32", "batch": 2,
         "decode_tokens_per_s": pytest.approx(1000), "ttft_ms": pytest.approx(5)},
        {"goal": "first_token", "backend": "ort", "precision": "fp32", "batch": 1,
         "decode_tokens_per_s": pytest.approx(500), "ttft_ms": pytest.approx(5)},
    ]

    # Every torch backend the bench opens is perturbed, the reference included; the reference is
    # compared with itself only through a second instance, so the noise (seeded per call) differs.
    monkeypatch.setattr(pytorch, "TorchBackend", Perturbed)
    s.backends = [BackendKind.ort]
    failed = bench.run_bench(s, {"cores": 1}, loaded=(model, source))
    assert failed.passed is False and json.loads(failed.to_json())["passed"] is False
    assert failed.speed and failed.fastest == []  # a configuration that fails its gate is never named fastest


def upgraded(old: dict) -> dict:
    """A result file of an earlier schema as schema 4 writes it (the README's history of the schema):
    schema 1 had no speculative rows nor their settings; schemas 2 and 3 called K `draft_tokens`; none had kv_cache."""
    new = json.loads(json.dumps(old))
    new["schema_version"] = 4
    settings = new["settings"]
    if old["schema_version"] == 1:
        settings.update(drafts=[], num_speculative_tokens=None, prompt_text=None)
        new["speculative"] = []
    if "draft_tokens" in settings:
        settings["num_speculative_tokens"] = settings.pop("draft_tokens")
    settings.setdefault("kv_cache", "auto")  # added within schema 4
    for row in new["speculative"]:
        row["num_speculative_tokens"] = row.pop("draft_tokens", row.get("num_speculative_tokens"))
    return new


@pytest.mark.parametrize("path", sorted((REPO / "tests" / "data" / "bench-results").glob("bench-*.json")), ids=lambda p: p.name)
def test_result_files_of_earlier_schemas_read_back(path):
    """The bench results of schemas 1 to 3 (tests/data/bench-results: copies of the records in
    benchmarks/results) read as results, with every figure they hold, and their tables render: the
    schema's renames are read under the old names."""
    old = json.loads(path.read_text())
    assert old["schema_version"] < 4  # written before the typed results; a file of schema 4 tests nothing new
    result = BenchResult.from_json(path.read_text())
    assert result.schema_version == old["schema_version"]
    written = json.loads(result.to_json())
    assert written.pop("fastest") == [f.to_dict() for f in result.fastest]
    assert written == upgraded(old)
    assert result.passed is old["passed"]
    text = rendered(result)
    assert "parity vs torch" in text and f"{old['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s" in text
    if old.get("speculative"):
        assert f"K up to {old['speculative'][0]['draft_tokens']}" in text


def test_combos_say_what_is_left_out():
    s = bench.BenchSettings(precisions=[Precision.fp32, Precision.int8, Precision.fp16])
    pairs, skipped = bench.combos(s)
    assert pairs == [(BackendKind.torch, Precision.fp32), (BackendKind.ort, Precision.fp32), (BackendKind.ort, Precision.int8)]
    assert {(x.backend, x.precision) for x in skipped} == {
        (BackendKind.torch, Precision.int8), (BackendKind.torch, Precision.fp16), (BackendKind.ort, Precision.fp16)}
    assert all(x.draft is None and x.reason for x in skipped)


@pytest.mark.parametrize("precision", [Precision.int8, Precision.int4])
def test_roofline_counts_the_bytes_the_export_stores(tiny, tmp_path, precision):
    """The roofline's bytes for the quantized matrices equal the bytes of the MatMulNBits weights and
    scales in a real export (an independent count, from the ONNX file)."""
    import onnx
    from onnx import numpy_helper

    from gpt2x.workflows.exports import export_model

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


def rendered(result: BenchResult) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=300)
    for table in bench_tables(result):
        console.print(table)
    return console.file.getvalue()


@pytest.mark.parametrize("kwargs,option", [
    ({"warmup": -1}, "warmup"), ({"batches": [0]}, "batch"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 33}, "num_speculative_tokens"), ({"prompt_text": ""}, "prompt_text"),
    ({"kv_cache": KvCache.growing, "backends": [BackendKind.torch, BackendKind.openvino]}, "kv_cache"),
])
def test_bench_settings_refuse_bad_values(kwargs, option):
    from gpt2x.errors import UsageError

    with pytest.raises(UsageError) as e:
        bench.BenchSettings(**kwargs)
    assert e.value.option == option


@pytest.mark.parametrize("kv_cache,in_place", [(KvCache.auto, True), (KvCache.growing, False), (KvCache.in_place, True)])
def test_the_ort_rows_take_the_kv_cache_form_asked_for(tiny_export, kv_cache, in_place):
    """An fp32 export's ort row: in place by default (its twin), growing when asked; recorded in the settings."""
    info = tiny_export(Precision.fp32)[2]
    s = bench.BenchSettings(backends=[BackendKind.ort], precisions=[Precision.fp32], kv_cache=kv_cache)
    backend, _ = bench.open_timed(s, BackendKind.ort, Precision.fp32, info, np.ones((1, 4), np.int64), 1, None)
    assert backend.in_place_kv is in_place
    assert s.recorded(1).kv_cache == kv_cache.value


def test_fixed_cache_rows_beside_the_plain_ones(tiny, tmp_path, monkeypatch, quick_bench):
    """--fixed-cache on the CPU: each ort row timed again on StaticDecoder (its fixed-shape decode graph), named as
    such, its greedy tokens those of the plain row (a second graph of the same export), its speed a share of the
    plain row's, and never named fastest (gpt2x serve does not run it)."""
    model, source = tiny
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))
    s = bench.BenchSettings(model="tiny", backends=[BackendKind.ort], precisions=[Precision.fp32], batches=[1, 2],
                            prompt_len=4, new_tokens=6, repeat=1, fixed_cache=True, text=quick_bench)
    result = bench.run_bench(s, {"cores": 1}, loaded=(model, source))
    assert [(e.batch, e.decoder) for e in result.speed] == [(1, None), (1, "fixed cache"), (2, None), (2, "fixed cache")]
    for plain, fixed in zip(result.speed[::2], result.speed[1::2]):
        assert fixed.same_tokens == 1.0 and plain.same_tokens is None
        assert fixed.native_share == pytest.approx(fixed.decode_tokens_per_s / plain.decode_tokens_per_s)
    # The fixed rows made the fastest at both goals: the plain rows are still the ones named.
    quick = dataclasses.replace(result, speed=[e if e.decoder is None else dataclasses.replace(
        e, decode_tokens_per_s=1e9, ttft_ms=1e-6) for e in result.speed])
    plain_rows = {(e.batch, e.decode_tokens_per_s, e.ttft_ms) for e in result.speed if e.decoder is None}
    assert len(quick.fastest) == 2 and {(f.batch, f.decode_tokens_per_s, f.ttft_ms) for f in quick.fastest} <= plain_rows
    written = json.loads(result.to_json())
    validate(written, BENCH_SCHEMA)
    assert written["settings"]["fixed_cache"] is True
    assert BenchResult.from_json(result.to_json()) == result
    assert "ort, fixed cache" in rendered(result) and "same tokens" in rendered(result)


def test_fixed_cache_counts_tokens_unlike_the_plain_rows(tiny_export):
    """same_tokens is the share of the fixed decoder's tokens equal to the plain row's: half of them changed there,
    half agree."""
    _, _, info = tiny_export(Precision.fp32)
    s = bench.BenchSettings(backends=[BackendKind.ort], precisions=[Precision.fp32], prompt_len=4, new_tokens=6,
                            repeat=1, warmup=0, fixed_cache=True)
    prompt = np.arange(1, 9, dtype=np.int64).reshape(2, 4)
    from gpt2x.runtime.static_decode import StaticDecoder

    want = StaticDecoder(info, ProviderKind.cpu, rows=2, capacity=10).generate(prompt, 6)
    changed = want.copy()
    changed[:, :3] = (changed[:, :3] + 1) % info.config.vocab_size
    plain = bench.Timing(backend=BackendKind.ort, precision=Precision.fp32, batch=2, run={"tokens": changed.tolist()},
                         cold_start_s=0, peak_rss_mb=0, peak_gpu_mb=None, page_memory_mb=None, page_info=None)
    fixed = bench.time_fixed(s, info, Precision.fp32, prompt, 1, plain)
    assert fixed.same_tokens == pytest.approx(0.5) and fixed.decoder == bench.FIXED_CACHE
    assert fixed.run["tokens"] == want.tolist() and len(fixed.run["steps_s"]) == 5


@pytest.mark.parametrize("kwargs,fragment", [
    ({"precisions": [Precision.int8]}, "on cpu needs an fp32 export"),
    ({"backends": [BackendKind.torch]}, "none is asked for"),
])
def test_fixed_cache_refused_where_it_cannot_run(kwargs, fragment):
    with pytest.raises(UsageError, match=fragment) as e:
        bench.BenchSettings(**{"backends": [BackendKind.ort], "precisions": [Precision.fp32], "fixed_cache": True, **kwargs})
    assert e.value.option == "fixed_cache"
    # Not asked for on the CPU: no fixed rows; on CUDA by default at fp16 only.
    assert not bench.BenchSettings(backends=[BackendKind.ort], precisions=[Precision.fp32]).fixed_rows(BackendKind.ort, Precision.fp32)
    cuda = bench.BenchSettings(provider=ProviderKind.cuda, backends=[BackendKind.ort, BackendKind.torch])
    assert [cuda.fixed_rows(k, p) for k in (BackendKind.ort, BackendKind.torch) for p in (Precision.fp32, Precision.fp16)] == \
        [False, True, False, False]


def test_batches_above_a_backends_most_are_skipped(tiny, tmp_path, monkeypatch, quick_bench):
    """onnxruntime-genai batches at most 32 rows: the bench times its batch of 2 and says why it leaves 33 out."""
    model, source = tiny
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))
    s = bench.BenchSettings(model="tiny", backends=[BackendKind.genai], precisions=[Precision.fp32], batches=[2, 33],
                            prompt_len=4, new_tokens=3, repeat=1, text=quick_bench)
    result = bench.run_bench(s, {"cores": 1}, loaded=(model, source))
    assert [(e.backend, e.batch) for e in result.speed] == [(BackendKind.genai, 2)]
    assert [(x.backend, x.reason.split(":")[0]) for x in result.skipped] == [(BackendKind.genai, "batch 33")]
    assert "at most 32 rows" in result.skipped[0].reason


def test_first_difference():
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2


def test_run_bench_speculative_rows(tiny, tmp_path, monkeypatch, quick_bench):
    """--draft: one row per backend x precision that rolls back x draft, measured at batch 1 whatever
    the batches, each against plain decoding of the same target in the same run; a backend that cannot
    roll back has none, and says why."""
    model, source = tiny
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    s = bench.BenchSettings(model=source.name, backends=[BackendKind.torch, BackendKind.ort], precisions=[Precision.fp32],
                            batches=[2], prompt_len=4, new_tokens=10, repeat=1, drafts=["ngram", "int8"], num_speculative_tokens=3,
                            prompt_text=GROUNDED, text=quick_bench)
    # Each forward of the target costs 2 + 0.5 per new position ms: a plain step 2.5 ms, a verification of
    # d drafted tokens 2.5 + 0.5 d ms, the prefill of the P-token prompt 2 + 0.5 P; the drafts' cost nothing.
    clock = StepClock(monkeypatch, {TorchBackend: (2, 0.5), OrtBackend: (2, 0.5)})
    result = bench.run_bench(s, {"cpu": "test", "cores": 1}, loaded=(model, source))
    validate(json.loads(result.to_json()), BENCH_SCHEMA)
    assert BenchResult.from_json(result.to_json()) == result
    assert is_export(default_export_dir(source.name, Precision.int8))  # exported on first use, here
    assert [e.batch for e in result.speed] == [2, 2]
    rows = result.speculative
    torch, ort, fp32 = BackendKind.torch, BackendKind.ort, Precision.fp32
    assert [(r.backend, r.precision, r.draft) for r in rows] == [
        (torch, fp32, "ngram"), (torch, fp32, "int8"), (ort, fp32, "ngram"), (ort, fp32, "int8")]
    assert len(clock.spec_runs) == len(rows) * (s.warmup + s.repeat)
    for i, r in enumerate(rows):
        assert (r.prompt_len, r.new_tokens, r.num_speculative_tokens, r.adaptive) == (len(encode(GROUNDED)), 10, 3, True)
        assert 0 <= r.accepted <= r.drafted <= 3 * r.drafts
        # The timed run's proposals, counted against its tokens (9 decoded after the prefill's one).
        rounds, sequence = clock.spec_runs[i * (s.warmup + s.repeat) + s.warmup]
        drafted, accepted, drafts, open_end = greedy_counts(rounds, sequence)
        assert len(sequence) == len(encode(GROUNDED)) + 10 and not open_end
        assert (r.drafted, r.accepted, r.drafts, r.plain_steps) == (drafted, accepted, drafts, 9 - accepted - drafts)
        if drafts:
            assert 0 <= r.acceptance_rate <= 1 and r.acceptance_rate == pytest.approx(accepted / drafted)
            assert r.mean_acceptance_length == pytest.approx(1 + accepted / drafts)
        else:
            assert r.acceptance_rate is None and r.mean_acceptance_length is None
        # Times from the clock's costs: plain decoding 2.5 ms a token; speculative 9 tokens in
        # 2.5 ms per round (9 - accepted rounds) plus 0.5 ms per drafted token.
        prefill_ms = 2 + 0.5 * len(encode(GROUNDED))
        assert r.ttft_ms == pytest.approx(prefill_ms) and r.plain_ttft_ms == pytest.approx(prefill_ms)
        spec_tps = 9e3 / (2.5 * (9 - accepted) + 0.5 * drafted)
        assert r.plain_decode_tokens_per_s == pytest.approx(1e3 / 2.5) and r.decode_tokens_per_s == pytest.approx(spec_tps)
        assert r.speedup == pytest.approx(spec_tps / 400)
        assert r.step_cost_ms == pytest.approx([2 + 0.5 * n for n in range(1, 9)])
        assert r.step_cost_ratio[0] == 1.0 and r.step_cost_ratio == pytest.approx([(2 + 0.5 * n) / 2.5 for n in range(1, 9)])
        if r.draft == "ngram":  # an fp32 target with prompt lookup: plain greedy decoding's tokens
            assert r.greedy_identical is True and r.first_difference is None
        else:  # a model draft proposes from the first speculative round on (the second decode step)
            assert r.drafts >= 1 and r.draft_name == f"{source.name} int8"
    text = rendered(result)
    assert "Speculative decoding" in text and "int8" in text and "step cost" in text

    unrolled = dataclasses.replace(OrtBackend.capabilities, rolls_back=False)  # the record, and the class's
    monkeypatch.setitem(REGISTRY, BackendKind.ort, dataclasses.replace(REGISTRY[BackendKind.ort], capabilities=unrolled))
    monkeypatch.setattr(OrtBackend, "capabilities", unrolled)
    s.backends, s.drafts = [BackendKind.ort], ["ngram"]
    again = bench.run_bench(s, {"cpu": "test", "cores": 1}, loaded=(model, source))
    assert again.speculative == [] and len(again.speed) == 1
    [skip] = again.skipped
    assert (skip.backend, skip.precision, skip.draft) == (ort, fp32, "ngram") and "roll back" in skip.reason
    assert "not run: ort/fp32 with ngram" in rendered(again)


def test_bench_cli_draft_json(tiny, tmp_path, monkeypatch, capsys):
    """`gpt2x bench --draft ngram --output F` writes the speculative rows (torch: no export to make)."""
    _, source = tiny
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    monkeypatch.setattr(bench, "cpu_read_bandwidth", lambda threads: 20e9)
    out_json = tmp_path / "b.json"
    text = tmp_path / "short.txt"  # perplexity on one line: not what this test checks
    text.write_text("ROMEO: But soft, what light through yonder window breaks?")
    code, out, err = cli(capsys, "bench", "--model", source.name, "--backends", "torch", "--precisions", "fp32",
                         "--text", str(text), "--prompt-len", "4", "--new-tokens", "6", "--repeat", "1", "--draft", "ngram",
                         "--num-speculative-tokens", "2", "--output", str(out_json))
    assert code == 0, err
    result = BenchResult.from_json(out_json.read_text())
    assert result.schema_version == 4 and result.settings.drafts == ["ngram"]
    [row] = result.speculative
    assert (row.backend, row.draft, row.num_speculative_tokens, row.prompt_len) == (BackendKind.torch, "ngram", 2, 4)
    assert "Speculative decoding" in out


@pytest.mark.parametrize("args,error,fragment", [
    (["--draft", "foo"], "HubError", "draft foo is neither ngram"),  # looked up on the hub: offline in the tests
    (["--draft", "fp16"], "ProviderError", "draft fp16"),
    (["--draft", "ngram", "--num-speculative-tokens", "0"], "UsageError", "--num-speculative-tokens"),
    (["--draft", "ngram", "--prompt-text", ""], "UsageError", "--prompt-text"),
])
def test_bench_cli_bad_draft_is_one_line(tmp_path, monkeypatch, capsys, args, error, fragment):
    """Refused before any work: nothing is loaded or exported (the export folder stays absent)."""
    from gpt2x import errors

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    code, _, err = cli(capsys, "bench", "--backends", "ort", *args)
    assert_one_line_error(code, err, getattr(errors, error).exit_code, fragment)
    assert not (tmp_path / "exported").exists()


FIXTURE = REPO / "tests" / "data" / "bench-results" / "bench-cpu-2core-gpt2-124m.json"


class _Given:
    """A click context stand-in for serve's --from-bench: which parameters came from the command line."""

    def __init__(self, *names: str):
        self.names = names

    def get_parameter_source(self, name):
        from types import SimpleNamespace  # read by name (cli.options.given_by_user), as Typer's own enum is

        return SimpleNamespace(name="COMMANDLINE" if name in self.names else "DEFAULT")


def test_fastest_of_a_kept_result_and_serve_from_bench(tmp_path, monkeypatch):
    """Read off the kept result file by hand: genai int4 at batch 4 decodes fastest (529.94 tok/s, ort int8's
    batch 4 528.01); with genai int4's gate failed, ort int8 at batch 4 is. `gpt2x serve --from-bench`
    takes that row, except where a flag was given."""
    from gpt2x.cli import serve as serve_cli

    data = json.loads(FIXTURE.read_text())
    best = BenchResult.from_json(json.dumps(data)).best("decode")
    assert (best.backend, best.precision, best.batch) == (BackendKind.genai, Precision.int4, 4)
    assert best.decode_tokens_per_s == pytest.approx(529.94, abs=0.01)
    for p in data["parity"]:
        if (p["backend"], p["precision"]) == ("genai", "int4"):
            p["passed"] = False
    result = BenchResult.from_json(json.dumps(data))
    best = result.best("decode")
    assert (best.backend, best.precision, best.batch) == (BackendKind.ort, Precision.int8, 4)
    assert best.decode_tokens_per_s == pytest.approx(528.01, abs=0.01)
    assert result.best("decode", among=(BackendKind.openvino,)).precision is Precision.fp32  # 107 tok/s at batch 4
    assert result.best("decode", among=(BackendKind.web,)) is None

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(serve_cli, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(serve_cli, "physical_cores", lambda: 2)
    picked = serve_cli.from_bench(_Given(), path, BackendKind.ort, ProviderKind.cpu, None, None)
    assert picked == (BackendKind.ort, ProviderKind.cpu, Precision.int8, 4)
    picked = serve_cli.from_bench(_Given("backend"), path, BackendKind.openvino, ProviderKind.cpu, Precision.fp32, 2)
    assert picked == (BackendKind.openvino, ProviderKind.cpu, Precision.fp32, 2)  # the command line's flags win
    for p in data["parity"]:
        p["passed"] = p["backend"] == "torch"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="no configuration of ort, openvino, genai that passed"):
        serve_cli.from_bench(_Given(), path, BackendKind.ort, ProviderKind.cpu, None, None)


def test_serve_from_bench_chooses_at_the_served_batch(tmp_path, monkeypatch, capsys):
    """Read off the kept result file by hand, genai int4's gate failed: at batch 1 ort int4 decodes fastest (253.47
    tok/s), at batch 4 ort int8 (528.01). A served batch the file measured picks among its rows; one it did not
    measure keeps the overall fastest, and says so."""
    from gpt2x.cli import serve as serve_cli

    data = json.loads(FIXTURE.read_text())
    for p in data["parity"]:
        if (p["backend"], p["precision"]) == ("genai", "int4"):
            p["passed"] = False
    assert BenchResult.from_json(json.dumps(data)).best("decode", batch=1).decode_tokens_per_s == pytest.approx(253.47, abs=0.01)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(serve_cli, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(serve_cli, "physical_cores", lambda: 2)
    given = _Given("max_batch_size")
    assert serve_cli.from_bench(given, path, BackendKind.ort, ProviderKind.cpu, None, 1) == (BackendKind.ort, ProviderKind.cpu, Precision.int4, 1)
    assert serve_cli.from_bench(given, path, BackendKind.ort, ProviderKind.cpu, None, 4) == (BackendKind.ort, ProviderKind.cpu, Precision.int8, 4)
    assert "measured no decoding" not in capsys.readouterr().err
    assert serve_cli.from_bench(given, path, BackendKind.ort, ProviderKind.cpu, None, 16) == (BackendKind.ort, ProviderKind.cpu, Precision.int8, 16)
    assert "measured no decoding at batch 16, the batch served; its choice is the fastest at batch 4" in capsys.readouterr().err


@pytest.mark.parametrize("content, fragment", [
    (None, "--from-bench file not found"),
    ('{"speed": []}', "is not a gpt2x bench result"),
    ("not json", "is not a gpt2x bench result"),
])
def test_serve_from_bench_bad_file_is_one_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    code, _, err = cli(capsys, "serve", "--from-bench", str(path))
    assert_one_line_error(code, err, 2, fragment)
