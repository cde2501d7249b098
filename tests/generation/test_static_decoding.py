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
