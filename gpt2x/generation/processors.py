"""Logits processors: the one ordered list of transforms that turns a step's logits into the scores
the sampler draws from. Every decoding path samples through it (generation.sampling.Sampler: the
decode loop, beam search's sampling-free path aside, speculative decoding's acceptance rule, the
serving engine, the evaluation harness), so a transform added here is applied everywhere.

Each processor maps scores (B, V) float64 to scores (B, V) float64; a token it removes gets -inf.
The order is transformers' and vLLM's: temperature, then top-k, then top-p. A new transform (a
penalty, a logit bias, a grammar's mask) is a class here with its place in `processors_for`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .settings import SamplingSettings


class LogitsProcessor(Protocol):
    def __call__(self, scores: np.ndarray) -> np.ndarray:
        """scores (B, V) float64 -> scores (B, V) float64 (removed tokens: -inf)."""
        ...


class Temperature:
    """Scores divided by the temperature (> 0; 0 is greedy decoding, which samples nothing)."""

    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        return scores / self.temperature


class TopK:
    """Only the k highest scores stay (ties with the k-th stay too)."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        if self.k >= scores.shape[-1]:
            return scores
        kth = np.partition(scores, -self.k, axis=-1)[:, -self.k][:, None]
        return np.where(scores < kth, -np.inf, scores)


class TopP:
    """Nucleus: the smallest set of most likely tokens whose probability reaches p stays (a token stays
    when the mass of the tokens more likely than it is below p; the most likely always stays)."""

    def __init__(self, p: float):
        self.p = p

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        probs = softmax(scores)
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep = np.zeros(scores.shape, dtype=bool)
        np.put_along_axis(keep, order, before < self.p, axis=-1)
        return np.where(keep, scores, -np.inf)


def processors_for(settings: SamplingSettings) -> list[LogitsProcessor]:
    """The ordered list for `settings` (only those that change anything); greedy decoding uses none."""
    if settings.greedy:
        return []
    chain: list[LogitsProcessor] = []
    if settings.temperature != 1.0:
        chain.append(Temperature(settings.temperature))
    if settings.top_k:
        chain.append(TopK(settings.top_k))
    if settings.top_p < 1.0:
        chain.append(TopP(settings.top_p))
    return chain


def softmax(scores: np.ndarray) -> np.ndarray:
    """Row-wise probabilities of scores (B, V) float64; -inf scores get 0."""
    x = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(x)
    return p / p.sum(axis=-1, keepdims=True)
