"""Beam search over any Backend, with the semantics of transformers' `generate(num_beams=N, do_sample=False)`,
step for step (the steps: docs/commands/generate.md, beam search). Ties go to the lower flat index."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..numerics import log_softmax
from ..runtime.base import Backend
from ..tokenizer import EOT_ID
from .settings import Finish, Generation, SamplingSettings

NEG = np.float32(-1.0e9)  # transformers' "impossible" score, added to masked entries


@dataclass
class Candidates:
    """The 2N best continuations of one step, best first."""

    rows: np.ndarray  # (2N,) int64 running-beam row each continues
    tokens: np.ndarray  # (2N,) int64 token appended
    scores: np.ndarray  # (2N,) float32 summed log-probabilities
    seqs: list[list[int]]  # generated ids of each, including the new token


@dataclass
class Finished:
    """N slots of finished hypotheses, best first; empty slots hold score NEG and done False."""

    scores: np.ndarray  # (N,) float32 length-penalised scores
    done: np.ndarray  # (N,) bool
    seqs: list[list[int]]


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of the 1-D array x, best first; equal values keep index order."""
    if k >= x.size:
        return np.argsort(-x, kind="stable")
    threshold = np.partition(x, x.size - k)[x.size - k]
    idx = np.flatnonzero(x >= threshold)  # every entry that can be in the top k, ties included
    return idx[np.argsort(-x[idx], kind="stable")[:k]]


def best_continuations(logits: np.ndarray, run_scores: np.ndarray, run_seqs: list[list[int]]) -> Candidates:
    """The 2N best (beam, token) continuations of the N running beams."""
    n, vocab = logits.shape
    total = (log_softmax(logits).astype(np.float32) + run_scores[:, None]).reshape(-1)  # (N * V,)
    flat = top_k(total, 2 * n)  # (2N,)
    rows, tokens = flat // vocab, flat % vocab
    seqs = [run_seqs[r] + [t] for r, t in zip(rows.tolist(), tokens.tolist())]
    return Candidates(rows.astype(np.int64), tokens.astype(np.int64), total[flat], seqs)


def offer_finished(fin: Finished, cand: Candidates, hits: np.ndarray, gen_len: int, length_penalty: float) -> Finished:
    """Finished slots after offering this step's stopped continuations (transformers' _update_finished_beams;
    its "slots full" and "no improvement" masks never apply here, as the loop has stopped by then)."""
    n = fin.scores.size
    eligible = hits & (np.arange(hits.size) < n)  # only the first N continuations may finish
    scores = np.where(eligible, cand.scores / np.float32(gen_len**length_penalty), NEG).astype(np.float32)
    merged = np.concatenate([fin.scores, scores])  # (3N,)
    keep = top_k(merged, n)  # old slots come first among equals
    pool = fin.seqs + cand.seqs
    return Finished(merged[keep], np.concatenate([fin.done, eligible])[keep], [pool[i] for i in keep.tolist()])


def still_improvable(best_running: np.float32, fin: Finished, gen_len: int, length_penalty: float) -> bool:
    """transformers' _check_early_stop_heuristic: can the best running beam, scored at the current
    length, still beat the worst finished hypothesis? True while any slot is empty."""
    best = best_running / np.float32(gen_len**length_penalty)
    worst = np.where(fin.done, fin.scores.min(), NEG)  # (N,) empty slots count as NEG
    return bool((best > worst).any())


def result(prompt: str, prompt_ids: list[int], fin: Finished, cut_by_context: bool) -> Generation:
    seq = fin.seqs[0]
    if seq and seq[-1] == EOT_ID:
        return Generation(prompt, list(prompt_ids), seq[:-1], Finish.eos)
    return Generation(prompt, list(prompt_ids), seq, Finish.context if cut_by_context else Finish.length)


def beam_search(backend: Backend, prompt: str, prompt_ids: list[int], settings: SamplingSettings) -> Generation:
    """The best of settings.num_beams beams for one prompt; stops at EOS, max_new_tokens or the model's context."""
    n_new = min(settings.max_new_tokens, backend.n_positions - len(prompt_ids))  # never past the context
    if n_new < 1:
        return Generation(prompt, list(prompt_ids), [], Finish.context)
    return result(prompt, prompt_ids, _search(backend, prompt_ids, settings, n_new), n_new < settings.max_new_tokens)


def beam_hypotheses(backend: Backend, prompt_ids: list[int], settings: SamplingSettings,
                    k: int) -> list[tuple[list[int], Finish]]:
    """The k best finished hypotheses, best first, each without its end-of-text and with why it ended
    (vLLM's use_beam_search answers its n best)."""
    n_new = min(settings.max_new_tokens, backend.n_positions - len(prompt_ids))
    if n_new < 1:
        return [([], Finish.context)] * k
    fin = _search(backend, prompt_ids, settings, n_new)
    cut = Finish.context if n_new < settings.max_new_tokens else Finish.length
    return [(seq[:-1], Finish.eos) if seq and seq[-1] == EOT_ID else (seq, cut)
            for seq, done in zip(fin.seqs[:k], fin.done[:k]) if done or seq]


def _search(backend: Backend, prompt_ids: list[int], settings: SamplingSettings, n_new: int) -> Finished:
    """The finished slots, best first."""
    n, p_len = settings.num_beams, len(prompt_ids)

    ids = np.asarray([prompt_ids], dtype=np.int64)  # (1, P)
    logits, past = backend.step(ids, np.ones_like(ids), np.arange(p_len, dtype=np.int64)[None], None)
    logits = np.repeat(logits, n, axis=0)  # (N, V): N identical beams ...
    past = past.reorder(np.zeros(n, dtype=np.int64))  # ... sharing the prompt's cache
    run_scores = np.full(n, NEG, dtype=np.float32)  # (N,) only beam 0 may start, so beams differ
    run_scores[0] = 0.0
    run_seqs: list[list[int]] = [[] for _ in range(n)]
    fin = Finished(np.full(n, NEG, dtype=np.float32), np.zeros(n, dtype=bool), [[] for _ in range(n)])

    for step in range(n_new):
        gen_len = step + 1  # generated tokens once this step's token is appended
        cand = best_continuations(logits, run_scores, run_seqs)
        hits = (cand.tokens == EOT_ID) | (gen_len == n_new)  # (2N,)
        live = np.where(hits, cand.scores + NEG, cand.scores).astype(np.float32)
        pick = top_k(live, n)  # (N,) best continuations that go on
        fin = offer_finished(fin, cand, hits, gen_len, settings.length_penalty)
        run_scores, run_seqs = live[pick], [cand.seqs[i] for i in pick.tolist()]
        improvable = still_improvable(run_scores[0], fin, gen_len, settings.length_penalty)
        all_full = settings.early_stopping and fin.done.all()
        if hits.all() or all_full or not improvable:
            break
        past = past.reorder(cand.rows[pick])
        mask = np.ones((n, p_len + gen_len), dtype=np.int64)  # (N, P + t)
        pos = np.full((n, 1), p_len + gen_len - 1, dtype=np.int64)  # (N, 1)
        logits, past = backend.step(cand.tokens[pick][:, None], mask, pos, past)
    return fin
