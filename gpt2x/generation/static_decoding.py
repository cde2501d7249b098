"""Decoding on runtime.static_decode.StaticDecoder with gpt2x's sampler: the first token drawn on the host from the
prompt's logits, every later one on the device (its argmax, or its draw at the sampler's temperature from the
sampler's own seeded uniforms), so that the tokens are the host sampler's wherever the logits agree."""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from ..runtime.static_decode import StaticDecoder
from .processors import Temperature
from .sampling import Sampler
from .settings import SamplingSettings


def decode_static(decoder: StaticDecoder, prompt_ids: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """settings.max_new_tokens tokens per row [rows, n] after `prompt_ids` [rows, T], EOS not stopping a row (the
    decoder's steps are fixed). Greedy, or sampling at a temperature (a sampling decoder's): the device draws by the
    host sampler's inverse CDF, in float64 too (its running sum in another order, so a uniform within rounding of a
    token's boundary could pick its neighbour). Other processors (top-k, top-p, penalties, ...) are refused."""
    sampler = Sampler(settings)
    others = sorted({type(p).__name__ for p in sampler.processors if not isinstance(p, Temperature)})
    if others:
        raise UsageError(f"the device sampler takes a temperature only, not {', '.join(others)}")
    if not settings.greedy and not decoder.sampling:
        raise UsageError("this decoder takes the argmax: sampling needs StaticDecoder(..., sampling=True)")
    n = settings.max_new_tokens
    if np.shape(prompt_ids)[-1] + n > decoder.capacity:
        raise UsageError(f"a prompt of {np.shape(prompt_ids)[-1]} tokens and {n} new ones do not fit the decoder's "
                         f"{decoder.capacity} positions", option="max_new_tokens")
    out = np.empty((decoder.rows, n), np.int64)
    if n == 0:
        return out
    out[:, 0] = decoder.prefill_tokens(sampler(decoder.prefill_logits(prompt_ids)))
    if decoder.sampling:
        decoder.set_temperature(0.0 if settings.greedy else settings.temperature)
    for i in range(1, n):
        # One uniform per row per step from the sampler's generator, as the host sampler draws them.
        uniform = None if not decoder.sampling else \
            np.zeros(decoder.rows) if settings.greedy else sampler.rng.random(decoder.rows)
        out[:, i] = decoder.step(uniform=uniform)
    return out
