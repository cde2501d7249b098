"""Speculative decoding against independent references:

- `Backend.truncate` on every backend that rolls back: the logits after a rollback equal a no-cache
  forward of the same sequence;
- prompt lookup (`lookup`) and the draft-length controller (`DraftControl`) on hand-computed cases;
- greedy: speculative output equals plain greedy decoding token for token, or differs first at a
  near-tie of the plain run's logits (top-2 margin below a stated MARGIN);
- sampling: the acceptance rule (`verify`) on hand-made distributions, and whole speculative runs,
  whose tokens follow the target's exact distribution (computed by no-cache forwards), by chi-square
  tests with stated significance and power;
- seeds, the stats, and the command line (errors in one line, and the happy path).

Exports are made into temporary folders without the parity gate (test_onnx, test_int4 and
test_openvino gate them; here every check has its own reference), which keeps this file fast."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpt2x.choices import Precision
from gpt2x.errors import UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.processors import History
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import Generation, SamplingSettings
from gpt2x.generation.speculative import (
    DraftControl,
    DraftSettings,
    ModelDrafter,
    NgramDrafter,
    Proposal,
    SpecStats,
    lookup,
    speculative_loop,
    verify,
)
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.tokenizer import EOT_ID, encode
from gpt2x.workflows.drafts import open_drafter
from gpt2x.workflows.models import load_model

from ..helpers import PROMPTS, DraftSpy, greedy_counts, make_hf_model

# Greedy speculative decoding scores K + 1 positions in one step where plain decoding scores one: the
# float rounding of the two may differ (at most about 1e-5 of the logits for fp32 graphs), which can
# flip only an argmax whose top-2 logits are closer than MARGIN. A first difference at a wider margin
# is a bug.
MARGIN = 1e-3  # fp32 targets (ort, openvino, torch)
# int8 graphs: ONNX Runtime's int8 CPU kernels compute a row differently by its place among the step's
# rows (measured on the bundled model's int8 logits, with no rollback at all, in place or growing
# cache alike: up to 0.07 between steps of 6 + 1 + 1 + 1 tokens and one step of 9; the fp32 graph
# gives the same logits either way).
MARGIN_INT8 = 0.15  # an int8 target's near-tie

FP32_ATOL = 2e-4  # logits after a rollback against a no-cache forward: fp32 graphs
# int8 graphs (see MARGIN_INT8). The exact reference there (a cache made from the kept positions, the
# same steps on top) holds a rollback to float rounding.
INT8_ATOL = 0.25


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """PyTorch on one thread while this module runs (its tiny forwards gain nothing from two, and
    lose much on a busy machine), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tiny_export, tmp_path_factory):
    """A tiny random GPT-2 (the target) with its fp32 and int4 exports (the run's shared ones), and a
    second tiny random model (another seed: a draft that mostly disagrees), run by PyTorch."""
    folder = tmp_path_factory.mktemp("spec-draft")
    make_hf_model(folder, seed=42)
    exports = {p: tiny_export(p, n_positions=64) for p in (Precision.fp32, Precision.int4)}
    return SimpleNamespace(model=exports[Precision.fp32][0], infos={p: e[2] for p, e in exports.items()},
                           draft_model=load_model(str(folder))[0])


@pytest.fixture(scope="module")
def bundled(bundled_export):
    """The bundled model in PyTorch, and its fp32, int8 and int4 exports (the run's shared ones)."""
    model, _ = load_model("shakespeare")
    infos = {p: bundled_export(p) for p in (Precision.fp32, Precision.int8, Precision.int4)}
    return SimpleNamespace(model=model, infos=infos)


def openvino_backend(info):
    import openvino  # noqa: F401 (the test extra's: missing, the test fails)

    from gpt2x.runtime.openvino import OpenVinoBackend

    return OpenVinoBackend(info, threads=1)


def no_cache_logits(backend, ids: list[int]) -> np.ndarray:
    """All logits (L, V) of one sequence from one forward without a cache: the reference."""
    arr = np.asarray([ids], dtype=np.int64)
    mask = np.ones_like(arr)
    return backend.run(arr, mask, positions(mask, arr.shape[1]), None)[0][0]


# ---------------------------------------------------------------- 1. Backend.truncate


TRUNCATE_BACKENDS = ["ort-fp32", "ort-int8", "openvino-fp32", "openvino-int8", "torch", "slots-fp32", "slots-int8"]


def make_backend(bundled, kind: str):
    if kind == "torch":
        return TorchBackend(bundled.model)
    if kind.startswith("slots"):  # the server's fixed slots (runtime.static_decode.SlotBackend)
        from gpt2x.runtime.static_decode import SlotBackend

        return SlotBackend(bundled.infos[Precision(kind.split("-")[1])], threads=1, slots=6)
    runtime, precision = kind.split("-")
    info = bundled.infos[Precision(precision)]
    # ort-fp32: the growing cache (ort-int8 has its cache in place), so that both forms are covered
    return OrtBackend(info, threads=1, in_place_kv=None if precision == "int8" else False) if runtime == "ort" \
        else openvino_backend(info)


def in_place(kind: str) -> bool:
    """Whether the backend keeps its cache in fixed buffers, whose earlier views go stale."""
    return kind in ("ort-int8", "openvino-fp32", "openvino-int8")  # a slot's cache is its handle: no earlier view


