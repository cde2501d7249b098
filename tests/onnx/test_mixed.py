"""The mixed step's graph (onnx/mixed.py): decode rows and one joiner's chunk in one forward must give the logits
and presents of the two separate forwards, and PyTorch's no-cache forward's logits."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gpt2x.choices import Precision, ProviderKind
from gpt2x.numerics import positions
from gpt2x.onnx import names as io
from gpt2x.onnx.mixed import mixed_graph
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.providers import create_session

# Decode rows: a prefill of 5 (row 1 left-padded by 2), then one token each; the chunk: 6 tokens on a past of 4.
PREFILL = np.array([[11, 12, 13, 14, 15], [0, 0, 21, 22, 23], [31, 32, 33, 34, 35]])
PREFILL_MASK = np.array([[1] * 5, [0, 0, 1, 1, 1], [1] * 5])
DECODE = np.array([[16], [24], [36]])
CHUNK_PAST, CHUNK = np.array([[41, 42, 43, 44]]), np.array([[45, 46, 47, 48, 49, 50]])


@pytest.fixture(scope="module", params=["fp32-gqa", "int8"])
def exported(request, tiny_export):
    if request.param == "int8":  # the OpenVINO prefill's int8 export: made for other tests already; same decode graph
        model, _, info = tiny_export(Precision.int8, openvino_prefill=True)
    else:
        model, _, info = tiny_export(gqa=True)
    return request.param, model, info


def prefilled(backend: OrtBackend, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    return backend.run(ids, mask, positions(mask, ids.shape[1]), None)[1].to_numpy()


def test_mixed_step_equals_the_separate_forwards_and_pytorch(exported):
    kind, model, info = exported
    backend = OrtBackend(info, prefill="onnxruntime", threads=1)
    decode_past = prefilled(backend, PREFILL, PREFILL_MASK)
    chunk_past = prefilled(backend, CHUNK_PAST, np.ones_like(CHUNK_PAST))
    decode_mask = np.concatenate([PREFILL_MASK, np.ones_like(DECODE)], axis=1)
    chunk_mask = np.ones((1, CHUNK_PAST.shape[1] + CHUNK.shape[1]), np.int64)
    streams = ((DECODE, decode_mask, decode_past, ""), (CHUNK, chunk_mask, chunk_past, io.CHUNK_PREFIX))

    # the two separate forwards
    separate = [backend.run(ids, mask, positions(mask, ids.shape[1]), backend.past_from_numpy(past))
                for ids, mask, past, _ in streams]

    # the mixed forward, both caches in place (one buffer bound as past and present)
    session = create_session(mixed_graph(onnx.load(str(info.model_path))).SerializeToString(), ProviderKind.cpu, 1)
    binding = session.io_binding()
    binding.bind_output(io.LOGITS, "cpu")
    caches = []
    for ids, mask, past, prefix in streams:
        cache = backend.past_from_numpy(past)
        caches.append(cache)
        binding.bind_cpu_input(prefix + io.INPUT_IDS, ids)
        binding.bind_cpu_input(prefix + io.ATTENTION_MASK, mask.astype(np.int64))
        binding.bind_cpu_input(prefix + io.POSITION_IDS, positions(mask, ids.shape[1]))
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in cache.arrays]
        for past_name, present_name, value in zip(backend.names_in[3:], backend.names_out[1:], values):
            binding.bind_ortvalue_input(prefix + past_name, value)
            binding.bind_ortvalue_output(prefix + present_name, value)
    session.run_with_iobinding(binding)
    logits = binding.get_outputs()[0].numpy()
    B = DECODE.shape[0]
    assert logits.shape == (1, B + 1, info.config.vocab_size)

    tol = 1e-5 if kind == "int8" else 1e-4  # int8: the same kernels on the same rows
    scale = np.abs(separate[0][0]).max()
    assert np.abs(logits[0, :B] - separate[0][0][:, -1]).max() <= tol * scale
    assert np.abs(logits[0, B] - separate[1][0][0, -1]).max() <= tol * scale
    for (_, mask, _, _), (_, want), cache in zip(streams, separate, caches):
        filled = mask.shape[1]
        for a, b in zip(want.to_numpy(), cache.arrays):
            got = b[: a.shape[0], :, :filled]
            real = mask.astype(bool)[:, None, :, None]  # padded positions hold whatever their step wrote
            assert np.abs(np.where(real, a - got, 0)).max() <= tol * max(np.abs(a).max(), 1e-6)

    # PyTorch without a cache, on the whole sequences
    with torch.no_grad():
        full_decode = np.concatenate([PREFILL, DECODE], axis=1)
        ref_decode = model(torch.tensor(full_decode), torch.tensor(decode_mask),
                           torch.tensor(positions(decode_mask, full_decode.shape[1])))[0][:, -1].numpy()
        full_chunk = np.concatenate([CHUNK_PAST, CHUNK], axis=1)
        ref_chunk = model(torch.tensor(full_chunk), torch.tensor(chunk_mask),
                          torch.arange(full_chunk.shape[1])[None])[0][0, -1].numpy()
    ref_tol = 1e-4 if kind == "fp32-gqa" else 0.05  # int8 weights and activations against fp32
    assert np.abs(logits[0, :B] - ref_decode).max() <= ref_tol * np.abs(ref_decode).max()
    assert np.abs(logits[0, B] - ref_chunk).max() <= ref_tol * np.abs(ref_chunk).max()
    assert (logits[0, :B].argmax(-1) == ref_decode.argmax(-1)).all() and logits[0, B].argmax() == ref_chunk.argmax()


def test_a_graph_without_group_query_attention_is_refused(tiny_export):
    _, _, info = tiny_export()
    with pytest.raises(ValueError, match="GroupQueryAttention"):
        mixed_graph(onnx.load(str(info.model_path)))
