"""The hardware limit of decoding: one token reads every weight matrix once (plus the KV cache), so
at batch B the fastest possible decode rate is B * bandwidth / (weight bytes + KV bytes). The
bandwidth is measured: a multi-threaded read on the CPU, a device-to-device copy on the GPU."""

from __future__ import annotations

import threading
import time

import numpy as np

from ..choices import Precision
from ..model.config import GPT2Config


def cpu_read_bandwidth(threads: int, megabytes: int = 1024, repeats: int = 7) -> float:
    """Bytes/s of a multi-threaded sequential read, best of `repeats`: each thread takes the max of its
    own chunk (numpy's SIMD max streams memory at full speed and releases the GIL)."""
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
    """Bytes/s moved by a device-to-device copy (read + write counted), via PyTorch's CUDA (the
    bench's only use of torch on the ONNX Runtime path: without torch there is no GPU figure)."""
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


BYTES = {Precision.fp32: 4, Precision.fp16: 2, Precision.int8: 1}


def decode_bytes_per_step(cfg: GPT2Config, precision: Precision, batch: int, context: int) -> float:
    """Bytes one decode step must read: every matrix once (the tied unembedding included; the
    embedding lookups read one row per token), biases and LayerNorms, and the KV cache."""
    C, L = cfg.n_embd, cfg.n_layer
    w = BYTES[precision]
    matrices = L * 12 * C * C + cfg.vocab_size * C
    small = L * 13 * C + 2 * C  # biases and LayerNorm parameters, kept fp32
    kv_bytes = 2 if precision is Precision.fp16 else 4
    kv = 2 * L * batch * context * C * kv_bytes
    return matrices * w + small * 4 + kv


def roofline_tokens_per_s(bandwidth: float, cfg: GPT2Config, precision: Precision, batch: int, context: int) -> float:
    return batch * bandwidth / decode_bytes_per_step(cfg, precision, batch, context)