@pytest.mark.parametrize("kind", TRUNCATE_BACKENDS)
def test_truncate_then_step_matches_a_no_cache_forward(bundled, kind):
    """Prompt, then K tokens in one step (as a verification), rolled back to prompt + j for every j,
    then one token and a two-token step on top. Two references: a cache made from the kept positions
    sliced here (past_from_numpy), the same steps on top in the same state (so the same logits to float
    rounding), and a no-cache forward of the sequence that stands (the rolled-back positions neither
    seen nor in the way).

    The same state: the reference runs after the rolled-back cache is let go, so that the slot backend
    puts it in the slot that cache held and steps the same slots. A slot backend's decode step runs its
    slots up to the highest one held, and an int8 graph's row comes out of a step of one row and of
    two rows ~1e-7 apart (ONNX Runtime's MatMulNBits rounds by its row tiling), which the int8
    rounding of the next activations can turn into ~3e-2 of the logits (measured on AVX-512 VNNI): the
    reference stepped beside the rolled-back slot is not the same step. A row's logits never depend on
    what the other slots hold (tests/runtime/test_slots.py)."""
    b = make_backend(bundled, kind)
    if kind.startswith("ort"):
        assert b.in_place_kv is (kind == "ort-int8")  # both ONNX Runtime caches are covered
    rng = np.random.default_rng(0)
    P, K = 6, 4
    ids = rng.integers(0, b.vocab_size, size=P + K).tolist()
    extra = rng.integers(0, b.vocab_size, size=3).tolist()  # what comes after the rollback
    atol = INT8_ATOL if "int8" in kind else FP32_ATOL
    for j in range(K + 1):
        mask = np.ones((1, P), dtype=np.int64)
        _, past = b.step(np.asarray([ids[:P]]), mask, positions(mask, P), None)
        mask = np.ones((1, P + K), dtype=np.int64)
        _, past = b.run(np.asarray([ids[P:]]), mask, positions(mask, K), past)
        kept = [a[:, :, : P + j].copy() for a in past.to_numpy()]
        past = past.truncate(P + j)
        for a, want in zip(past.to_numpy(), kept):  # the first P + j positions, unchanged
            np.testing.assert_array_equal(a, want)

        one = ids[: P + j] + extra[:1]
        two = one + extra[1:]
        one_mask, two_mask = np.ones((1, len(one)), dtype=np.int64), np.ones((1, len(two)), dtype=np.int64)
        one_logits, past = b.step(np.asarray([extra[:1]]), one_mask, positions(one_mask, 1), past)
        two_logits, past = b.run(np.asarray([extra[1:]]), two_mask, positions(two_mask, 2), past)
        slots = past.slots.tolist() if kind.startswith("slots") else None
        del past  # let go (a slot backend's slot free again) before the reference takes its place
        ref_past = b.past_from_numpy(kept)
        assert slots is None or ref_past.slots.tolist() == slots
        one_ref, ref_past = b.step(np.asarray([extra[:1]]), one_mask, positions(one_mask, 1), ref_past)
        two_ref, ref_past = b.run(np.asarray([extra[1:]]), two_mask, positions(two_mask, 2), ref_past)
        del ref_past
        np.testing.assert_allclose(one_logits, one_ref, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{kind}: one step after keeping {P + j} of {P + K} positions")
        np.testing.assert_allclose(one_logits[0], no_cache_logits(b, one)[-1], rtol=1e-4, atol=atol,
                                   err_msg=f"{kind}: one step after keeping {P + j} of {P + K} positions")
        np.testing.assert_allclose(two_logits, two_ref, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{kind}: a two-token step after keeping {P + j} positions")
        np.testing.assert_allclose(two_logits[0], no_cache_logits(b, two)[-2:], rtol=1e-4, atol=atol,
                                   err_msg=f"{kind}: a two-token step after keeping {P + j} positions")


@pytest.mark.parametrize("kind", TRUNCATE_BACKENDS)
def test_truncate_refuses_a_longer_length_and_stale_views(bundled, kind):
    b = make_backend(bundled, kind)
    mask = np.ones((1, 5), dtype=np.int64)
    _, past = b.step(np.asarray([[1, 2, 3, 4, 5]]), mask, positions(mask, 5), None)
    with pytest.raises(ValueError, match="cannot keep 6 positions"):
        past.truncate(6)
    with pytest.raises(ValueError):
        past.truncate(-1)
    assert all(a.shape[2] == 5 for a in past.to_numpy())  # a refused truncation changed nothing
    shorter = past.truncate(3)
    assert all(a.shape[2] == 3 for a in shorter.to_numpy())
    mask = np.ones((1, 4), dtype=np.int64)
    if in_place(kind):
        with pytest.raises(ValueError, match="stepped from"):  # the view from before the rollback
            b.step(np.asarray([[9]]), mask, positions(mask, 1), past)
        with pytest.raises(ValueError, match="stepped from"):
            past.truncate(2)
    _, newer = b.step(np.asarray([[9]]), mask, positions(mask, 1), shorter)
    assert all(a.shape[2] == 4 for a in newer.to_numpy())
    if in_place(kind):
        with pytest.raises(ValueError, match="stepped from"):  # the rolled-back view, once stepped from
            shorter.truncate(2)
    assert all(a.shape[2] == 2 for a in newer.truncate(2).to_numpy())


# ---------------------------------------------------------------- 2. prompt lookup


@pytest.mark.parametrize("tokens,k,n_max,n_min,want", [
    # the latest earlier occurrence of [1, 2, 3] (at 4, not at 0) is continued
    ([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1, [7, 1]),
    # the longest n first: [1, 2, 3] at 0 wins over the more recent single 3 at 6 ...
    ([1, 2, 3, 10, 11, 9, 3, 12, 1, 2, 3], 3, 3, 1, [10, 11, 9]),
    # ... which is the match when only n = 1 is asked for
    ([1, 2, 3, 10, 11, 9, 3, 12, 1, 2, 3], 3, 1, 1, [12, 1, 2]),
    # no earlier [5, 2, 3]: the 2-gram [2, 3] at 1 is continued
    ([1, 2, 3, 4, 5, 2, 3], 2, 3, 1, [4, 5]),
    # the continuation runs into the end of the sequence: shorter than k
    ([4, 5, 4], 5, 3, 1, [5, 4]),
    ([7, 7], 4, 3, 1, [7]),
    # no earlier occurrence of any suffix
    ([1, 2, 3], 4, 3, 1, []),
    # the last token is not an earlier occurrence of itself
    ([7], 3, 3, 1, []),
    ([1, 2, 7], 3, 3, 1, []),
    # n_min = 2: the single 3 at 2 does not count, and [9, 3] occurs nowhere earlier
    ([1, 2, 3, 9, 3], 3, 3, 2, []),
    ([1, 2, 3, 9, 2, 3], 3, 3, 2, [9, 2, 3]),
])
def test_lookup_hand_computed(tokens, k, n_max, n_min, want):
    assert lookup(tokens, k, n_max, n_min) == want


def test_ngram_drafter_uses_its_settings():
    tokens = [1, 2, 3, 10, 11, 9, 3, 12, 1, 2, 3]
    sampler = Sampler(SamplingSettings(greedy=True))
    assert NgramDrafter().propose(tokens, 2, sampler).tokens == [10, 11]
    p = NgramDrafter(DraftSettings(ngram_max=1)).propose(tokens, 2, sampler)
    assert p.tokens == [12, 1] and p.q is None


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=0), dict(num_speculative_tokens=33), dict(ngram_min=3, ngram_max=2),
                                dict(ngram_min=0)])
