"""Backend-agnostic generation: left-padded batches, a seeded sampler, greedy and beam search.

A backend only has to run one forward step on numpy arrays and hand back the last position's
logits; sampling happens here, in numpy with one seeded generator, so that every backend produces
the same tokens for the same seed wherever their logits agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .errors import UsageError
from .tokenizer import EOT_ID, encode


class Backend(Protocol):
    """One forward step. Arrays are int64 numpy; `past` is whatever the backend keeps (None at first)."""

    n_positions: int  # the model's context length
    name: str

    def step(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Any
    ) -> tuple[np.ndarray, Any]:
        """input_ids (B, T), attention_mask (B, P+T), position_ids (B, T) -> last logits (B, V) float32, new past."""
        ...

    def reorder(self, past: Any, rows: np.ndarray) -> Any:
        """The cache with its batch rows gathered by `rows` (beam search)."""
        ...


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 64  # tokens to generate per prompt (fewer if EOS or the context ends first)
    greedy: bool = False  # argmax decoding; ignores temperature/top-k/top-p
    temperature: float = 1.0  # logits are divided by this before sampling; > 0
    top_k: int = 0  # keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus: keep the smallest set whose probability reaches top_p; in (0, 1]
    seed: int = 0  # seeds the sampler; same seed, same logits -> same tokens
    num_beams: int = 1  # beam search when > 1 (deterministic)
    length_penalty: float = 1.0  # beam score = sum logprob / length ** length_penalty (transformers' definition)
    early_stopping: bool = False  # beam search stops as soon as num_beams hypotheses are finished

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise UsageError(f"--temperature must be > 0, got {self.temperature} (use --greedy for argmax)")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.num_beams < 1:
            raise UsageError(f"--num-beams must be at least 1, got {self.num_beams}")


@dataclass
class Generation:
    prompt: str
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids, without the final EOS
    finish_reason: str = "length"  # "eos", "length" (max_new_tokens) or "context" (model context full)


class Sampler:
    """Turns last-position logits into next tokens with one seeded numpy generator."""

    def __init__(self, settings: SamplingSettings):
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Filtered, renormalised next-token distributions (B, V) in float64."""
        x = logits.astype(np.float64) / self.s.temperature
        if self.s.top_k and self.s.top_k < x.shape[-1]:
            kth = np.partition(x, -self.s.top_k, axis=-1)[:, -self.s.top_k][:, None]
            x = np.where(x < kth, -np.inf, x)
        x = x - x.max(axis=-1, keepdims=True)
        p = np.exp(x)
        p /= p.sum(axis=-1, keepdims=True)
        if self.s.top_p < 1.0:
            order = np.argsort(-p, axis=-1, kind="stable")
            sorted_p = np.take_along_axis(p, order, axis=-1)
            before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
            keep_sorted = before < self.s.top_p  # always keeps the most likely token
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order, keep_sorted, axis=-1)
            p = np.where(keep, p, 0.0)
            p /= p.sum(axis=-1, keepdims=True)
        return p

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        if self.s.greedy:
            return logits.argmax(axis=-1).astype(np.int64)
        p = self.probabilities(logits)
        u = self.rng.random(p.shape[0])[:, None]  # one uniform per row, consumed in row order
        cdf = np.cumsum(p, axis=-1)
        return np.minimum((cdf < u * cdf[:, -1:]).sum(axis=-1), p.shape[-1] - 1).astype(np.int64)


def prepare_prompts(prompts: list[str], n_positions: int, max_new_tokens: int, truncate: bool) -> list[list[int]]:
    """Token ids per prompt. An empty prompt starts from <|endoftext|>, as GPT-2 starts a document."""
    out = []
    for text in prompts:
        ids = encode(text) or [EOT_ID]
        if len(ids) >= n_positions:
            if not truncate:
                raise UsageError(
                    f"prompt is {len(ids)} tokens; the model's context is {n_positions} "
                    "(shorten it, or pass --truncate to keep its end)"
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


def positions(mask: np.ndarray, seq_len: int) -> np.ndarray:
    """Position ids of the last seq_len slots: real tokens before each (cumsum - 1), pads at 0."""
    return np.maximum(np.cumsum(mask, axis=-1) - 1, 0)[:, -seq_len:].astype(np.int64)


OnToken = Callable[[int, int], None]  # (row, token id), called as each token is produced


def generate(
    backend: Backend,
    prompts: list[str],
    settings: SamplingSettings,
    truncate: bool = False,
    on_token: OnToken | None = None,
    prompt_ids: list[list[int]] | None = None,
) -> list[Generation]:
    """Generate for all prompts as one left-padded batch. Stops each row at EOS; all rows at
    max_new_tokens or at the model's context limit."""
    if not prompts and not prompt_ids:
        raise UsageError("no prompts given")
    if prompt_ids is None:
        prompt_ids = prepare_prompts(prompts, backend.n_positions, settings.max_new_tokens, truncate)
    if settings.num_beams > 1:
        from .beam import beam_search

        return [beam_search(backend, p, ids, settings) for p, ids in zip(prompts, prompt_ids)]
    results = [Generation(p, ids) for p, ids in zip(prompts, prompt_ids)]
    ids, mask = left_pad(prompt_ids)
    room = backend.n_positions - ids.shape[1]
    n_new = min(settings.max_new_tokens, room)
    sampler = Sampler(settings)
    done = np.zeros(len(results), dtype=bool)
    logits, past = backend.step(ids, mask, positions(mask, ids.shape[1]), None)
    for step in range(n_new):
        nxt = sampler(logits)
        for row, tok in enumerate(nxt.tolist()):
            if done[row]:
                continue
            if tok == EOT_ID:
                done[row] = True
                results[row].finish_reason = "eos"
                continue
            results[row].tokens.append(tok)
            if on_token:
                on_token(row, tok)
        if done.all() or step == n_new - 1:
            break
        mask = np.concatenate([mask, np.ones((len(results), 1), dtype=np.int64)], axis=1)
        logits, past = backend.step(nxt[:, None], mask, positions(mask, 1), past)
    for r in results:
        if r.finish_reason != "eos" and n_new < settings.max_new_tokens and len(r.tokens) == n_new:
            r.finish_reason = "context"
    return results
