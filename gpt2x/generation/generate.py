"""Backend-agnostic generation: prompts to token ids, greedy and sampled generation over the one
decode loop (decode.py; left_pad is there too), speculative generation with a draft (the same loop),
beam search (beam.py).

A backend only has to run forward steps on numpy arrays (gpt2x.runtime.base.Backend); sampling
happens here, so every backend produces the same tokens for the same seed wherever its logits agree.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import UsageError
from ..runtime.base import Backend
from ..tokenizer import EOT_ID, encode
from .beam import beam_search
from .decode import Sequence, decode, left_pad
from .sampling import Sampler
from .settings import Generation, OnToken, SamplingSettings
from .speculative import Drafter, DraftSettings, SpecStats
from .static_decoding import fixed_refusal, generate_fixed

__all__ = ["OnToken", "fixed_cache_refusal", "generate", "generate_speculative", "left_pad", "most_step_tokens",
           "prepare_prompts"]


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


def most_step_tokens(prompts: list[str], settings: SamplingSettings, draft_settings: DraftSettings | None = None) -> int:
    """At most how many new tokens (rows x tokens) one multi-token step of `generate` on `prompts` runs: the batch's
    prefill, or with a draft (`draft_settings`) a verification step; a backend asked before it opens (its
    prefill_tokens) prepares only what such steps run on."""
    rows = len(prompts) * max(settings.n, settings.num_beams)
    longest = max(len(encode(text)) or 1 for text in prompts)
    verify = 0 if draft_settings is None else rows * (draft_settings.num_speculative_tokens + 1)
    return max(rows * longest, verify)


def generate(
    backend: Backend,
    prompts: list[str],
    settings: SamplingSettings,
    truncate: bool = False,
    on_token: OnToken | None = None,
    prompt_ids: list[list[int]] | None = None,
    draft: Drafter | None = None,
    draft_settings: DraftSettings | None = None,
    fixed_cache: bool | None = False,
) -> list[Generation]:
    """Generate for all prompts as one left-padded batch (decode.decode). Stops each row at EOS (unless
    settings.ignore_eos) or a stop token id; all rows at max_new_tokens or at the model's context
    limit. With a `draft`, each prompt is decoded on its own, speculatively (speculative.py).

    With settings.n > 1, n samples per prompt, returned prompt by prompt (prompt 0's n samples, then
    prompt 1's, ...; `on_token`'s row counts them so): sample i of every prompt is what the batch
    gives alone with seed + i (vLLM's rule for n's seeds), so sample 0 is what n = 1 gives, and one
    prompt's samples are the API's n choices for it.

    `fixed_cache`: on the backend's fixed-capacity decoder (static_decoding.generate_fixed; the same tokens
    wherever the logits agree) where it has one and the generation allows (fixed_refusal); True requires it (a
    UsageError says why not), None takes it where it can, False never."""
    if not prompts and not prompt_ids:
        raise UsageError("no prompts given")
    if prompt_ids is None:
        prompt_ids = prepare_prompts(prompts, backend.n_positions, settings.max_new_tokens, truncate)
    if fixed_cache is not False:
        why = fixed_cache_refusal(backend, settings, prompt_ids, draft is not None)
        if why is None:
            return generate_fixed(backend, prompts or [""] * len(prompt_ids), prompt_ids, settings, on_token)
        if fixed_cache:
            raise UsageError(f"kv_cache fixed: {why}", option="kv_cache")
    children = [replace(settings, seed=settings.seed + i, n=1) for i in range(settings.n)]  # sample i: seed + i
    if draft is not None:
        if settings.num_beams > 1:
            raise UsageError("beam search and a draft do not combine: speculative decoding samples or decodes greedily")
        return _drafted(backend, prompts, prompt_ids, children, draft, draft_settings or DraftSettings(), on_token)
    if settings.num_beams > 1:
        return [beam_search(backend, p, ids, settings) for p, ids in zip(prompts, prompt_ids)]
    return _batched(backend, prompts, prompt_ids, children, on_token)


def fixed_cache_refusal(backend: Backend, settings: SamplingSettings, prompt_ids: list[list[int]],
                        drafted: bool = False) -> str | None:
    """Why `generate` would not run on `backend`'s fixed-capacity decoder, or None."""
    if not backend.capabilities.decodes_fixed:
        return f"the {backend.name} backend keeps its own cache"
    return backend.fixed_refusal() or fixed_refusal(settings, prompt_ids, drafted)


def _batched(backend: Backend, prompts: list[str], prompt_ids: list[list[int]], children: list[SamplingSettings],
             on_token: OnToken | None) -> list[Generation]:
    """Every prompt's samples (`children`, sample i's settings) as one batch, prompt by prompt."""
    n = len(children)
    samplers = [Sampler(child) for child in children]  # one seeded stream per sample, drawn row by row at each step
    seqs = [Sequence(ids, children[i], sampler=samplers[i]) for _, ids in zip(prompts, prompt_ids) for i in range(n)]
    for event in decode(backend, seqs):
        if on_token and event.token is not None:
            on_token(event.row, event.token)
    return [s.result(p) for p, s in zip([p for p in prompts for _ in range(n)], seqs)]


def _drafted(backend: Backend, prompts: list[str], prompt_ids: list[list[int]], children: list[SamplingSettings],
             draft: Drafter, draft_settings: DraftSettings, on_token: OnToken | None) -> list[Generation]:
    """Every prompt's samples decoded one at a time with the draft, prompt by prompt."""
    n = len(children)
    return [generate_speculative(backend, draft, p, ids, children[i], draft_settings, row * n + i, on_token)
            for row, (p, ids) in enumerate(zip(prompts, prompt_ids)) for i in range(n)]


def generate_speculative(backend: Backend, draft: Drafter, prompt: str, prompt_ids: list[int], settings: SamplingSettings,
                         draft_settings: DraftSettings | None = None, row: int = 0,
                         on_token: OnToken | None = None) -> Generation:
    """One prompt decoded with a draft (batch 1): the tokens the target alone would give (greedy), or a
    sample from the target's distribution (speculative sampling), with the run's draft statistics."""
    seq = Sequence(prompt_ids, settings)
    for event in decode(backend, [seq], draft, draft_settings):
        if on_token and event.token is not None:
            on_token(row, event.token)
    result = seq.result(prompt)
    result.speculation = seq.speculation.to_dict() if seq.speculation else SpecStats().to_dict()
    return result