def test_bad_draft_settings_are_refused(kw):
    with pytest.raises(UsageError):
        DraftSettings(**kw)


# ---------------------------------------------------------------- 3. greedy: the target's own tokens


def padded(g: Generation) -> list[int]:
    return g.tokens + ([EOT_ID] if g.finish_reason == "eos" else [])


def assert_greedy_equal(target, plain: Generation, spec: Generation, margin: float,
                        settings: SamplingSettings | None = None) -> None:
    """spec's tokens are plain's, or first differ where the plain run's top-2 logits (by a no-cache
    forward of the plain sequence so far; with `settings`, the scores its processors make of them)
    are within `margin` of each other, the speculative token being the other of the two."""
    a, b = padded(plain), padded(spec)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        assert (len(a), plain.finish_reason) == (len(b), spec.finish_reason), (a, b)
        return
    logits = no_cache_logits(target, plain.prompt_tokens + a[:i])[-1].astype(np.float64)
    if settings is not None:
        logits = Sampler(settings).scores(logits[None], [History(plain.prompt_tokens, a[:i])])[0]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < margin, (
        f"speculative greedy differs from plain greedy at token {i} ({b[i]} instead of {a[i]}), where "
        f"the plain run's top-2 logit margin is {top2[1] - top2[0]:.2e} >= {margin}")
    assert logits[b[i]] >= top2[1] - margin, "the speculative token is not one of a near-tie"






def assert_stats(g: Generation, settings: DraftSettings, rounds) -> None:
    """A greedy run's counters; drafted, accepted and their ratios against its proposals (`rounds`, one
    sequence of a DraftSpy) counted from its tokens."""
    s = g.speculation
    assert s is not None
    assert 0 <= s["accepted"] <= s["drafted"]
    assert s["drafts"] <= s["drafted"]  # a draft round drafts at least one token
    if not settings.adaptive:
        assert s["drafted"] <= settings.num_speculative_tokens * s["drafts"]
    # every round yields its accepted tokens and one of the target's; the prefill one token
    assert s["tokens"] == 1 + s["plain_steps"] + s["drafts"] + s["accepted"]
    if g.finish_reason == "eos":
        assert s["tokens"] >= len(g.tokens) + 1
    else:
        assert s["tokens"] == len(g.tokens)
    drafted, accepted, drafts, open_end = greedy_counts(rounds, g.prompt_tokens + padded(g))
    assert (s["drafted"], s["drafts"]) == (drafted, drafts)
    if open_end:  # agreed up to the end of text, which cut the run short: more may have been accepted
        assert g.finish_reason == "eos" and s["accepted"] >= accepted and s["acceptance_rate"] >= accepted / drafted
        return
    assert s["accepted"] == accepted
    assert s["acceptance_rate"] == (accepted / drafted if drafted else None)
    assert s["mean_acceptance_length"] == (1 + accepted / drafts if drafts else None)


DRAFT_SETTINGS = {"k1": DraftSettings(num_speculative_tokens=1, adaptive=False), "k3": DraftSettings(num_speculative_tokens=3, adaptive=False),
                  "k8": DraftSettings(num_speculative_tokens=8, adaptive=False), "adaptive": DraftSettings(num_speculative_tokens=5)}
BUNDLED_PROMPTS = ["ROMEO:", "To be, or not to be, that is the question: to be, or not"]


@pytest.fixture(scope="module")
def bundled_runs(bundled):
    """Targets (fp32, and int8 with its cache in place), drafts, and the targets' plain greedy runs."""
    settings = SamplingSettings(greedy=True, max_new_tokens=40)
    targets = {p: OrtBackend(bundled.infos[p], threads=1) for p in (Precision.fp32, Precision.int8)}
    assert targets[Precision.int8].in_place_kv
    drafts = {"int4": ModelDrafter(OrtBackend(bundled.infos[Precision.int4], threads=1), "shakespeare int4"),
              "int8": ModelDrafter(OrtBackend(bundled.infos[Precision.int8], threads=1), "shakespeare int8")}
    plain = {p: generate(t, BUNDLED_PROMPTS, settings) for p, t in targets.items()}
    return SimpleNamespace(targets=targets, drafts=drafts, settings=settings, plain=plain)


