"""Parity of a backend against a reference backend (in practice PyTorch fp32): logit statistics on random shapes
and greedy agreement, gated by one tolerance table keyed by precision. Backend-agnostic: no torch here."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..choices import Precision, ProviderKind
from ..errors import ParityError, ProviderError
from ..generation.generate import generate
from ..generation.settings import SamplingSettings
from ..numerics import positions
from ..onnx.artifact import ExportInfo
from ..runtime.base import Backend
from ..runtime.registry import backend_class, default_backend
from .metrics import logit_stats


@dataclass(frozen=True)
class Tolerance:
    max_rel: float  # max |Δlogit| / max |reference logit|
    max_kl: float  # mean KL(reference || backend) of next-token distributions, nats
    min_top1: float | None  # share of positions whose argmax agrees (None: reported, not gated)
    min_greedy: float  # share of greedy tokens (identical prefix / N) that must agree
    why: str


# Justified in docs/export.md (parity gates): lossy precisions are gated on KL, not top-1 (random inputs have
# near-ties any rounding flips); int4's greedy agreement is not gated (it parts after 0-4 tokens on random weights).
TOLERANCES: dict[Precision, Tolerance] = {
    Precision.fp32: Tolerance(1e-4, 1e-6, 1.0, 1.0, "same maths, different summation order"),
    Precision.fp16: Tolerance(2e-2, 1e-3, None, 0.5, "10-bit mantissa: ~1e-3 relative error per op, accumulated over layers"),
    Precision.int8: Tolerance(0.1, 1e-2, None, 0.25, "int8 weights with one scale per 128-weight block (MatMulNBits), int8 activations"),
    Precision.int4: Tolerance(0.6, 3e-2, None, 0.0, "4-bit weights in blocks of 32 (MatMulNBits), the unembedding at 8 bits, int8 activations"),
    Precision.bf16: Tolerance(3e-2, 1e-3, None, 0.5, "fp32 weights and activations rounded to bf16's 8-bit mantissa for the matmuls, f32 accumulation"),
}
# An fp32 export's int8 KV cache (asked for at export): its own gate, as bf16's. Each key and value is rounded to 1/127
# of twice the largest calibration saw at its channel; the weights and the rest of the arithmetic stay fp32.
INT8_KV_ON_FP32 = Tolerance(3e-2, 1e-3, None, 0.5, "fp32 weights and activations, keys and values stored in int8 per "
                            "channel (round half to even of value / scale)")
GREEDY_TOKENS = 32
GREEDY_PROMPTS = ["ROMEO:", "The meaning of life is", "First Citizen:\nBefore we proceed"]


@dataclass(frozen=True)
class Case:
    batch: int
    past: int
    seq: int
    padded: bool  # first row left-padded by a few slots


def cases(n_positions: int) -> list[Case]:
    specs = [Case(1, 0, 7, False), Case(3, 0, 5, True), Case(2, 6, 1, False), Case(4, 9, 3, True),
             Case(1, 15, 1, False), Case(2, 4, 6, True)]
    return [c for c in specs if c.past + c.seq + 1 <= n_positions]


def case_inputs(c: Case, vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random ids and the attention mask (B, past + seq) of a case."""
    total = c.past + c.seq
    ids = rng.integers(0, vocab, (c.batch, total), dtype=np.int64)
    mask = np.ones((c.batch, total), dtype=np.int64)
    if c.padded:
        mask[0, : min(3, total - 1)] = 0
    return ids, mask


def compare_on_cases(reference: Backend, backend: Backend, seed: int = 0) -> dict:
    """The reference builds each case's past; both then run the next `seq` tokens on it. Statistics over real
    (unpadded) positions."""
    rng = np.random.default_rng(seed)
    refs, gots, present_err = [], [], 0.0
    for c in cases(reference.n_positions):
        ids, mask = case_inputs(c, reference.vocab_size, rng)
        ref_past = flat_past = None
        if c.past:
            _, ref_past = reference.run(ids[:, : c.past], mask[:, : c.past], positions(mask[:, : c.past], c.past), None)
            flat_past = ref_past.to_numpy()
        pos = positions(mask, c.seq)
        ref, ref_present = reference.run(ids[:, c.past :], mask, pos, ref_past)
        if backend.capabilities.takes_past or not c.past:
            got_past = backend.past_from_numpy(flat_past) if flat_past is not None else None
            got, got_present = backend.run(ids[:, c.past :], mask, pos, got_past)
        else:  # a backend that owns its cache runs prefix and step as one sequence
            got, got_present = backend.run(ids, mask, positions(mask, c.past + c.seq), None)
            got = got[:, c.past :]
        real = mask[:, c.past :].astype(bool)
        refs.append(ref[real])
        gots.append(got[real])
        # Cache entries of real positions only: what a padding slot holds is never attended to.
        keep = mask.astype(bool)  # (B, P+T)
        want = np.concatenate([t.transpose(0, 2, 1, 3)[keep].ravel() for t in ref_present.to_numpy()])
        have = np.concatenate([t.transpose(0, 2, 1, 3)[keep].ravel() for t in got_present.to_numpy()])
        present_err = max(present_err, float(np.abs(want - have).max() / max(np.abs(want).max(), 1e-12)))
    stats = logit_stats(np.concatenate(refs), np.concatenate(gots))
    stats["present_max_rel"] = present_err
    stats["cases"] = [asdict(c) for c in cases(reference.n_positions)]
    return stats


