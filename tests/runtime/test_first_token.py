"""The first request of a fresh ONNX Runtime backend (benchmarks/first_token.py measures its time)
gives the tokens every later one gives: nothing a first run does (ONNX Runtime's first run, fresh
in-place KV buffers whose values are left unset) shows in the output."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2x.choices import Precision
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.runtime.ort import OrtBackend


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
def test_a_fresh_backends_first_request_gives_the_later_ones_tokens(bundled_export, precision):
    backend = OrtBackend(bundled_export(precision), threads=1)
    ids = np.random.default_rng(0).integers(0, backend.vocab_size, 12).tolist()
    settings = SamplingSettings(greedy=True, max_new_tokens=6, ignore_eos=True)
    first = generate(backend, [""], settings, prompt_ids=[ids])[0].tokens
    for _ in range(2):
        assert generate(backend, [""], settings, prompt_ids=[ids])[0].tokens == first