@pytest.mark.parametrize("target,draft,setting", [
    *[("fp32", d, s) for d in ("int4", "int8", "ngram") for s in DRAFT_SETTINGS],
    ("int8", "ngram", "k3"), ("int8", "int4", "k8"),  # the in-place cache rolled back in the target
])
def test_greedy_bundled_model_equals_plain_greedy(bundled_runs, target, draft, setting):
    r = bundled_runs
    ds = DRAFT_SETTINGS[setting]
    drafter = DraftSpy(NgramDrafter(ds) if draft == "ngram" else r.drafts[draft])
    backend = r.targets[Precision(target)]
    spec = generate(backend, BUNDLED_PROMPTS, r.settings, draft=drafter, draft_settings=ds)
    assert len(drafter.runs) == len(spec)
    for plain, s, rounds in zip(r.plain[Precision(target)], spec, drafter.runs):
        assert s.prompt_tokens == plain.prompt_tokens
        assert_greedy_equal(backend, plain, s, MARGIN if target == "fp32" else MARGIN_INT8)
        assert_stats(s, ds, rounds)
    if not ds.adaptive:  # every round drafted: the drafts ran, and the quantized model mostly agrees
        assert all(s.speculation["drafts"] > 0 for s in spec)
        if draft != "ngram":
            assert sum(s.speculation["accepted"] for s in spec) > sum(s.speculation["drafted"] for s in spec) / 2


PENALISED = SamplingSettings(greedy=True, max_new_tokens=40, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.3, logit_bias={13: -1.0}, min_tokens=5)


@pytest.mark.parametrize("draft,setting", [("int4", "k3"), ("int4", "adaptive"), ("ngram", "k3"), ("ngram", "k8")])
def test_greedy_with_penalties_equals_plain_greedy_with_them(bundled_runs, draft, setting):
    """Greedy with penalties, a logit bias and min_tokens (none of which the backend's own argmax
    knows): the drafts are verified against the argmax of the processed scores at each drafted
    position, each with its own history, so the tokens are plain greedy's with the same settings."""
    r = bundled_runs
    ds = DRAFT_SETTINGS[setting]
    backend = r.targets[Precision.fp32]
    plain = generate(backend, BUNDLED_PROMPTS, PENALISED)
    assert all(p.tokens != q.tokens for p, q in zip(plain, r.plain[Precision.fp32]))  # the settings change the text
    drafter = DraftSpy(NgramDrafter(ds) if draft == "ngram" else r.drafts[draft])
    spec = generate(backend, BUNDLED_PROMPTS, PENALISED, draft=drafter, draft_settings=ds)
    for p, s, rounds in zip(plain, spec, drafter.runs):
        assert_greedy_equal(backend, p, s, MARGIN, PENALISED)
        assert_stats(s, ds, rounds)
    if not ds.adaptive:
        assert sum(s.speculation["accepted"] for s in spec) > 0 and all(s.speculation["drafts"] > 0 for s in spec)


# Tiny random models: "ROMEO:" with 64 new tokens runs into the 64-position context (the drafts'
# caps at its end); the longer prompt stops at max_new_tokens.
TINY_CASES = [("ROMEO:", 64), (PROMPTS[2], 30)]


@pytest.fixture(scope="module")
def tiny_plain(tiny):
    """Plain greedy runs of every tiny target, computed once: {target kind: (backend, [Generation])}."""
    targets = {"ort-fp32": OrtBackend(tiny.infos[Precision.fp32], threads=1),
               "openvino-fp32": openvino_backend(tiny.infos[Precision.fp32]),
               "torch": TorchBackend(tiny.model)}
    runs = {}
    for kind, backend in targets.items():
        runs[kind] = (backend, [generate(backend, [p], SamplingSettings(greedy=True, max_new_tokens=n))[0]
                                for p, n in TINY_CASES])
    return runs


def tiny_drafter(tiny, target, draft: str, ds: DraftSettings):
    """ngram and the target's int4 export (by its folder) as the CLI opens them (workflows.open_drafter),
    or the second tiny model on PyTorch."""
    if draft == "model":
        return ModelDrafter(TorchBackend(tiny.draft_model), "tiny draft")
    source = {"ngram": "ngram", "int4": str(tiny.infos[Precision.int4].folder)}[draft]
    drafter = open_drafter(source, target, settings=ds, threads=1)
    assert isinstance(drafter, NgramDrafter if draft == "ngram" else ModelDrafter)
    return drafter


@pytest.mark.parametrize("target_kind,draft,setting", [
    *[("ort-fp32", d, s) for d in ("int4", "model", "ngram") for s in DRAFT_SETTINGS],
    ("openvino-fp32", "ngram", "k3"), ("openvino-fp32", "ngram", "k8"), ("openvino-fp32", "ngram", "adaptive"),
    ("torch", "ngram", "k3"), ("torch", "ngram", "k8"), ("torch", "ngram", "adaptive"),
])
def test_greedy_tiny_models_equal_plain_greedy(tiny, tiny_plain, target_kind, draft, setting):
    target, plains = tiny_plain[target_kind]
    ds = DRAFT_SETTINGS[setting]
    drafter = DraftSpy(tiny_drafter(tiny, target, draft, ds))
    for (prompt, n), plain in zip(TINY_CASES, plains):
        [spec] = generate(target, [prompt], SamplingSettings(greedy=True, max_new_tokens=n), draft=drafter,
                          draft_settings=ds)
        assert_greedy_equal(target, plain, spec, MARGIN)
        assert_stats(spec, ds, drafter.runs[-1])
        if n == 64:
            assert spec.finish_reason == plain.finish_reason == "context"
        if not ds.adaptive and draft != "ngram":
            assert spec.speculation["drafts"] > 0


# ---------------------------------------------------------------- 4. sampling: the target's distribution

# Chi-square tests against exact distributions. The critical value is the Wilson-Hilferty
# approximation of the chi-square quantile, which on these degrees of freedom errs on the safe side
# (measured: df 3 and 5 at alpha 2e-4 reject 1.5e-4 and 1.6e-4 of true-null samples).

def chi2_critical(df: int, alpha: float) -> float:
    z = NormalDist().inv_cdf(1 - alpha)
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2_power(df: int, noncentrality: float, alpha: float) -> float:
    """The probability that the test rejects when the true distribution is off by `noncentrality`
    (N * sum (p' - p)^2 / p), by the normal approximation of the noncentral chi-square."""
    crit = chi2_critical(df, alpha)
    return 1 - NormalDist().cdf((crit - df - noncentrality) / math.sqrt(2 * (df + 2 * noncentrality)))