def greedy_agreement(reference, backend, n: int = GREEDY_TOKENS) -> dict:
    """Identical greedy prefix length per prompt, out of n tokens (EOS ends a sequence early)."""
    s = SamplingSettings(max_new_tokens=n, greedy=True)
    ref = generate(reference, GREEDY_PROMPTS, s)
    got = generate(backend, GREEDY_PROMPTS, s)
    prefixes = []
    for a, b in zip(ref, got):
        k = 0
        while k < min(len(a.tokens), len(b.tokens)) and a.tokens[k] == b.tokens[k]:
            k += 1
        prefixes.append(n if a.tokens == b.tokens else k)
    return {"tokens": n, "identical_prefix": prefixes, "share": float(np.mean(prefixes) / n)}


def out_of_tolerance(stats: dict, greedy: dict, tol: Tolerance) -> list[str]:
    """What of logit_stats' `stats` and greedy_agreement's `greedy` is outside `tol`, a line each."""
    failures = []
    if stats["max_rel"] > tol.max_rel:
        failures.append(f"max |Δlogit| {stats['max_abs']:.3g} is {stats['max_rel']:.3g} of the logit scale (gate {tol.max_rel:g})")
    if stats["mean_kl"] > tol.max_kl:
        failures.append(f"mean KL {stats['mean_kl']:.3g} nats (gate {tol.max_kl:g})")
    if tol.min_top1 is not None and stats["top1_agreement"] < tol.min_top1:
        failures.append(f"top-1 agreement {stats['top1_agreement']:.3f} (gate {tol.min_top1:g})")
    if greedy["share"] < tol.min_greedy:
        failures.append(f"greedy agreement {greedy['share']:.3f} (gate {tol.min_greedy:g})")
    return failures


def int8_kv_tolerance(precision: Precision) -> Tolerance:
    """The gate of an export's int8 KV cache: its precision's own, fp32's its own (INT8_KV_ON_FP32)."""
    return INT8_KV_ON_FP32 if precision is Precision.fp32 else TOLERANCES[precision]


def check(reference: Backend, backend: Backend, precision: Precision, greedy_tokens: int = GREEDY_TOKENS,
          tolerance: Tolerance | None = None) -> dict:
    """Parity statistics of `backend` against `reference`, and whether they pass the gate of `precision` (or
    `tolerance`, where given)."""
    tol = tolerance or TOLERANCES[precision]
    stats = compare_on_cases(reference, backend)
    greedy = greedy_agreement(reference, backend, greedy_tokens)
    failures = out_of_tolerance(stats, greedy, tol)
    return {
        "status": "failed" if failures else "passed",
        "provider": backend.provider.value,
        "precision": precision.value,
        "tolerance": asdict(tol),
        "logits": stats,
        "greedy": greedy,
        "message": "; ".join(failures),
    }


def gate_export(reference: Backend, info: ExportInfo) -> dict:
    """The export's gate: fp32/int8/int4 on the CPU, fp16 on CUDA (skipped, and said so, without CUDA), bf16 on the
    CPU at bf16 compute; each on the backend that runs it by default (registry.default_backend: ONNX Runtime, OpenVINO
    for bf16). Raises ParityError when the export is out of tolerance."""
    provider = ProviderKind.cuda if info.precision is Precision.fp16 else ProviderKind.cpu
    kind = default_backend(info.precision, provider)
    try:
        backend = backend_class(kind)(info, provider)
    except ProviderError as e:
        if info.precision is not Precision.fp16:
            raise
        return {"status": "skipped", "reason": f"fp16 parity needs CUDA: {e}"}
    with backend:
        result = check(reference, backend, info.precision) | {"backend": backend.name}
    if result["status"] == "failed":
        raise ParityError(f"{info.precision.value} export is out of tolerance: {result['message']}")
    return result
