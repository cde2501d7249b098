"""decode_static: StaticDecoder's steps with gpt2x's sampler (the draw on the device) against the host sampler's
generation on the same export (generate on OrtBackend), and its refusals. On the CPU provider (fp32)."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2x.choices import Precision, ProviderKind
from gpt2x.errors import UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.static_decoding import decode_static
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.static_decode import StaticDecoder


@pytest.fixture(scope="module")
def info(tiny_export):
    return tiny_export(Precision.fp32)[2]


def host_tokens(info, prompts: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """The host sampler's tokens, one prompt at a time (each its own seeded generator, as decode_static's one row)."""
    backend = OrtBackend(info, in_place_kv=False)
    return np.array([generate(backend, [""], settings, prompt_ids=[row.tolist()])[0].tokens for row in prompts])


@pytest.mark.parametrize("temperature,seed", [(0.8, 7), (1.0, 11), (1.7, 3)])
def test_the_device_draw_follows_the_host_sampler(info, temperature, seed):
    prompts = np.random.default_rng(seed).integers(0, info.config.vocab_size, (1, 6))
    settings = SamplingSettings(temperature=temperature, seed=seed, max_new_tokens=40, ignore_eos=True)
    decoder = StaticDecoder(info, ProviderKind.cpu, capacity=64, sampling=True)
    got = decode_static(decoder, prompts, settings)
    np.testing.assert_array_equal(got, host_tokens(info, prompts, settings))
    assert len(set(got[0].tolist())) > 5  # drawn, not one token repeated


def test_greedy_on_a_sampling_decoder_takes_the_argmax(info):
    prompts = np.random.default_rng(1).integers(0, info.config.vocab_size, (2, 5))
    settings = SamplingSettings(greedy=True, max_new_tokens=20, ignore_eos=True)
    want = StaticDecoder(info, ProviderKind.cpu, rows=2, capacity=32).generate(prompts, 20)
    got = decode_static(StaticDecoder(info, ProviderKind.cpu, rows=2, capacity=32, sampling=True), prompts, settings)
    np.testing.assert_array_equal(got, want)


def test_refusals(info):
    prompt = np.ones((1, 4), np.int64)
    argmax_only = StaticDecoder(info, ProviderKind.cpu, capacity=16)
    with pytest.raises(UsageError, match="sampling=True"):
        decode_static(argmax_only, prompt, SamplingSettings(temperature=0.8, max_new_tokens=4))
    sampling = StaticDecoder(info, ProviderKind.cpu, capacity=16, sampling=True)
    with pytest.raises(UsageError, match="temperature only, not TopK"):
        decode_static(sampling, prompt, SamplingSettings(temperature=0.8, top_k=5, max_new_tokens=4))
    with pytest.raises(UsageError, match="do not fit"):
        decode_static(sampling, prompt, SamplingSettings(temperature=0.8, max_new_tokens=13))
    sampling.prefill_logits(prompt)
    with pytest.raises(ValueError, match="no tokens for the next position"):
        sampling.step(uniform=np.array([0.5]))
    with pytest.raises(ValueError, match="takes a uniform per row"):
        sampling.step(np.array([1]))
    with pytest.raises(ValueError, match="make it with sampling=True"):
        argmax_only.set_temperature(0.5)


# ---------------------------------------------------------------- generate on the fixed cache (generate_fixed)


def both_ways(info, prompt_ids: list[list[int]], settings: SamplingSettings, fixed_cache: bool | None = True):
    """generate's results and on_token calls on the fixed cache (`fixed_cache`) and on the decode loop's growing cache."""
    out = []
    for fixed in (fixed_cache, False):
        backend, seen = OrtBackend(info, in_place_kv=False), []
        results = generate(backend, [""] * len(prompt_ids), settings, prompt_ids=prompt_ids, fixed_cache=fixed,
                           on_token=lambda row, tok, seen=seen: seen.append((row, tok)))
        out.append((results, seen))
        backend.close()
    return out


@pytest.mark.parametrize("sampled,seed", [(False, 36), (True, 5)])  # prompts whose rows' tokens vary (a random model)
def test_generate_on_the_fixed_cache_is_the_decode_loops_generation(info, sampled, seed):
    """Two rows, one ended early by a stop token id the loop's own run reaches: the same tokens, finish reasons and
    streamed tokens as the decode loop on the growing cache; the steps stop once both rows have ended."""
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(0, info.config.vocab_size, (2, 7)).tolist()
    settings = SamplingSettings(greedy=not sampled, temperature=0.9, seed=4, max_new_tokens=30, ignore_eos=True)
    free = generate(OrtBackend(info, in_place_kv=False), ["", ""], settings, prompt_ids=prompt_ids)
    # The first of row 1's tokens after its first that neither row has had before: row 1 ends there, row 0 goes on.
    end = next(j for j, t in enumerate(free[1].tokens[:15]) if j and t not in free[1].tokens[:j] + free[0].tokens[:20])
    stop = free[1].tokens[end]
    settings = SamplingSettings(greedy=not sampled, temperature=0.9, seed=4, max_new_tokens=20, ignore_eos=True,
                                stop_token_ids=(stop,))
    (fixed, fixed_seen), (loop, loop_seen) = both_ways(info, prompt_ids, settings)
    assert [(r.tokens, r.finish_reason) for r in fixed] == [(r.tokens, r.finish_reason) for r in loop]
    assert [r.finish_reason for r in fixed] == ["length", "stop"] and len(fixed[1].tokens) == end
    assert fixed_seen == loop_seen
    assert {r.decoder for r in fixed} == {"fixed cache"} and {r.decoder for r in loop} == {None}


def test_generate_on_the_fixed_cache_stops_at_the_context(info):
    n = info.config.n_positions
    prompt_ids = np.random.default_rng(2).integers(0, info.config.vocab_size, (1, n - 4)).tolist()
    settings = SamplingSettings(greedy=True, max_new_tokens=10, ignore_eos=True)
    (fixed, _), (loop, _) = both_ways(info, prompt_ids, settings)
    assert (fixed[0].tokens, fixed[0].finish_reason) == (loop[0].tokens, "context") and len(loop[0].tokens) == 4


def test_where_the_fixed_cache_cannot_run_a_generation(info):
    """fixed_cache=None falls back to the decode loop (same tokens, no decoder named); True refuses, saying why."""
    uneven = [[1, 2, 3], [4, 5, 6, 7]]
    (auto, _), (loop, _) = both_ways(info, uneven, SamplingSettings(greedy=True, max_new_tokens=6), fixed_cache=None)
    assert [r.tokens for r in auto] == [r.tokens for r in loop] and auto[0].decoder is None
    backend = OrtBackend(info, in_place_kv=False)
    for settings, ids, why in (
        (SamplingSettings(greedy=True, max_new_tokens=4), uneven, "prompts of different lengths"),
        (SamplingSettings(temperature=0.8, top_p=0.9, max_new_tokens=4), [[1, 2]], "temperature only, not TopP"),
        (SamplingSettings(greedy=True, min_tokens=2, max_new_tokens=4), [[1, 2]], "temperature only, not MinTokens"),
        (SamplingSettings(temperature=0.8, n=2, max_new_tokens=4), [[1, 2]], "several samples per prompt"),
        (SamplingSettings(greedy=True, num_beams=2, max_new_tokens=4), [[1, 2]], "beam search"),
    ):
        with pytest.raises(UsageError, match=f"^kv_cache fixed: .*{why}"):
            generate(backend, [""] * len(ids), settings, prompt_ids=ids, fixed_cache=True)