def binned(expected_p: np.ndarray, min_expected: float, n: int) -> np.ndarray:
    """A bin index per outcome: outcomes expected at least `min_expected` times in `n` draws keep their
    own bin, the others (the impossible ones excepted: -1) share one, merged into the smallest bin
    when it would be expected fewer than `min_expected` times."""
    bins = np.full(expected_p.shape, -1, dtype=np.int64)
    big = expected_p * n >= min_expected
    bins[big] = np.arange(big.sum())
    small = (~big) & (expected_p > 0)
    if small.any():
        if expected_p[small].sum() * n >= min_expected or not big.any():
            bins[small] = big.sum()
        else:
            bins[small] = bins[int(np.argmin(np.where(big, expected_p, np.inf)))]
    return bins


def chi2_test(counts: np.ndarray, expected_p: np.ndarray, alpha: float, what: str) -> None:
    """Pearson's chi-square of `counts` against the distribution `expected_p` (same shape)."""
    n = int(counts.sum())
    assert counts[expected_p == 0].sum() == 0, f"{what}: an outcome the target cannot produce was drawn"
    bins = binned(expected_p.ravel(), 5.0, n)
    nb = bins.max() + 1
    observed = np.bincount(bins[bins >= 0], weights=counts.ravel()[bins >= 0], minlength=nb)
    expected = np.bincount(bins[bins >= 0], weights=expected_p.ravel()[bins >= 0], minlength=nb) * n
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = nb - 1
    if df < 1:
        return
    crit = chi2_critical(df, alpha)
    assert stat < crit, f"{what}: chi-square {stat:.1f} >= {crit:.1f} (df {df}, alpha {alpha})"


def test_chi2_helpers_reject_a_wrong_distribution():
    """The test itself: a fair die passes, a loaded one (TV 0.1) fails, the stated power holds, and
    rare outcomes are binned together."""
    rng = np.random.default_rng(5)
    p = np.full(6, 1 / 6)
    chi2_test(np.bincount(rng.integers(0, 6, 3000), minlength=6).astype(float), p, 1e-3, "fair")
    loaded = np.array([0.1 + 1 / 6, 1 / 6, 1 / 6, 1 / 6, 1 / 6, 1 / 6 - 0.1])
    with pytest.raises(AssertionError, match="chi-square"):
        chi2_test(np.bincount(rng.choice(6, 3000, p=loaded), minlength=6).astype(float), p, 1e-3, "loaded")
    assert chi2_power(5, 3000 * ((loaded - p) ** 2 / p).sum(), 1e-3) > 0.99
    assert 16.2 < chi2_critical(3, 1e-3) < 16.6  # the table's 16.27
    rare = np.array([0.5, 0.3, 0.19, 0.006, 0.004, 0.0])
    assert binned(rare, 5.0, 500).tolist() == [0, 1, 2, 3, 3, -1]  # 3 + 2 expected: one bin of 5
    assert binned(rare, 5.0, 300).tolist() == [0, 1, 2, 2, 2, -1]  # 1.8 + 1.2: into the smallest bin


STAT_V = 6  # a 6-token vocabulary: exact joint distributions over 4 tokens are 6^4 outcomes
STAT_PROMPT = [1, 2, 3, 1, 2]  # repeats, so that prompt lookup drafts
STAT_NEW = 4  # tokens per run: the first is sampled at the prefill, the other 3 in speculative rounds
STAT_K = 2  # K = 2, not adaptive: round one drafts tokens 2 and 3 (bonus 4); rejections leave rounds of K = 1
STAT_RUNS = 3000
# Each case runs 5 tests (the binned joint of the 4 tokens, and each token's marginal), at a total
# alpha of 1e-3 (Bonferroni: 2e-4 each). Power (noncentral chi-square, 3000 runs; a total variation
# shift d gives noncentrality >= 4 N d^2): a marginal test (df <= 5) detects a shift of total
# variation 0.054 with probability >= 0.9; the joint test (df about 100 to 115) one of 0.088 on the
# binned joint. The model-draft cases also check that the likeliest bug, keeping every drafted token
# (token 2 from q), would be rejected with probability >= 0.9. Checked by hand against broken copies
# of `verify` (residual p instead of max(0, p - q); acceptance sqrt(min(1, p/q)); the bonus token from
# the last drafted position; ngram drafts always kept): each fails these tests.
STAT_ALPHA = 1e-3 / 5
# No plain temperature-1 case: "penalties" draws from (nearly) the whole vocabulary at temperature 0.9, and
# `verify` alone is checked on unprocessed distributions below.
STAT_SAMPLING = {"t0.8-k4-p0.9": SamplingSettings(temperature=0.8, top_k=4, top_p=0.9, max_new_tokens=STAT_NEW),
                 # the penalties read each drafted position's history (the prompt's tokens for the repetition
                 # penalty, the generated ones for all three): a wrong history moves the joint distribution
                 "penalties": SamplingSettings(temperature=0.9, repetition_penalty=1.8, presence_penalty=0.6,
                                               frequency_penalty=0.5, logit_bias={4: 0.5}, min_p=0.02,
                                               max_new_tokens=STAT_NEW)}


@pytest.fixture(scope="module")
def stat_models(tiny_export):
    """Two tiny random models over a 6-token vocabulary, different seeds: p != q (total variation
    about 0.2 to 0.35 at these settings), exported and run on ONNX Runtime (thousands of runs each:
    its calls cost a fraction of PyTorch's at this size)."""
    kw = dict(vocab_size=STAT_V, n_positions=32, n_embd=32, n_layer=1, n_head=4, initializer_range=0.1,
              bos_token_id=0, eos_token_id=0)
    return tuple(OrtBackend(tiny_export(seed=seed, gated=False, **kw)[2], threads=1) for seed in (31, 32))


