"""onnxruntime-genai as a gpt2x backend (gpt2x.runtime.genai), checked against the PyTorch model (the
parity gates) and against ONNX Runtime on the same folder (tokens of greedy, sampled and beam
generation; logits step by step, through EOS, padding and reordered caches).

The tiny model's <|endoftext|> embedding points along ln_f's bias, so that greedy and sampled
generation end rows with EOS at different steps: the paths where genai would stop a row or feed it
its pad id are exercised."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import ArtifactError, ProviderError
from gpt2x.evaluate import parity
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.model.weights import load_model
from gpt2x.numerics import positions
from gpt2x.onnx.interop import GENAI_CONFIG_FILE
from gpt2x.runtime.base import CPU_PRECISIONS, CUDA_PRECISIONS, Capabilities
from gpt2x.runtime.genai import GenaiBackend
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.tokenizer import EOT_ID
from gpt2x.workflows.backends import export_backend
from gpt2x.workflows.exports import export_model as export

from ..helpers import PROMPTS as BATCH_PROMPTS
from ..helpers import make_hf_model

PROMPTS = [*BATCH_PROMPTS, ""]  # and an empty prompt, which starts from <|endoftext|>
REL_TOL = parity.TOLERANCES[Precision.fp32].max_rel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model, and its fp32 and int8 exports (each through its own parity gate)."""
    folder = tmp_path_factory.mktemp("tiny")
    hf = make_hf_model(folder, seed=7, n_positions=64)
    with torch.no_grad():  # EOS likely enough to end some rows early (wte is tied to the LM head)
        bias = hf.transformer.ln_f.bias
        hf.transformer.wte.weight[EOT_ID] = 2.0 * bias / bias.norm()
    hf.save_pretrained(folder)
    model, source = load_model(str(folder))
    root = tmp_path_factory.mktemp("exp")
    infos = {p: export(model, source, root / f"tiny-{p.value}", p) for p in (Precision.fp32, Precision.int8)}
    return model, infos


@pytest.fixture(scope="module")
def backends(tiny):
    """(genai, ort) on the same folder, per precision."""
    _, infos = tiny
    return {p: (GenaiBackend(info, threads=2), OrtBackend(info, threads=2)) for p, info in infos.items()}


def rel_err(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(ref - got).max() / np.abs(ref).max())


def test_backend_attributes(tiny, backends):
    _, infos = tiny
    genai, _ = backends[Precision.fp32]
    # The generator owns its cache: no cache from elsewhere, no joining rows, no rollback, nor their methods.
    assert (genai.name, genai.provider.value, genai.capabilities) == ("genai", "cpu", Capabilities(
        runtime="onnxruntime-genai", precisions_by_provider={ProviderKind.cpu: CPU_PRECISIONS, ProviderKind.cuda: CUDA_PRECISIONS},
        max_batch=32))
    assert not any(hasattr(genai, m) for m in ("past_from_numpy", "merge", "truncate", "step_greedy"))
    assert (genai.n_positions, genai.vocab_size) == (64, 50257)
    assert genai.model_name == infos[Precision.fp32].meta["model"]["name"]
    assert genai.peak_device_memory_mb() is None
    with export_backend(BackendKind.genai, infos[Precision.fp32], threads=1) as other:
        assert isinstance(other, GenaiBackend)
        ids = np.array([[1, 2, 3]])
        other.run(ids, np.ones_like(ids), np.arange(3)[None], None)
    with pytest.raises(ProviderError, match="this genai backend is closed"):  # closed by the with block
        other.run(ids, np.ones_like(ids), np.arange(3)[None], None)


def test_fp32_passes_the_fp32_gate_against_torch(tiny, backends):
    """Logits on the gate's random shapes (whole sequences: padded batches, prefixes), the caches
    genai hands back in gpt2x's layout, and greedy tokens, against the PyTorch model."""
    model, _ = tiny
    result = parity.check(TorchBackend(model), backends[Precision.fp32][0], Precision.fp32)
    assert result["status"] == "passed", result["message"]
    assert result["logits"]["present_max_rel"] < REL_TOL
    assert result["greedy"]["share"] == 1.0


def test_int8_passes_the_int8_gate_against_torch(tiny, backends):
    """The int8 graph (GroupQueryAttention, one shared KV buffer in genai) under the int8 gate; its
    caches equal ONNX Runtime's own on the same graph."""
    model, _ = tiny
    genai, ort = backends[Precision.int8]
    result = parity.check(TorchBackend(model), genai, Precision.int8)
    assert result["status"] == "passed", result["message"]
    assert parity.compare_on_cases(ort, genai)["present_max_rel"] < REL_TOL


