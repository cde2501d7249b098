"""What evaluation harnesses ask of a model, in NumPy on any Backend (no torch, no lm_eval): log-likelihoods of
continuations as left-padded batches on whole sequences, and generation cut at stop strings. lm-eval's model
class over it is gpt2x/lmeval/model.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import UsageError
from ..generation import decode as decoding
from ..generation.decode import left_pad
from ..generation.sampling import Sampler
from ..generation.settings import Finish, SamplingSettings
from ..numerics import positions, target_log_probs
from ..runtime.base import Backend
from ..tokenizer import EOT_ID, StreamDecoder, decode

DEFAULT_BATCH_SIZE = 8
# Token slots (rows x padded length) per scoring batch: every slot's logits come back (GPT-2: 4096 slots, 0.8 GB).
MAX_BATCH_TOKENS = 4096

Done = Callable[[int], None]  # told how many requests a batch finished (progress bars)


def _no_progress(n: int) -> None:
    pass


def scoring_input(context: list[int], continuation: list[int], n_positions: int) -> list[int]:
    """Context and continuation joined, less the last token (it predicts nothing scored), left-truncated."""
    return (context + continuation)[-(n_positions + 1) :][:-1]


def batches(lengths: Sequence[int], batch_size: int, max_tokens: int = MAX_BATCH_TOKENS) -> list[list[int]]:
    """Request indices in batches, longest first, within `batch_size` rows and `max_tokens` slots (a longer row
    runs alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < batch_size and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def score_continuations(backend: Backend, requests: Sequence[tuple[list[int], list[int]]],
                        batch_size: int = DEFAULT_BATCH_SIZE, done: Done = _no_progress,
                        max_tokens: int = MAX_BATCH_TOKENS) -> list[tuple[float, bool]]:
    """(sum of log p(continuation token), whether each is the argmax) per (context ids, continuation ids), in
    order. A context holds at least one token; an empty continuation scores (0.0, True)."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, got {batch_size}", option="batch_size")
    n = backend.n_positions
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    inputs: dict[int, list[int]] = {}
    for i, (context, continuation) in enumerate(requests):
        if not continuation:
            results[i] = (0.0, True)
        elif not context:
            raise UsageError("a context of no tokens (give it the end-of-text token)")
        elif len(continuation) > n:
            raise UsageError(f"a continuation of {len(continuation)} tokens does not fit the model's context ({n} tokens)")
        else:
            inputs[i] = scoring_input(context, continuation, n)
    if len(inputs) < len(requests):
        done(len(requests) - len(inputs))
    keys = list(inputs)
    for batch in batches([len(inputs[k]) for k in keys], batch_size, max_tokens):
        rows = [keys[b] for b in batch]
        ids, mask = left_pad([inputs[r] for r in rows])
        logits, _ = backend.run(ids, mask, positions(mask, ids.shape[1]), None)
        for row, r in enumerate(rows):
            targets = np.asarray(requests[r][1], dtype=np.int64)
            scored = logits[row, ids.shape[1] - len(targets) :]  # left padding: the continuation's logits are last
            logprob = float(target_log_probs(scored, targets).sum())
            results[r] = (logprob, bool((scored.argmax(axis=-1) == targets).all()))
        done(len(rows))
    return results  # type: ignore[return-value]  # every slot is filled


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first occurrence of any of the stop strings (all of it when none occurs)."""
    for s in stop:
        if s:
            text = text.split(s, 1)[0]
    return text


def prompt_for_generation(context: list[int], n_positions: int, max_new_tokens: int) -> list[int]:
    """A prompt leaving room for `max_new_tokens`: an empty one is end-of-text, a long one keeps its end."""
    ids = context or [EOT_ID]
    return ids[-max(1, n_positions - max_new_tokens) :]


def generate_until(backend: Backend, prompts: list[list[int]], settings: SamplingSettings,
                   stop: Sequence[str] = ()) -> list[str]:
    """Text after each prompt (one left-padded batch), each row ended at EOS, its budget, or its first stop string
    (cancelled with Finish.stop, the text cut before it)."""
    if settings.num_beams > 1:
        raise UsageError("beam search does not stop at stop strings; generate_until decodes greedily or samples")
    sampler = Sampler(settings)  # one seeded stream for the batch, as generate() draws
    seqs = [decoding.Sequence(p, settings, sampler=sampler) for p in prompts]
    streams = [StreamDecoder() for _ in prompts]
    texts = ["" for _ in prompts]
    for event in decoding.decode(backend, seqs):
        if event.token is None:
            continue
        texts[event.row] += streams[event.row].push(event.token)
        if any(s and s in texts[event.row] for s in stop):
            seqs[event.row].cancel(Finish.stop)
    return [cut_at_stop(decode(s.tokens), stop) for s in seqs]