def exact_sequence_distribution(backend, prompt: list[int], settings: SamplingSettings, n: int) -> np.ndarray:
    """P(t1 .. tn) (shape (V,) * n) under the sampler's filtered distributions of the model's no-cache
    logits: every continuation of n - 1 tokens forwarded in one batch, token i's distribution processed
    with the history of the prompt and the continuation's first i tokens."""
    V = backend.vocab_size
    conts = list(itertools.product(range(V), repeat=n - 1))
    ids = np.asarray([prompt + list(c) for c in conts], dtype=np.int64)
    mask = np.ones_like(ids)
    logits = backend.run(ids, mask, positions(mask, ids.shape[1]), None)[0][:, len(prompt) - 1 :]  # (C, n, V)
    rows = [History(prompt, list(c[:i])) for c in conts for i in range(n)]  # in the order of reshape(-1, V)
    p = Sampler(settings).probabilities(logits.reshape(-1, V), rows).reshape(logits.shape)
    joint = np.zeros((V,) * n)
    for row, c in enumerate(conts):
        prefix = np.prod([p[row, i, c[i]] for i in range(n - 1)])
        joint[c] = prefix * p[row, n - 1]
    assert abs(joint.sum() - 1) < 1e-9
    return joint


@pytest.mark.parametrize("setting", STAT_SAMPLING)
@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_sampling_follows_the_target_distribution(stat_models, draft, setting):
    target, draft_model = stat_models
    settings = STAT_SAMPLING[setting]
    joint = exact_sequence_distribution(target, STAT_PROMPT, settings, STAT_NEW)
    drafter = ModelDrafter(draft_model, "draft") if draft == "model" else NgramDrafter()
    sampler = Sampler(settings)  # one seeded stream for all runs: independent, reproducible draws
    stats = SpecStats()
    counts = np.zeros_like(joint)
    for _ in range(STAT_RUNS):
        control = DraftControl(STAT_K, adaptive=False)
        out = [t for chunk in speculative_loop(target, drafter, STAT_PROMPT, sampler, STAT_NEW, control, stats)
               for t in chunk]
        assert len(out) == STAT_NEW
        counts[tuple(out)] += 1
    # the speculative paths ran: drafts kept and drafts rejected, over many rounds
    assert stats.drafts > STAT_RUNS / 2 and 0 < stats.accepted < stats.drafted
    chi2_test(counts, joint, STAT_ALPHA, f"{draft} {setting}: joint of the 4 tokens")
    for i in range(STAT_NEW):
        axes = tuple(a for a in range(STAT_NEW) if a != i)
        chi2_test(counts.sum(axis=axes), joint.sum(axis=axes), STAT_ALPHA, f"{draft} {setting}: token {i + 1}")
    if draft == "model":
        # Power against keeping every drafted token: token 2 would follow sum_t1 p(t1) q(. | t1).
        ids = np.asarray([STAT_PROMPT + [t] for t in range(STAT_V)], dtype=np.int64)
        mask = np.ones_like(ids)
        q2 = Sampler(settings).probabilities(draft_model.run(ids, mask, positions(mask, ids.shape[1]), None)[0][:, -1],
                                             [History(STAT_PROMPT, [t]) for t in range(STAT_V)])
        p1 = joint.sum(axis=(1, 2, 3))
        wrong = p1 @ q2  # q2[t1] = q(. | t1)
        right = joint.sum(axis=(0, 2, 3))
        if (wrong[right == 0] > 0).any():
            return  # that bug would draw a token the target cannot produce: caught outright
        lam = STAT_RUNS * ((wrong - right) ** 2 / right).sum()
        assert chi2_power(STAT_V - 1, lam, STAT_ALPHA) >= 0.9


# `verify` alone, on hand-made distributions over 4 tokens: p at the drafted position, a second
# distribution for the bonus token, q the draft's.
P = np.array([0.5, 0.2, 0.2, 0.1])
P_BONUS = np.array([0.1, 0.2, 0.3, 0.4])
Q = np.array([0.25, 0.5, 0.125, 0.125])
VERIFY_DRAWS = 20000
VERIFY_ALPHA = 1e-4


def verify_runs(proposal_for, seed: int = 11) -> list[list[int]]:
    sampler = Sampler(SamplingSettings(temperature=1.0, top_k=0, seed=seed))
    logits = np.log(np.stack([P, P_BONUS]))
    return [verify(logits, proposal_for(sampler), sampler) for _ in range(VERIFY_DRAWS)]


def binomial_ok(k: int, n: int, p: float, z: float = 4.5) -> bool:
    return abs(k - n * p) <= z * math.sqrt(n * p * (1 - p))


def test_verify_greedy_hand_computed():
    logits = np.array([[0, 0, 0, 5.0], [0, 5.0, 0, 0], [5.0, 0, 0, 0]])
    sampler = Sampler(SamplingSettings(greedy=True))
    assert verify(logits, Proposal([3, 1]), sampler) == [3, 1, 0]  # both kept, then the bonus token
    assert verify(logits, Proposal([3, 2]), sampler) == [3, 1]  # the second corrected
    assert verify(logits, Proposal([0, 1]), sampler) == [3]  # the first corrected; the rest dropped
    assert verify(logits[:1], Proposal([]), sampler) == [3]  # nothing drafted: a plain step


def test_verify_keeps_a_drafted_token_with_probability_min_1_p_over_q():
    """d = 1: p/q = 0.4, so kept 40% of the time (then a bonus token from P_BONUS); else replaced by a
    draw from max(0, p - q) normalised = [0.25, 0, 0.075, 0] / 0.325."""
    runs = verify_runs(lambda s: Proposal([1], Q[None]))
    kept = [r for r in runs if len(r) == 2]
    assert all(r[0] == 1 for r in kept) and all(len(r) == 1 for r in runs if len(r) != 2)
    assert binomial_ok(len(kept), VERIFY_DRAWS, 0.4), len(kept)
    chi2_test(np.bincount([r[1] for r in kept], minlength=4).astype(float), P_BONUS, VERIFY_ALPHA, "bonus")
    residual = np.array([0.25, 0.0, 0.075, 0.0]) / 0.325
    chi2_test(np.bincount([r[0] for r in runs if len(r) == 1], minlength=4).astype(float), residual,
              VERIFY_ALPHA, "residual")
    # d = 0: p/q = 2, always kept
    assert all(len(r) == 2 and r[0] == 0 for r in verify_runs(lambda s: Proposal([0], Q[None])))


