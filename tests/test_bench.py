"""The bench's arithmetic against hand-computed cases, its JSON, and its parity gate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gpt2x import bench
from gpt2x.backends import TorchBackend
from gpt2x.choices import BackendKind, Precision
from gpt2x.model import PRESETS
from gpt2x.parity import check, kl_divergence, logit_stats
from gpt2x.weights import load_model

from .conftest import make_hf_model


def test_percentiles_hand_computed():
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5
    assert bench.percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    s = bench.summarize_latencies([0.001, 0.002, 0.003])
    assert s["p50_ms"] == pytest.approx(2.0) and s["mean_ms"] == pytest.approx(2.0)


def test_kl_and_cross_entropy_hand_computed():
    p = np.log(np.array([[0.5, 0.5]]))
    q = np.log(np.array([[0.25, 0.75]]))
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(p, q)[0] == pytest.approx(want)
    assert kl_divergence(p, p)[0] == pytest.approx(0.0)
    logits = np.log(np.array([[0.2, 0.8], [0.6, 0.4]]))
    assert bench.cross_entropy(logits, np.array([1, 0])) == pytest.approx(-(math.log(0.8) + math.log(0.6)) / 2)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    vocab = 7
    ppl = bench.perplexity(lambda x: np.zeros((1, x.shape[1], vocab)), [i % vocab for i in range(50)], window=8)
    assert ppl == pytest.approx(vocab)


def test_perplexity_counts_every_target_once():
    seen = []

    def fake(x):
        seen.append(x.shape[1])
        return np.zeros((1, x.shape[1], 3))

    bench.perplexity(fake, [i % 3 for i in range(21)], window=8)
    assert seen == [8, 8, 4]  # 20 targets in windows of 8, 8 and 4


def test_roofline_matches_the_briefs_figures():
    """44 GB/s reads: 89 tok/s for fp32 GPT-2 124M, 357 for int8 (figures given by the issue)."""
    cfg = PRESETS["gpt2"][1]
    # The figures are rounded (and count biases slightly differently): agree within 1%.
    assert bench.roofline_tokens_per_s(44e9, cfg, Precision.fp32, 1, 0) == pytest.approx(89, rel=0.01)
    assert bench.roofline_tokens_per_s(44e9, cfg, Precision.int8, 1, 0) == pytest.approx(357, rel=0.01)
    # The KV cache adds 2 * layers * context * C * 4 bytes per row.
    extra = bench.decode_bytes_per_step(cfg, Precision.fp32, 2, 100) - bench.decode_bytes_per_step(cfg, Precision.fp32, 2, 0)
    assert extra == 2 * 12 * 2 * 100 * 768 * 4


def test_logit_stats_hand_computed():
    ref = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    got = np.array([[1.0, 2.5, 3.0], [0.0, 0.0, 4.0]])
    s = logit_stats(ref, got)
    assert s["max_abs"] == 0.5 and s["scale"] == 4.0 and s["max_rel"] == 0.125
    assert s["top1_agreement"] == 1.0
    assert logit_stats(ref, np.array([[3.0, 2.0, 1.0], [0.0, 0.0, 4.0]]))["top1_agreement"] == 0.5


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
    assert check(model, TorchBackend(model), Precision.fp32)["status"] == "passed"
    bad = check(model, Perturbed(model), Precision.fp32)
    assert bad["status"] == "failed" and "max |Δlogit|" in bad["message"]


def test_run_bench_json_schema_and_gate(tiny, tmp_path, monkeypatch):
    model, source = tiny
    monkeypatch.chdir(tmp_path)  # exports land in ./exported
    s = bench.BenchSettings(model="tiny", backends=[BackendKind.torch, BackendKind.ort],
                            precisions=[Precision.fp32], batches=[1, 2], prompt_len=4, new_tokens=6, repeat=1)
    result = bench.run_bench(s, model, source, {"cpu": "test", "cores": 1})
    assert result["passed"] is True
    json.loads(json.dumps(result))  # serialisable as is
    assert {"schema_version", "settings", "environment", "model", "bandwidth", "reference", "parity", "speed"} <= result.keys()
    assert [(p["backend"], p["precision"]) for p in result["parity"]] == [("torch", "fp32"), ("ort", "fp32")]
    assert len(result["speed"]) == 4 and result["skipped"] == []
    for e in result["speed"]:
        assert e["decode_tokens_per_s"] > 0 and 0 < e["roofline_share"]
        assert set(e["decode_latency"]) == {"p50_ms", "p90_ms", "p99_ms", "mean_ms"}
        assert e["latency_by_context"][0]["context"] >= 5
    ort_ppl = result["parity"][1]["perplexity"]
    assert ort_ppl == pytest.approx(result["reference"]["perplexity"], rel=1e-4)

    monkeypatch.setattr(bench, "TorchBackend", Perturbed)
    s.backends = [BackendKind.torch]
    assert bench.run_bench(s, model, source, {"cores": 1})["passed"] is False


def test_combos_say_what_is_left_out():
    s = bench.BenchSettings(precisions=[Precision.fp32, Precision.int8, Precision.fp16])
    pairs, skipped = bench.combos(s)
    assert pairs == [(BackendKind.torch, Precision.fp32), (BackendKind.ort, Precision.fp32), (BackendKind.ort, Precision.int8)]
    assert {(x["backend"], x["precision"]) for x in skipped} == {("torch", "int8"), ("torch", "fp16"), ("ort", "fp16")}