# Sampling keeps the top 40: over the random model's near-flat distribution, a nucleus (top_p) draw
# hinges on cumulative sums over ~50k tokens, which summation order alone can move by one token.
SETTINGS = {
    "greedy": SamplingSettings(max_new_tokens=24, greedy=True),
    "sampled": SamplingSettings(max_new_tokens=24, seed=3, temperature=0.6, top_k=40),
}


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
@pytest.mark.parametrize("how", list(SETTINGS))
def test_generation_matches_ort(backends, precision, how):
    """Single prompts, a left-padded batch (one single-row generator per row) and a batch without
    padding (one generator, EOS rows replayed): the same tokens and finish reasons as ONNX Runtime."""
    genai, ort = backends[precision]
    s = SETTINGS[how]
    rng = np.random.default_rng(5)
    even = [rng.integers(0, 50256, 6).tolist() for _ in range(4)]  # equal lengths: no padding
    runs = [dict(prompts=[p]) for p in PROMPTS] + [dict(prompts=PROMPTS), dict(prompts=[""] * 4, prompt_ids=even)]
    eos_mid_batch = False
    for kw in runs:
        want, got = generate(ort, settings=s, **kw), generate(genai, settings=s, **kw)
        assert [(g.tokens, g.finish_reason) for g in got] == [(w.tokens, w.finish_reason) for w in want], kw
        if len(want) > 1:
            ends = [len(w.tokens) for w in want if w.finish_reason == "eos"]
            eos_mid_batch |= bool(ends) and len(set(ends)) < len(want)
    assert eos_mid_batch  # some batch had a row end with EOS while others went on


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
def test_beam_search_matches_ort(backends, precision):
    genai, ort = backends[precision]
    s = SamplingSettings(max_new_tokens=16, num_beams=3)
    for p in PROMPTS[:3]:
        want, got = generate(ort, [p], s)[0], generate(genai, [p], s)[0]
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), p


def scripted(backend, ids: np.ndarray, mask: np.ndarray, script: list[np.ndarray], reorders: dict | None = None):
    """Prefill, then feed the scripted tokens one step each (reordering the cache before the steps named
    in `reorders`); returns every step's last-position logits and the final cache as numpy."""
    logits, past = backend.step(ids, mask, positions(mask, ids.shape[1]), None)
    out = [logits]
    for i, tokens in enumerate(script):
        if reorders and i in reorders:
            rows = reorders[i]
            past, mask = past.reorder(rows), mask[rows]
        mask = np.concatenate([mask, np.ones((len(tokens), 1), dtype=np.int64)], axis=1)
        logits, past = backend.step(tokens[:, None], mask, positions(mask, 1), past)
        out.append(logits)
    return out, past.to_numpy(), mask


E = EOT_ID
CASES = {
    # one generator: EOS in one row, then in all rows at once, then tokens after EOS
    "batched": ([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], [[0, 0, 0, 0]] * 3,
                [[1, 2, 3], [E, 4, 5], [6, 7, 8], [E, E, E], [9, E, 10], [11, 12, 13]], {}),
    "left-padded": ([[E, E, 7, 8], [9, 10, 11, 12], [E, 14, 15, 16]], [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
                    [[1, 2, 3], [E, 4, 5], [E, E, E], [9, 10, 11]], {}),
    "one row": ([[E, 3, 4]], [[0, 0, 0]], [[1], [E], [E], [2]], {}),
    # reorders: a permutation, rows taken twice, a changed batch size
    "batched reordered": ([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], [[0, 0, 0, 0]] * 3,
                          [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11], [12, 13, 14]],
                          {1: [2, 0, 1], 2: [1, 1, 0], 3: [0, 2], 4: [1, 0, 0]}),
    "left-padded reordered": ([[E, E, 7, 8], [9, 10, 11, 12]], [[1, 1, 0, 0], [0, 0, 0, 0]],
                              [[1, 2], [3, 4, 5], [6, 7], [8, 9]], {1: [1, 0, 0], 2: [2, 0], 3: [1, 1]}),
}


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_ort(backends, precision, case):
    """Logits at every step and the final cache, for fed tokens chosen here (EOS included) rather
    than by a sampler, against ONNX Runtime's; reorders against its device-side gather."""
    genai, ort = backends[precision]
    ids, pads, script, reorders = CASES[case]
    ids = np.asarray(ids, dtype=np.int64)
    mask = 1 - np.asarray(pads, dtype=np.int64)
    script = [np.asarray(t, dtype=np.int64) for t in script]
    rows = {k: np.asarray(v, dtype=np.int64) for k, v in reorders.items()}
    want, want_cache, final_mask = scripted(ort, ids, mask, script, rows)
    got, got_cache, _ = scripted(genai, ids, mask, script, rows)
    for i, (w, g) in enumerate(zip(want, got)):  # every row's last slot holds a real token here
        assert g.shape == w.shape
        assert rel_err(w, g) < REL_TOL, f"step {i}"
    keep = final_mask.astype(bool)
    for w, g in zip(want_cache, got_cache):
        assert rel_err(w.transpose(0, 2, 1, 3)[keep], g.transpose(0, 2, 1, 3)[keep]) < REL_TOL


