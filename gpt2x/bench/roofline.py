"""The hardware limit of decoding: a token reads every weight once (and the KV cache), so at batch B the fastest
decode rate is B * bandwidth / (weight bytes + KV bytes), the bandwidth measured (a CPU read, a GPU copy)."""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from ..choices import Precision
from ..model.config import GPT2Config
from ..onnx.artifact import INT4_BLOCK, INT4_HEAD_BITS, INT8_BLOCK


def cpu_read_bandwidth(threads: int, megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a multi-threaded sequential read, best of `repeats`: each thread takes the max of its
    own chunk (numpy's SIMD max streams memory at full speed and releases the GIL). 256 MiB is past the last-level
    cache a core reads (a 96 MiB 3D V-cache die's too); 1 GiB cost a fresh VM 6-7 s to touch for the first time."""
    chunk = megabytes * (1 << 20) // threads // 4
    arrays = [np.ones(chunk, dtype=np.float32) for _ in range(threads)]
    best = 0.0
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)

        def work(a, barrier=barrier):
            barrier.wait()
            a.max()

        pool = [threading.Thread(target=work, args=(a,)) for a in arrays]
        for t in pool:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in pool:
            t.join()
        best = max(best, chunk * 4 * threads / (time.perf_counter() - t0))
    return best


def gpu_copy_bandwidth(megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write), via PyTorch: the ORT path's one torch use (optional)."""
    import torch

    a = torch.empty(megabytes << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * repeats / (time.perf_counter() - t0)


# How each precision stores a K x N matrix (onnx/optimize.py): MatMulNBits (bits, block) pack whole blocks along K,
# one fp32 scale each; int4 keeps the tied unembedding at int8's settings. bf16's export stores fp32, which OpenVINO
# converts to bf16 when it compiles the graph: a step reads 2 bytes a weight.
FLOAT_BYTES = {Precision.fp32: 4, Precision.fp16: 2, Precision.bf16: 2}
BLOCK_FORMAT = {Precision.int8: (8, INT8_BLOCK), Precision.int4: (4, INT4_BLOCK)}
HEAD_FORMAT = {Precision.int8: (8, INT8_BLOCK), Precision.int4: (INT4_HEAD_BITS, INT8_BLOCK if INT4_HEAD_BITS == 8 else INT4_BLOCK)}


def matrix_bytes(k: int, n: int, precision: Precision, head: bool = False) -> float:
    """Bytes of a K x N weight matrix as a step at `precision` reads it."""
    if precision in FLOAT_BYTES:
        return k * n * FLOAT_BYTES[precision]
    bits, block = (HEAD_FORMAT if head else BLOCK_FORMAT)[precision]
    return n * math.ceil(k / block) * (block * bits // 8 + 4)


def decode_bytes_per_step(cfg: GPT2Config, precision: Precision, batch: int, context: int) -> float:
    """Bytes one decode step must read: every matrix once (the tied unembedding included; the
    embedding lookups read one row per token), biases and LayerNorms, and the KV cache."""
    C, L = cfg.n_embd, cfg.n_layer
    per_block = sum(matrix_bytes(k, n, precision) for k, n in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)))
    head = matrix_bytes(C, cfg.vocab_size, precision, head=True)
    small = L * 13 * C + 2 * C  # biases and LayerNorm parameters, kept fp32
    kv_bytes = 2 if precision is Precision.fp16 else 4
    kv = 2 * L * batch * context * C * kv_bytes
    return L * per_block + head + small * 4 + kv


def roofline_tokens_per_s(bandwidth: float, cfg: GPT2Config, precision: Precision, batch: int, context: int) -> float:
    return batch * bandwidth / decode_bytes_per_step(cfg, precision, batch, context)
