"""Backend-agnostic generation: prompts to token ids, left-padded batches, the decode loop, greedy and
sampled generation (beam search is beam.py).

A backend only has to run forward steps on numpy arrays (gpt2x.runtime.base.Backend); sampling
happens here, so every backend produces the same tokens for the same seed wherever its logits agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..errors import UsageError
from ..numerics import positions
from ..runtime.base import Backend, greedy_step
from ..tokenizer import EOT_ID, encode
from .beam import beam_search
from .sampling import Sampler
from .settings import Finish, Generation, SamplingSettings
from .speculative import Drafter, DraftSettings, SpecStats, control_for, speculative_loop


def prepare_prompts(prompts: list[str], n_positions: int, max_new_tokens: int, truncate: bool) -> list[list[int]]:
    """Token ids per prompt. An empty prompt starts from <|endoftext|>, as GPT-2 starts a document.
    A prompt that fills the context is an error unless `truncate`, which keeps its end."""
    out = []
    for text in prompts:
        ids = encode(text) or [EOT_ID]
        if len(ids) >= n_positions and not truncate:
            raise UsageError(
                f"prompt is {len(ids)} tokens; the model's context is {n_positions} "
                "(shorten it, or truncate it to keep its end)"
            )
        if truncate:
            keep = max(1, n_positions - max_new_tokens)
            ids = ids[-keep:]
        out.append(ids)
    return out


def left_pad(batch: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ids and attention mask (B, L), padded on the left with EOS ids and mask 0."""
    width = max(len(r) for r in batch)
    ids = np.full((len(batch), width), EOT_ID, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for i, r in enumerate(batch):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def decode_loop(backend: Backend, ids: np.ndarray, mask: np.ndarray, sampler: Sampler, n_new: int) -> Iterator[np.ndarray]:
    """The decode loop every caller shares (generation and the bench): prefill the prompt batch
    (B, L) with its mask, then yield each step's next tokens (B,) int64, at most `n_new` times.
    Stopping early is the caller's: leave the loop (the generator is then closed). Greedy sampling
    takes the backend's own argmax where it has one (base.greedy_step: the same tokens)."""
    if sampler.s.greedy:
        step = greedy_step(backend)
        nxt, past = step(ids, mask, positions(mask, ids.shape[1]), None)
        for i in range(n_new):
            yield nxt
            if i == n_new - 1:
                return
            mask = np.concatenate([mask, np.ones((len(nxt), 1), dtype=np.int64)], axis=1)
            nxt, past = step(nxt[:, None], mask, positions(mask, 1), past)
        return
    logits, past = backend.step(ids, mask, positions(mask, ids.shape[1]), None)
    for i in range(n_new):
        nxt = sampler(logits)
        yield nxt
        if i == n_new - 1:
            return
        mask = np.concatenate([mask, np.ones((len(nxt), 1), dtype=np.int64)], axis=1)
        logits, past = backend.step(nxt[:, None], mask, positions(mask, 1), past)


OnToken = Callable[[int, int], None]  # (row, token id), called as each token is produced


def generate(
    backend: Backend,
    prompts: list[str],
    settings: SamplingSettings,
    truncate: bool = False,
    on_token: OnToken | None = None,
    prompt_ids: list[list[int]] | None = None,
    draft: Drafter | None = None,
    draft_settings: DraftSettings | None = None,
) -> list[Generation]:
    """Generate for all prompts as one left-padded batch. Stops each row at EOS; all rows at
    max_new_tokens or at the model's context limit. With a `draft`, each prompt is decoded on its
    own, speculatively (speculative.py)."""
    if not prompts and not prompt_ids:
        raise UsageError("no prompts given")
    if prompt_ids is None:
        prompt_ids = prepare_prompts(prompts, backend.n_positions, settings.max_new_tokens, truncate)
    if draft is not None:
        if settings.num_beams > 1:
            raise UsageError("beam search and a draft do not combine: speculative decoding samples or decodes greedily")
        return [generate_speculative(backend, draft, p, ids, settings, draft_settings or DraftSettings(), row, on_token)
                for row, (p, ids) in enumerate(zip(prompts, prompt_ids))]
    if settings.num_beams > 1:
        return [beam_search(backend, p, ids, settings) for p, ids in zip(prompts, prompt_ids)]
    results = [Generation(p, ids) for p, ids in zip(prompts, prompt_ids)]
    ids, mask = left_pad(prompt_ids)
    n_new = min(settings.max_new_tokens, backend.n_positions - ids.shape[1])
    done = np.zeros(len(results), dtype=bool)
    for nxt in decode_loop(backend, ids, mask, Sampler(settings), n_new):
        for row, tok in enumerate(nxt.tolist()):
            if done[row]:
                continue
            if tok == EOT_ID:
                done[row] = True
                results[row].finish_reason = Finish.eos
                continue
            results[row].tokens.append(tok)
            if on_token:
                on_token(row, tok)
        if done.all():
            break
    for r in results:
        if r.finish_reason is not Finish.eos and n_new < settings.max_new_tokens and len(r.tokens) == n_new:
            r.finish_reason = Finish.context
    return results


def generate_speculative(backend: Backend, draft: Drafter, prompt: str, prompt_ids: list[int], settings: SamplingSettings,
                         draft_settings: DraftSettings | None = None, row: int = 0,
                         on_token: OnToken | None = None) -> Generation:
    """One prompt decoded with a draft (batch 1): the tokens the target alone would give (greedy), or a
    sample from the target's distribution (speculative sampling), with the run's draft statistics."""
    result = Generation(prompt, prompt_ids)
    n_new = min(settings.max_new_tokens, backend.n_positions - len(prompt_ids))
    stats = SpecStats()
    loop = speculative_loop(backend, draft, prompt_ids, Sampler(settings), n_new,
                            control_for(draft_settings or DraftSettings()), stats)
    for chunk in loop:
        for tok in chunk:
            if tok == EOT_ID:
                result.finish_reason = Finish.eos
                break
            result.tokens.append(tok)
            if on_token:
                on_token(row, tok)
        if result.finish_reason is Finish.eos:
            loop.close()
            break
    if result.finish_reason is not Finish.eos and n_new < settings.max_new_tokens and len(result.tokens) == n_new:
        result.finish_reason = Finish.context
    result.speculation = stats.to_dict()
    return result
