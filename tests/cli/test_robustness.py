"""Interrupts, long runs and memory: Ctrl-C keeps what was streamed, generation to the context limit
works, and 300 generations in one process do not grow its memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpt2x.choices import Precision
from gpt2x.errors import INTERRUPTED_EXIT_CODE
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.model.weights import load_model
from gpt2x.runtime.ort import OrtBackend
from gpt2x.tokenizer import EOT_ID

from ..helpers import cli


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_ctrl_c_during_generation_keeps_streamed_text(capsys, monkeypatch):
    from gpt2x.runtime.pytorch import TorchBackend

    real = TorchBackend.step
    calls = {"n": 0}

    def interrupt_on_sixth(self, *args):
        calls["n"] += 1  # the prefill, then one step per token: the sixth comes after five tokens
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(TorchBackend, "step", interrupt_on_sixth)
    code, out, err = cli(capsys, "generate", "ROMEO:", "--backend", "torch", "--seed", "3", "--max-new-tokens", "50")
    assert code == INTERRUPTED_EXIT_CODE and "interrupted" in err and "Traceback" not in err

    monkeypatch.setattr(TorchBackend, "step", real)
    [r] = generate(TorchBackend(load_model("shakespeare")[0]), ["ROMEO:"], SamplingSettings(max_new_tokens=5, seed=3))  # the CLI's defaults: top-k off
    from gpt2x.tokenizer import decode

    assert out == "ROMEO:" + decode(r.tokens)  # exactly the five tokens streamed before Ctrl-C


@pytest.fixture(scope="module")
def bundled_ort(bundled_export):
    return OrtBackend(bundled_export(Precision.fp32))


class NoEndOfText:
    """A backend whose next-token logits never let end of text be drawn (its logit -inf), so that a run
    can end only at the context or its token budget; the rest is the wrapped backend's."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def step(self, *args):
        logits, present = self.backend.step(*args)
        logits = np.array(logits, copy=True)
        logits[:, EOT_ID] = -np.inf
        return logits, present


def test_generation_up_to_the_context_limit(bundled_ort):
    [r] = generate(NoEndOfText(bundled_ort), ["ROMEO:"], SamplingSettings(max_new_tokens=1000, seed=1, top_k=0))
    assert r.finish_reason == "context" and EOT_ID not in r.tokens
    assert len(r.prompt_tokens) + len(r.tokens) == bundled_ort.n_positions


def test_soak_300_generations_memory_is_flat(bundled_ort):
    # Short generations: a leak per generation (a session's buffers, a cache left behind) shows as well in 8 tokens
    # as in 24, at a third of the suite's time.
    s = SamplingSettings(max_new_tokens=8, seed=0)
    for i in range(30):  # warm-up: allocator pools and caches settle
        generate(bundled_ort, ["ROMEO:", "JULIET:"], SamplingSettings(max_new_tokens=8, seed=i))
    before = rss_mb()
    for i in range(300):
        generate(bundled_ort, ["ROMEO:", "JULIET:"], SamplingSettings(max_new_tokens=8, seed=i, top_k=s.top_k))
    growth = rss_mb() / before - 1
    assert growth < 0.05, f"RSS grew {growth:.1%} over 300 generations"