def test_verify_with_drafts_from_q_yields_p():
    """The rule's point: drafts drawn from q, the first token out follows p exactly."""
    runs = verify_runs(lambda s: Proposal([int(s.draw(Q[None])[0])], Q[None]), seed=12)
    chi2_test(np.bincount([r[0] for r in runs], minlength=4).astype(float), P, VERIFY_ALPHA, "first token")
    # accepted with probability sum_x min(p(x), q(x)) = 0.25 + 0.2 + 0.125 + 0.1 = 0.675
    assert binomial_ok(sum(len(r) == 2 for r in runs), VERIFY_DRAWS, 0.675)


def test_verify_point_mass_draft():
    """An ngram draft (no q): a draw from p, the draft kept when the draw is it (probability p(d))."""
    runs = verify_runs(lambda s: Proposal([2]), seed=13)
    chi2_test(np.bincount([r[0] for r in runs], minlength=4).astype(float), P, VERIFY_ALPHA, "point mass")
    kept = [r for r in runs if len(r) == 2]
    assert all(r[0] == 2 for r in kept) and all(r[0] != 2 for r in runs if len(r) == 1)
    assert binomial_ok(len(kept), VERIFY_DRAWS, 0.2)
    chi2_test(np.bincount([r[1] for r in kept], minlength=4).astype(float), P_BONUS, VERIFY_ALPHA, "bonus")


# ---------------------------------------------------------------- 5. seeds


def test_seeded_speculative_sampling_is_reproducible(tiny):
    target = OrtBackend(tiny.infos[Precision.fp32], threads=1)
    ds = DraftSettings(num_speculative_tokens=3, adaptive=False)
    drafter = ModelDrafter(TorchBackend(tiny.draft_model), "tiny draft")

    def run(seed: int) -> list[int]:
        settings = SamplingSettings(max_new_tokens=24, top_k=50, seed=seed)
        [g] = generate(target, ["ROMEO:"], settings, draft=drafter, draft_settings=ds)
        assert g.speculation["drafts"] > 0
        return g.tokens

    first = run(7)
    assert run(7) == first
    assert run(8) != first


# ---------------------------------------------------------------- 6. DraftControl


def test_draft_control_grows_and_shrinks_k():
    """K: starts at start_tokens, + grow after full acceptance (capped), - 1 after a rejection (>= 1),
    capped by what is left. Rounds here are fast (they pay), so no backoff interferes."""
    c = DraftControl(num_speculative_tokens=6, start_tokens=1, grow=2)
    assert c.next_k(10) == 0 and c.next_k(10) == 0  # the first decode steps are plain: they measure plain steps
    c.plain(0.01)
    c.plain(0.01)  # 100 tokens/s
    assert c.next_k(10) == 1
    c.speculated(1, 1, 0.001, 0.001)  # full acceptance: + 2
    assert c.next_k(10) == 3
    c.speculated(3, 3, 0.001, 0.001)
    assert c.next_k(10) == 5
    c.speculated(5, 5, 0.001, 0.001)  # + 2, capped at max_tokens
    assert c.next_k(10) == 6
    c.speculated(6, 1, 0.001, 0.001)  # a rejection: - 1
    assert c.next_k(10) == 5
    c.speculated(5, 0, 0.001, 0.001)
    assert c.next_k(10) == 4
    for _ in range(5):
        c.speculated(c.k, 0, 0.0001, 0.0001)
    assert c.k == 1  # never below 1
    assert c.next_k(0) == 0 and c.next_k(1) == 1  # capped by what is left
    assert not c.backing_off
    assert c.history[:8] == [0, 0, 1, 3, 5, 6, 5, 4]


def test_draft_control_backs_off_probes_and_resumes():
    c = DraftControl(num_speculative_tokens=4, start_tokens=4, min_backoff=8, backoff_growth=2, max_backoff=32, skip_cold=False)
    for _ in range(2):
        assert c.next_k(10) == 0
        c.plain(0.01)  # plain: 100 tokens/s
    assert c.next_k(10) == 4
    c.speculated(4, 0, 0.05, 0.05)  # 1 token in 0.1 s: 10 tokens/s, slower than plain
    assert c.backing_off
    for _ in range(8):  # plain for `backoff` = 8 steps
        assert c.next_k(10) == 0
        c.plain(0.01)
    k = c.next_k(10)
    assert k == c.k == 3  # a probe, with the current K (shrunk by the rejection)
    c.speculated(k, 0, 0.05, 0.05)  # the probe does not pay: the backoff grows
    assert c.backing_off and c.backoff == 16
    for _ in range(16):
        assert c.next_k(10) == 0
        c.plain(0.01)
    c.speculated(c.next_k(10), 0, 0.05, 0.05)
    assert c.backoff == 32
    for _ in range(32):
        assert c.next_k(10) == 0
        c.plain(0.01)
    c.speculated(c.next_k(10), 0, 0.05, 0.05)
    assert c.backoff == 32  # at most max_backoff
    for _ in range(32):
        c.next_k(10)
        c.plain(0.01)
    k = c.next_k(10)
    assert k > 0
    c.speculated(k, k - 1, 0.0005, 0.0005)  # a probe that pays (k tokens in 1 ms): speculation resumes
    assert not c.backing_off and c.backoff == 8
    assert c.next_k(10) > 0 and c.next_k(10) > 0


