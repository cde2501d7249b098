"""The ONNX Runtime backend with an int8 export's batched decode graph (runtime/ort.py): a step of rows x new tokens
from the record's batched_from runs on it, a smaller one on model.onnx, both on the same in-place KV buffers; checked
step by step against each single-graph backend (which graph ran) and against PyTorch's forward without a cache
(a generation crossing the threshold both ways); asked for or refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2x.choices import Precision
from gpt2x.errors import ProviderError
from gpt2x.evaluate.parity import TOLERANCES
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import BATCHED_KEY, ExportInfo
from gpt2x.runtime.ort import BATCHED_MIN_ROWS, InPlaceCache, OrtBackend

from ..helpers import torch_last_logits

FROM = 3  # the threshold the tests record: a 3-row decode step runs on the batched graph, a 2-row one does not


@pytest.fixture(scope="module")
def tiny(tiny_export):
    model, _, info = tiny_export(Precision.int8, batched=True)
    assert info.batched is not None, info.meta.get(BATCHED_KEY)
    return model, info


def with_from(info: ExportInfo, start: int | None) -> ExportInfo:
    """`info` with its record's batched_from set to `start`."""
    return ExportInfo(info.folder, {**info.meta, BATCHED_KEY: {**info.meta[BATCHED_KEY], "batched_from": start}})


@pytest.fixture(scope="module")
def backends(tiny):
    _, info = tiny
    with OrtBackend(with_from(info, FROM), threads=1) as switching, OrtBackend(info, threads=1, batched=False) as model, \
            OrtBackend(info, threads=1, batched=True) as batched:
        yield switching, model, batched


def test_the_record_sets_batched_from_and_a_user_may_turn_it_off(tiny):
    _, info = tiny
    with OrtBackend(info, threads=1) as backend:
        assert backend.batched_from == info.batched["batched_from"]
        assert not backend.batched_open  # opened by the first step that runs on it, not at load
        assert backend.session_for(1, 1) is backend.session and not backend.batched_open
        rows = max(BATCHED_MIN_ROWS, backend.batched_from)
        batched = backend.session_for(rows, 1)
        assert batched is not backend.session and backend.batched_open and backend.session_for(rows, 1) is batched
    with OrtBackend(info, threads=1, batched=False) as backend:
        assert backend.batched_from is None and backend.session_for(1000, 1000) is backend.session
    with OrtBackend(with_from(info, None), threads=1) as backend:  # timed never faster: never
        assert backend.batched_from is None


def test_an_8_bit_graph_from_before_is_skipped_where_the_cpu_would_overflow_it(tiny, monkeypatch):
    """A record without weight_bits (an export from before its weights kept 7 bits): on a CPU without VNNI every step
    runs on model.onnx, and asking for the batched graph is one ProviderError; with VNNI, or 7-bit weights, it runs."""
    from gpt2x.runtime import providers

    _, info = tiny
    assert info.batched["weight_bits"] == 7
    old = ExportInfo(info.folder, {**info.meta, BATCHED_KEY: {k: v for k, v in info.meta[BATCHED_KEY].items() if k != "weight_bits"}})
    monkeypatch.setattr(providers, "cpu_sums_int8_in_32_bits", lambda: True)
    assert providers.batched_from(old, None, on_cpu=True) == info.batched["batched_from"]
    assert providers.batched_from(old, True, on_cpu=True) == 1
    monkeypatch.setattr(providers, "cpu_sums_int8_in_32_bits", lambda: False)
    assert providers.batched_from(info, None, on_cpu=True) == info.batched["batched_from"]
    assert providers.batched_from(info, True, on_cpu=True) == 1
    assert providers.batched_from(old, None, on_cpu=True) is None
    with OrtBackend(old, threads=1) as backend:
        assert backend.batched_from is None and backend.session_for(1000, 1) is backend.session
    with pytest.raises(ProviderError, match="8-bit weights overflow this CPU's int8 kernel"):
        OrtBackend(old, threads=1, batched=True)


def test_the_cpu_flags_say_whether_int8_products_sum_in_32_bits(monkeypatch, tmp_path):
    """Read from /proc/cpuinfo's flags on x86: VNNI (AVX-512 or AVX) or AMX, and not AVX2 alone."""
    from gpt2x.runtime import providers

    cpuinfo, real = tmp_path / "cpuinfo", providers.Path
    monkeypatch.setattr(providers, "Path", lambda p: real(cpuinfo) if p == "/proc/cpuinfo" else real(p))
    monkeypatch.setattr(providers.platform, "machine", lambda: "x86_64")
    for flags, expected in (("fpu avx2 fma", False), ("fpu avx2 avx512_vnni", True), ("avx2 avx_vnni", True), ("amx_int8 avx2", True)):
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        providers.cpu_sums_int8_in_32_bits.cache_clear()
        assert providers.cpu_sums_int8_in_32_bits() is expected, flags
    monkeypatch.setattr(providers.platform, "machine", lambda: "aarch64")
    providers.cpu_sums_int8_in_32_bits.cache_clear()
    assert providers.cpu_sums_int8_in_32_bits() is True
    providers.cpu_sums_int8_in_32_bits.cache_clear()