@pytest.mark.parametrize("pad_at", [None, 0, 6])
def test_run_returns_every_position_and_continues(backends, pad_at):
    """run: all positions' logits of a prefill, then several tokens at once on top of it (batched:
    a replay; left-padded: per row; a pad among the new tokens: the batch splits into rows), as
    ONNX Runtime computes them at the real positions."""
    genai, ort = backends[Precision.fp32]
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 50257, (3, 9), dtype=np.int64)
    mask = np.ones_like(ids)
    if pad_at is not None:
        mask[1, pad_at : pad_at + 2] = 0
    results = []
    for b in (ort, genai):
        first, past = b.run(ids[:, :5], mask[:, :5], positions(mask[:, :5], 5), None)
        second, past = b.run(ids[:, 5:], mask, positions(mask, 4), past)
        results.append((first, second, past.to_numpy()))
    (w1, w2, w_cache), (g1, g2, g_cache) = results
    real1, real2, keep = mask[:, :5].astype(bool), mask[:, 5:].astype(bool), mask.astype(bool)
    assert rel_err(w1[real1], g1[real1]) < REL_TOL and rel_err(w2[real2], g2[real2]) < REL_TOL
    for w, g in zip(w_cache, g_cache):
        assert rel_err(w.transpose(0, 2, 1, 3)[keep], g.transpose(0, 2, 1, 3)[keep]) < REL_TOL

def test_a_stale_cache_is_refused(backends):
    genai, _ = backends[Precision.fp32]
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    mask = np.ones((2, 4), dtype=np.int64)
    _, past = genai.step(ids, mask[:, :3], positions(mask[:, :3], 3), None)
    genai.step(ids[:, :1], mask, positions(mask, 1), past)
    with pytest.raises(ValueError, match="already stepped"):
        genai.step(ids[:, :1], mask, positions(mask, 1), past)


def test_fp16_on_the_cpu_is_refused(tiny):
    _, infos = tiny
    info = infos[Precision.fp32]
    fp16 = replace(info, meta={**info.meta, "precision": "fp16"})
    with pytest.raises(ProviderError, match="fp16"):
        GenaiBackend(fp16)


def test_more_rows_than_a_genai_generator_takes(backends):
    """33 rows without padding, one more than onnxruntime-genai's generators take (it raises on 33): the prompt and
    two steps give ONNX Runtime's logits on the same export."""
    genai, ort = backends[Precision.fp32]
    ids = np.random.default_rng(3).integers(0, 50257, (33, 5))
    mask = np.ones_like(ids)
    got, past = genai.step(ids, mask, positions(mask, 5), None)
    want, ort_past = ort.step(ids, mask, positions(mask, 5), None)
    assert rel_err(want, got) < REL_TOL
    for t in range(2):
        nxt = want.argmax(-1)[:, None]
        mask = np.ones((33, 6 + t), np.int64)
        got, past = genai.step(nxt, mask, positions(mask, 1), past)
        want, ort_past = ort.step(nxt, mask, positions(mask, 1), ort_past)
        assert rel_err(want, got) < REL_TOL
    # A batch of 2 rows gathered into 34 (as n samples a prompt): more than a generator takes again.
    rows = np.array([0, 1] * 17)
    few, few_ort = genai.step(ids[:2], np.ones((2, 5), np.int64), positions(np.ones((2, 5), np.int64), 5), None)[1], \
        ort.step(ids[:2], np.ones((2, 5), np.int64), positions(np.ones((2, 5), np.int64), 5), None)[1]
    mask = np.ones((34, 6), np.int64)
    nxt = np.full((34, 1), 7)
    got = genai.step(nxt, mask, positions(mask, 1), few.reorder(rows))[0]
    want = ort.step(nxt, mask, positions(mask, 1), few_ort.reorder(rows))[0]
    assert rel_err(want, got) < REL_TOL


def test_a_folder_genai_cannot_load_is_an_artifact_error(tiny, tmp_path):
    _, infos = tiny
    info = infos[Precision.fp32]
    missing = tmp_path / "missing"
    shutil.copytree(info.folder, missing)
    (missing / GENAI_CONFIG_FILE).unlink()
    with pytest.raises(ArtifactError, match=GENAI_CONFIG_FILE):
        GenaiBackend(replace(info, folder=missing))
    broken = tmp_path / "broken"
    shutil.copytree(info.folder, broken)
    cfg = json.loads((broken / GENAI_CONFIG_FILE).read_text())
    cfg["model"]["decoder"]["filename"] = "absent.onnx"
    (broken / GENAI_CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError) as e:
        GenaiBackend(replace(info, folder=broken))
    assert "\n" not in str(e.value) and "onnxruntime-genai cannot load" in str(e.value)