def test_draft_control_judges_growing_rounds_only_when_they_could_pay():
    """A fully accepted round that grows K is not judged while it runs near plain's rate and a full
    round of max_tokens at its costs would beat plain; a draft costlier than the target is."""
    c = DraftControl(num_speculative_tokens=8, start_tokens=1, skip_cold=False)
    c.plain(0.01)
    c.plain(0.01)  # 100 tokens/s
    # A cheap draft (1 ms a token) behind a 12 ms verification: 2 tokens in 13 ms is below plain's rate,
    # but within ramp_floor, and 8 drafted tokens (9 in 20 ms) would pay: K grows, no backoff.
    c.speculated(1, 1, 0.001, 0.012)
    assert not c.backing_off and c.k == 3
    # A draft as slow as the target (10 ms a token): even a full round of 8 could not pay.
    d = DraftControl(num_speculative_tokens=8, start_tokens=1, skip_cold=False)
    d.plain(0.01)
    d.plain(0.01)
    d.speculated(1, 1, 0.010, 0.012)
    assert d.backing_off


def test_draft_control_skips_the_first_round_of_each_k():
    """The first verification of a length pays one-off costs: a fully accepted round of a new K is
    neither judged nor counted; the next round of the same K is. A rejected round is judged at once."""
    c = DraftControl(num_speculative_tokens=2, start_tokens=2)
    c.plain(0.01)
    c.plain(0.01)
    c.speculated(2, 2, 0.05, 0.05)  # slow, fully accepted, the first K = 2: not judged
    assert not c.backing_off and c.spec_rate is None and c.k == 2
    c.speculated(2, 2, 0.05, 0.05)  # K = 2 again: judged, slower than plain
    assert c.backing_off
    d = DraftControl(num_speculative_tokens=8, start_tokens=1)
    d.plain(0.01)
    d.plain(0.01)
    d.speculated(1, 0, 0.05, 0.05)  # the first K = 1, rejected and slow: judged
    assert d.backing_off


def test_draft_control_not_adaptive_always_drafts_k():
    c = DraftControl(num_speculative_tokens=5, adaptive=False)
    assert c.next_k(10) == 5  # no plain first step
    c.speculated(5, 0, 5.0, 5.0)  # rejected and slow: nothing changes
    assert c.next_k(10) == 5 and not c.backing_off
    c.plain(0.001)
    c.speculated(5, 0, 5.0, 5.0)
    assert c.next_k(10) == 5 and not c.backing_off
    assert c.next_k(3) == 3 and c.next_k(0) == 0
    assert c.history == [5, 5, 5, 3, 0]


# ---------------------------------------------------------------- 7, 8. the command line


def refused(capsys, *args: str, code: int, fragments: tuple[str, ...]) -> None:
    """The command (in this process: a refusal starts nothing a subprocess would isolate) exits `code` with one
    line naming `fragments`, and prints nothing on stdout."""
    from ..helpers import assert_one_line_error, cli

    capsys.readouterr()  # what the test's set-up printed (transformers' progress bars)
    got, out, err = cli(capsys, *args)
    for fragment in fragments:
        assert_one_line_error(got, err, code, fragment)
    assert out == ""


def test_cli_refuses_a_draft_for_genai(bundled, capsys):
    refused(capsys, "generate", "x", "--backend", "genai", "--onnx", str(bundled.infos[Precision.fp32].folder),
            "--draft", "ngram", "--threads", "1", code=2, fragments=("roll back", "genai"))


def test_cli_refuses_a_draft_with_another_vocabulary_size(tmp_path, capsys):
    """A model whose vocabulary has 1000 tokens. The torch target loads it as it is; the ort target
    would export it into ./exported first (the same refusal, after an export this test should not leave)."""
    make_hf_model(tmp_path / "small-vocab", seed=3, vocab_size=1000, bos_token_id=0, eos_token_id=0)
    refused(capsys, "generate", "x", "--backend", "torch", "--draft", str(tmp_path / "small-vocab"), code=2,
            fragments=("vocabulary", "1000"))


def test_cli_refuses_a_draft_with_another_tokenizer(tiny_hf, bundled, tmp_path, capsys):
    """A GPT-2-sized model whose vocab.json is not GPT-2's: refused before any export of it."""
    folder = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_hf[0], folder)
    (folder / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}), encoding="utf-8")
    refused(capsys, "generate", "x", "--onnx", str(bundled.infos[Precision.fp32].folder), "--draft", str(folder),
            code=2, fragments=("vocab.json", "tokenizer"))
    assert not default_export_dir(str(folder), Precision.fp32).exists()


def test_cli_refuses_a_draft_with_beam_search(capsys):
    refused(capsys, "generate", "x", "--draft", "ngram", "--num-beams", "2", code=2, fragments=("--num-beams",))


def cli_json(capsys, *args: str) -> dict:
    from ..helpers import cli

    code, out, _ = cli(capsys, *args)
    assert code == 0, out
    return json.loads(out)


def test_cli_greedy_with_ngram_draft_equals_without(capsys, bundled, monkeypatch):
    args = ["generate", "ROMEO:", "--greedy", "--max-new-tokens", "20", "--json", "--threads", "1",
            "--onnx", str(bundled.infos[Precision.fp32].folder)]
    plain = cli_json(capsys, *args)
    spy = DraftSpy.on(monkeypatch, NgramDrafter)  # the drafter the command opens
    spec = cli_json(capsys, *args, "--draft", "ngram")
    assert "speculation" not in plain
    assert spec["prompt_tokens"] == plain["prompt_tokens"] == encode("ROMEO:")
    g_plain = Generation("ROMEO:", plain["prompt_tokens"], plain["tokens"], plain["finish_reason"])
    g_spec = Generation("ROMEO:", spec["prompt_tokens"], spec["tokens"], spec["finish_reason"], spec["speculation"])
    assert_greedy_equal(OrtBackend(bundled.infos[Precision.fp32], threads=1), g_plain, g_spec, MARGIN)
    assert spec["draft"] == "ngram"
    [rounds] = spy.runs
    assert_stats(g_spec, DraftSettings(), rounds)