def test_each_step_runs_on_the_graph_its_rows_times_new_tokens_choose(tiny, backends):
    """The same step from the same past on all three backends: the switching one's logits are the batched-only
    backend's from FROM rows x new tokens on (with BATCHED_MIN_ROWS rows) and model.onnx's below (the two graphs
    differ by int8 rounding)."""
    model, info = tiny
    switching, only_model, only_batched = backends
    assert switching.batched_from == FROM and switching.in_place_kv and not switching.batched_multi_token_past
    rng = np.random.default_rng(11)
    assert BATCHED_MIN_ROWS == 2
    for rows, new in ((1, 1), (2, 1), (3, 1), (1, 3), (1, 4), (2, 2), (4, 1)):
        ids = rng.integers(0, info.config.vocab_size, (rows, 6 + new))
        mask = np.ones_like(ids)
        past = only_model.step(ids[:, :6], mask[:, :6], positions(mask[:, :6], 6), None)[1].to_numpy()
        got = {}
        for name, backend in (("switching", switching), ("model", only_model), ("batched", only_batched)):
            got[name] = backend.step(ids[:, 6:], mask, positions(mask, new), backend.past_from_numpy(past))[0]
        run_rows = 1 if rows > 1 and new > 1 else rows  # GroupQueryAttention: several rows' multi-token steps row by row
        same = "batched" if run_rows * new >= FROM and run_rows >= BATCHED_MIN_ROWS else "model"
        other = "model" if same == "batched" else "batched"
        np.testing.assert_allclose(got["switching"], got[same], rtol=0, atol=1e-5, err_msg=f"{rows}x{new}")
        assert np.abs(got[other] - got[same]).max() > 1e-4  # the check can tell the graphs apart


def test_a_generation_crossing_the_threshold_matches_pytorch(tiny, backends):
    """A left-padded 3-row prefill and decode steps (batched graph), a row leaving (2 rows: model.onnx, the same
    buffers merged in place), then a row joining (3 rows: the batched graph again, on bindings made before):
    every step's logits against PyTorch's forward of the whole sequences."""
    model, info = tiny
    switching = backends[0]
    tol = TOLERANCES[Precision.int8].max_rel
    rng = np.random.default_rng(5)
    ids = rng.integers(0, info.config.vocab_size, (3, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0

    def check(logits):
        want = torch_last_logits(model, ids, mask)
        assert np.abs(logits - want).max() / np.abs(want).max() <= tol

    def step(cache):
        nonlocal ids, mask
        new = logits.argmax(-1)[:, None]
        ids, mask = np.concatenate([ids, new], 1), np.concatenate([mask, np.ones_like(new)], 1)
        return switching.step(new, mask, positions(mask, 1), cache)

    logits, cache = switching.step(ids, mask, positions(mask, 6), None)
    check(logits)
    for _ in range(2):
        logits, cache = step(cache)
        check(logits)
    buffers = cache.buffers
    cache = cache.merge(np.array([0, 2]), None, cache.length)  # row 1 leaves
    ids, mask, logits = ids[[0, 2]], mask[[0, 2]], logits[[0, 2]]
    for _ in range(2):
        logits, cache = step(cache)
        check(logits)
    assert cache.buffers is buffers and isinstance(cache, InPlaceCache)
    joiner_ids = rng.integers(0, info.config.vocab_size, (1, cache.length))
    joiner_logits, joiner = switching.step(joiner_ids, np.ones_like(joiner_ids), positions(np.ones_like(joiner_ids),
                                                                                        cache.length), None)
    cache = cache.merge(np.array([0, 1, 2]), joiner, cache.length)  # a row joins
    ids, mask = np.concatenate([ids, joiner_ids]), np.concatenate([mask, np.ones_like(joiner_ids)])
    logits = np.concatenate([logits, joiner_logits])
    for _ in range(2):
        logits, cache = step(cache)
        check(logits)


def test_asking_for_it_where_there_is_none_is_one_line(tiny_export):
    info = tiny_export(Precision.int8)[2]
    with pytest.raises(ProviderError, match="cannot run steps on a batched decode graph: it has none") as e:
        OrtBackend(info, threads=1, batched=True)
    assert "\n" not in str(e.value)
    with OrtBackend(info, threads=1) as backend:
        assert backend.batched_from is None



def test_warm_up_opens_the_batched_graph_where_steps_would_run_on_it(tiny):
    _, info = tiny
    with OrtBackend(with_from(info, FROM), threads=1) as switching, OrtBackend(info, threads=1, batched=False) as model:
        assert not switching.batched_open
        switching.warm_up()
        assert switching.batched_open and switching.session_for(FROM, 1) is switching._batched
        model.warm_up()
        assert not model.batched_open  # no batched graph in use: nothing to open
