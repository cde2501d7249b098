"""Decoding on runtime.static_decode.StaticDecoder with gpt2x's sampler: the first token drawn on the host from the
prompt's logits, every later one on the device (its argmax, or its draw at the sampler's temperature from the
sampler's own seeded uniforms), so that the tokens are the host sampler's wherever the logits agree.

`generate_fixed` is `generate` on it (`gpt2x generate`'s decoder on CUDA, docs/commands/generate.md): each row ends as
decode.Sequence decides, the steps stopping at the first block after every row has ended."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import UsageError
from ..runtime.static_decode import StaticDecoder
from .decode import Sequence
from .processors import Temperature
from .sampling import Sampler
from .settings import Generation, OnToken, SamplingSettings


def _device_refusal(sampler: Sampler) -> str | None:
    """Why the device's draw cannot stand for `sampler`'s (it draws at a temperature, nothing else), or None."""
    others = sorted({type(p).__name__ for p in sampler.processors if not isinstance(p, Temperature)})
    return f"the device sampler takes a temperature only, not {', '.join(others)}" if others else None


def _steps(decoder: StaticDecoder, prompt_ids: np.ndarray, sampler: Sampler, n: int) -> Iterator[np.ndarray]:
    """Each row's next tokens [rows, k], `n` in all: the first drawn on the host from the prompt's logits, the others
    on the device in blocks of the decoder's (StaticDecoder.steps: read once a block), one uniform per row per step
    from the sampler's generator, in the order the host sampler draws them (step by step, row by row)."""
    yield decoder.prefill_tokens(sampler(decoder.prefill_logits(prompt_ids)))[:, None]
    greedy = sampler.s.greedy
    if decoder.sampling:
        decoder.set_temperature(0.0 if greedy else sampler.s.temperature)
    for done in range(1, n, decoder.block):
        k = min(decoder.block, n - done)
        uniforms = None if not decoder.sampling else \
            np.zeros((decoder.rows, k)) if greedy else sampler.rng.random((k, decoder.rows)).T
        yield decoder.steps(k, uniforms=uniforms)


def decode_static(decoder: StaticDecoder, prompt_ids: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """settings.max_new_tokens tokens per row [rows, n] after `prompt_ids` [rows, T], EOS not stopping a row (the
    decoder's steps are fixed). Greedy, or sampling at a temperature (a sampling decoder's): the device draws by the
    host sampler's inverse CDF, in float64 too (its running sum in another order, so a uniform within rounding of a
    token's boundary could pick its neighbour). Other processors (top-k, top-p, penalties, ...) are refused."""
    sampler = Sampler(settings)
    why = _device_refusal(sampler)
    if why:
        raise UsageError(why)
    if not settings.greedy and not decoder.sampling:
        raise UsageError("this decoder takes the argmax: sampling needs StaticDecoder(..., sampling=True)")
    n = settings.max_new_tokens
    if np.shape(prompt_ids)[-1] + n > decoder.capacity:
        raise UsageError(f"a prompt of {np.shape(prompt_ids)[-1]} tokens and {n} new ones do not fit the decoder's "
                         f"{decoder.capacity} positions", option="max_new_tokens")
    out = np.empty((decoder.rows, n), np.int64)
    done = 0
    for tokens in _steps(decoder, prompt_ids, sampler, n) if n else ():
        out[:, done:done + tokens.shape[1]] = tokens
        done += tokens.shape[1]
    return out


def fixed_refusal(settings: SamplingSettings, prompt_ids: list[list[int]], drafted: bool = False) -> str | None:
    """Why `generate` cannot run these prompts with `settings` on the fixed-capacity cache, or None. It takes rows of
    one length (no padding), greedy or a temperature alone, one sample per prompt; what needs the logits on the host
    (top-k, top-p, penalties, logit bias, min_tokens, structured output), beams or a draft stay on the growing cache."""
    if drafted:
        return "speculative decoding rolls its cache back"
    if settings.num_beams > 1:
        return "beam search reorders its rows"
    if settings.n > 1:
        return "several samples per prompt"
    if len({len(ids) for ids in prompt_ids}) > 1:
        return "prompts of different lengths (its rows are one length)"
    return _device_refusal(Sampler(settings))


def generate_fixed(backend, prompts: list[str], prompt_ids: list[list[int]], settings: SamplingSettings,
                   on_token: OnToken | None = None) -> list[Generation]:
    """`generate` on the backend's fixed-capacity decoder (capabilities.decodes_fixed) for prompts and settings that
    fixed_refusal lets through: the same tokens as the decode loop's wherever the logits agree (its sampler draws
    the same uniforms), each row ending as Sequence.accept decides; steps stop once every row has ended, or at the
    context. Each Generation names the decoder it ran on."""
    why = fixed_refusal(settings, prompt_ids)
    if why:
        raise UsageError(f"the fixed-capacity cache cannot run this generation: {why}")
    sampler = Sampler(settings)  # one seeded stream for the batch, drawn row by row, as generate's batch draws
    seqs = [Sequence(ids, settings, sampler=sampler) for ids in prompt_ids]
    T = len(prompt_ids[0])
    for seq in seqs:
        seq.limit = min(seq.max_tokens, backend.n_positions - T)
    n = max(seq.limit for seq in seqs)
    name = None
    if n > 0:
        decoder: StaticDecoder = backend.fixed_decoder(len(prompt_ids), T + n, sampling=not settings.greedy)
        name = decoder.name
        for block in _steps(decoder, np.asarray(prompt_ids, np.int64), sampler, n):
            # A block's tokens step by step: what it decoded past a row's end is discarded, never told.
            for tokens in block.T:
                for row, seq in enumerate(seqs):
                    if seq.finish is None:
                        kept, _ = seq.accept(int(tokens[row]))
                        if kept is not None and on_token is not None:
                            on_token(row, kept)
            if all(seq.finish is not None for seq in seqs):
                break
    return [s.result(p, decoder=name) for p, s in zip(prompts, seqs)]
