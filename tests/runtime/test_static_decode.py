"""StaticDecoder on the CPU provider (its CUDA graph: tests/runtime/test_cuda.py): the fixed-capacity cache and the
fixed-shape decode graph against the PyTorch model's greedy generation, and its refusals."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from gpt2x.choices import Precision, ProviderKind
from gpt2x.errors import ProviderError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx import names as io
from gpt2x.onnx.optimize import static_forms
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.runtime.static_decode import StaticDecoder


@pytest.fixture(scope="module")
def tiny(tiny_export):
    model, _, info = tiny_export(Precision.fp32)
    return model, info


def torch_greedy(model, prompts: np.ndarray, n: int) -> np.ndarray:
    """Each row's greedy continuation by the PyTorch model (gpt2x's generate on token ids, EOS not stopping)."""
    settings = SamplingSettings(max_new_tokens=n, greedy=True, ignore_eos=True)
    return np.array([r.tokens for r in generate(TorchBackend(model), [""] * len(prompts), settings, prompt_ids=prompts.tolist())])


def test_fixed_cache_tokens_equal_torch(tiny):
    model, info = tiny
    prompts = np.random.default_rng(3).integers(0, info.config.vocab_size, (3, 7))
    want = torch_greedy(model, prompts, 20)
    decoder = StaticDecoder(info, ProviderKind.cpu, rows=3, capacity=32)
    np.testing.assert_array_equal(decoder.generate(prompts, 20), want)
    # A second prompt overwrites the cache: nothing of the first one's positions is read.
    others = np.random.default_rng(4).integers(0, info.config.vocab_size, (3, 11))
    np.testing.assert_array_equal(decoder.generate(others, 20), torch_greedy(model, others, 20))
    assert decoder.length == 11 + 19


@pytest.mark.parametrize("block", [1, 3, 16])
def test_blocks_of_steps_with_the_host_off_their_path_equal_torch(tiny, block):
    """StaticDecoder.steps: blocks of `block` steps, the positions and tokens advanced by the graph alone between the
    host's writes (one a block), give PyTorch's greedy tokens; a block read with steps() and the one-step step() mix;
    a block past the capacity, or longer than the decoder's, is refused."""
    model, info = tiny
    prompts = np.random.default_rng(7).integers(0, info.config.vocab_size, (2, 5))
    want = torch_greedy(model, prompts, 24)
    decoder = StaticDecoder(info, ProviderKind.cpu, rows=2, capacity=32, block=block)
    np.testing.assert_array_equal(decoder.generate(prompts, 24), want)
    got = [decoder.prefill(prompts)[:, None], decoder.steps(min(2, block)), decoder.step()[:, None]]
    got.append(decoder.steps(block))
    np.testing.assert_array_equal(np.concatenate(got, axis=1), want[:, : 2 + min(2, block) + block])
    assert decoder.length == 5 + 1 + min(2, block) + block
    with pytest.raises(ValueError, match=f"a block runs 1..{block} steps"):
        decoder.steps(block + 1)
    decoder.prefill(np.ones((2, 31), np.int64))
    if block > 1:  # 2 steps would write position 32 of 0..31
        with pytest.raises(ValueError, match="the cache is full"):
            decoder.steps(2)
    decoder.steps(1)
    with pytest.raises(ValueError, match="the cache is full"):
        decoder.steps(1)


def test_decode_graph_has_fixed_io(tiny):
    _, info = tiny
    graph = onnx.load_from_string(static_forms(info.model_path)[1].graph).graph
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert io.ATTENTION_MASK not in inputs and io.LOGITS_TO_KEEP not in inputs
    assert inputs[io.INPUT_IDS] == [io.BATCH, 1] and inputs[io.SEQLENS_K] == [io.BATCH]
    assert [o.name for o in graph.output][0] == io.NEXT_TOKEN and io.LOGITS not in [o.name for o in graph.output]
    assert all(len(n.input) <= 10 for n in graph.node if n.op_type == "GroupQueryAttention")  # no attention bias
    # Without the host's steps I/O unless asked (SlotDecoder's); with it, each written output has its input's shape.
    assert io.STEP not in inputs
    graph = onnx.load_from_string(static_forms(info.model_path, steps=True)[1].graph).graph
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    outputs = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim] for o in graph.output}
    for read, written in ((io.STEP, io.STEP_NEXT), (io.TOKENS, io.TOKENS_NEXT), (io.SEQLENS_K, io.SEQLENS_K_NEXT)):
        assert inputs[read] == outputs[written]


def test_refusals(tiny, tiny_export):
    _, info = tiny
    with pytest.raises(ProviderError, match="CUDA graph needs the cuda provider"):
        StaticDecoder(info, ProviderKind.cpu, cuda_graph=True)
    with pytest.raises(ValueError, match="capacity must be"):
        StaticDecoder(info, ProviderKind.cpu, capacity=info.config.n_positions + 1)
    decoder = StaticDecoder(info, ProviderKind.cpu, rows=2, capacity=8)
    with pytest.raises(ValueError, match="prefill a prompt first"):
        decoder.step(np.array([1, 2]))
    with pytest.raises(ValueError, match="prompts must be 2 rows"):
        decoder.prefill(np.ones((1, 3), np.int64))
    with pytest.raises(ValueError, match="do not fit 8 positions"):
        decoder.generate(np.ones((2, 5), np.int64), 4)
    decoder.generate(np.ones((2, 5), np.int64), 3)
    decoder.step(np.array([1, 2]))
    with pytest.raises(ValueError, match="the cache is full"):
        decoder.step(np.array([1, 2]))
    fp16 = tiny_export(Precision.fp16, gated=False)[2]
    with pytest.raises(ProviderError):
        StaticDecoder(fp16, ProviderKind.cpu)
    int8 = tiny_export(Precision.int8)[2]
    with pytest.raises(ProviderError, match="on cpu needs an fp32 export .* not int8"):
        StaticDecoder(int8, ProviderKind.cpu)
