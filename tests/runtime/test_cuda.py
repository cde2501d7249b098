"""ONNX Runtime's CUDA provider against the PyTorch model (CPU) and against ONNX Runtime's CPU provider.

Every test here is marked `cuda`: it runs wherever the CUDA provider loads, and `pytest -m cuda`
on a machine where it does not load fails instead of passing unrun (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2x.choices import Precision, ProviderKind
from gpt2x.evaluate.parity import check
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.static_decoding import decode_static
from gpt2x.model.weights import load_model
from gpt2x.numerics import positions
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.runtime.static_decode import StaticDecoder
from gpt2x.workflows.exports import export_model

from ..helpers import PROMPTS, check_step_greedy

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny(tiny_export):
    exports = {p: tiny_export(p) for p in (Precision.fp32, Precision.fp16)}
    return exports[Precision.fp32][0], {p: e[2] for p, e in exports.items()}


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.fp16])
def test_cuda_passes_the_gate_against_torch(tiny, precision):
    """The whole gate of the precision: random shapes with empty past and left-padded rows, greedy."""
    model, infos = tiny
    result = check(TorchBackend(model), OrtBackend(infos[precision], ProviderKind.cuda), precision)
    assert result["status"] == "passed", result["message"]
    assert result["provider"] == "cuda"
    assert infos[precision].meta["parity"]["status"] == "passed"  # the export gate ran on CUDA too


def test_presents_stay_on_the_device(tiny):
    _, infos = tiny
    backend = OrtBackend(infos[Precision.fp16], ProviderKind.cuda)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    mask = np.ones_like(ids)
    logits, past = backend.step(ids, mask, positions(mask, 3), None)
    assert logits.shape == (2, 50257) and logits.dtype == np.float32
    assert all(v.device_name().lower() == "cuda" for v in past.values)
    mask = np.ones((2, 4), np.int64)
    _, past2 = backend.step(np.array([[7], [8]]), mask, positions(mask, 1), past)
    assert all(v.device_name().lower() == "cuda" for v in past2.values) and past2.length == 4
    reordered = past2.reorder(np.array([1, 0]))
    assert all(v.device_name().lower() == "cuda" for v in reordered.values)
    np.testing.assert_array_equal(reordered.values[0].numpy()[0], past2.values[0].numpy()[1])


def test_beam_search_on_cuda_equals_cpu(tiny):
    _, infos = tiny
    s = SamplingSettings(num_beams=4, max_new_tokens=24)
    cpu = generate(OrtBackend(infos[Precision.fp32]), PROMPTS, s)
    gpu = generate(OrtBackend(infos[Precision.fp32], ProviderKind.cuda), PROMPTS, s)
    assert [r.tokens for r in gpu] == [r.tokens for r in cpu]


def test_bundled_greedy_64_tokens_equal_torch(tmp_path):
    model, source = load_model("shakespeare")
    info = export_model(model, source, tmp_path / "shakespeare-fp32")
    s = SamplingSettings(max_new_tokens=64, greedy=True)
    want = generate(TorchBackend(model), PROMPTS, s)
    got = generate(OrtBackend(info, ProviderKind.cuda), PROMPTS, s)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert max(len(r.tokens) for r in got) > 32


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.fp16])
def test_serving_engine_on_cuda_equals_generate(tiny, precision):
    """gpt2x serve's engine on the CUDA provider (rows joining a running batch, merged through the
    host): every row's tokens equal gpt2x's generation code on that prompt alone, on CUDA."""
    import threading

    from gpt2x.serve.core.engine import Engine, EngineSettings, Row
    from gpt2x.serve.core.outputs import TokenOut
    from gpt2x.tokenizer import encode

    _, infos = tiny
    backend = OrtBackend(infos[precision], ProviderKind.cuda)
    engine = Engine(backend, EngineSettings(max_batch_size=4, max_join_delay_s=0)).start()
    prompts = [encode(p) for p in PROMPTS + ["ROMEO:\nBut, soft!", "Now is the winter"]]
    results: dict[int, list[int]] = {}
    done = threading.Semaphore(0)

    def submit(i: int) -> None:
        tokens: list[int] = []

        def sink(out):
            if isinstance(out, TokenOut):
                tokens.append(out.token)
                if len(tokens) == 2 and i + 1 < len(prompts):
                    submit(i + 1)  # arrives while row i decodes: it joins the batch
            else:
                results[i] = tokens
                done.release()
                if len(tokens) < 2 and i + 1 < len(prompts):
                    submit(i + 1)  # ended before handing on
        engine.submit([Row(prompts[i], SamplingSettings(max_new_tokens=12, greedy=True), sink)])

    try:
        submit(0)
        for _ in prompts:
            assert done.acquire(timeout=120)
    finally:
        engine.close()
    assert engine.counters["joins"] > 0
    for i, ids in enumerate(prompts):
        alone = generate(backend, [""], SamplingSettings(max_new_tokens=12, greedy=True), prompt_ids=[ids])[0].tokens
        assert results[i] == alone, i


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.fp16])
def test_truncate_on_cuda_keeps_the_device_and_the_logits(tiny, precision):
    """Rolling back a growing cache on CUDA (the Slice graph): the kept positions stay on the device,
    and a step after the rollback gives the logits of a no-cache forward over the kept sequence."""
    _, infos = tiny
    backend = OrtBackend(infos[precision], ProviderKind.cuda)
    ids = np.arange(1, 13, dtype=np.int64)[None]
    mask = np.ones_like(ids)
    _, past = backend.run(ids, mask, positions(mask, 12), None)
    past = past.truncate(7)
    assert all(v.device_name().lower() == "cuda" and v.shape()[2] == 7 for v in past.values)
    nxt = np.array([[99]], dtype=np.int64)
    mask = np.ones((1, 8), np.int64)
    stepped, _ = backend.step(nxt, mask, positions(mask, 1), past)
    full_ids = np.concatenate([ids[:, :7], nxt], axis=1)
    full, _ = backend.run(full_ids, np.ones_like(full_ids), positions(np.ones_like(full_ids), 8), None)
    np.testing.assert_allclose(stepped[0], full[0, -1], atol=2e-2 if precision is Precision.fp16 else 1e-4)


def test_speculative_greedy_on_cuda_equals_plain(tiny):
    """Speculative decoding on CUDA gives plain greedy's tokens: an fp32 target with the ngram draft
    and with the fp16 export as a model draft (its growing cache rolled back on the device), K fixed
    and adaptive."""
    from gpt2x.generation.speculative import DraftSettings, ModelDrafter, NgramDrafter

    _, infos = tiny
    backend = OrtBackend(infos[Precision.fp32], ProviderKind.cuda)
    fp16_draft = ModelDrafter(OrtBackend(infos[Precision.fp16], ProviderKind.cuda))
    settings = SamplingSettings(max_new_tokens=40, greedy=True)
    plain = generate(backend, PROMPTS, settings)
    for drafter in (NgramDrafter(), fp16_draft):
        for draft_settings in (DraftSettings(num_speculative_tokens=4, adaptive=False), DraftSettings()):
            spec = generate(backend, PROMPTS, settings, draft=drafter, draft_settings=draft_settings)
            assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert fp16_draft.backend.provider is ProviderKind.cuda


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.fp16])
def test_greedy_steps_take_the_argmax_on_the_device(tiny, precision):
    """step_greedy on CUDA (the logits stay on the device; only the tokens come back) gives the argmax
    of step's logits, from the prompt and from a past, and greedy generation equals the CPU's at fp32."""
    _, infos = tiny
    backend = OrtBackend(infos[precision], ProviderKind.cuda)
    greedy_past = check_step_greedy(backend)
    assert all(v.device_name().lower() == "cuda" for v in greedy_past.values)
    if precision is Precision.fp32:
        settings = SamplingSettings(max_new_tokens=16, greedy=True)
        cpu = [r.tokens for r in generate(OrtBackend(infos[precision]), PROMPTS, settings)]
        assert [r.tokens for r in generate(backend, PROMPTS, settings)] == cpu


def test_fixed_cache_and_its_cuda_graph_on_cuda(tiny):
    """fp16 StaticDecoder on CUDA: the step captured in a CUDA graph (on an early run, replayed after) and replayed in
    blocks of steps with the host off their path (positions and tokens advanced on the device, the host waiting for a
    block's last step alone) gives the tokens of the same steps run one by one, the host writing each position and
    reading each token, also on a second prompt (replays only), and those follow the export's growing cache
    (MultiHeadAttention, not GroupQueryAttention: fp16 rounding may part them at a near tie, hence 0.8)."""
    _, infos = tiny
    info = infos[Precision.fp16]
    prompts = np.random.default_rng(5).integers(0, info.config.vocab_size, (2, 9))
    plain = StaticDecoder(info, ProviderKind.cuda, rows=2, capacity=48, block=1)
    graph = StaticDecoder(info, ProviderKind.cuda, rows=2, capacity=48, cuda_graph=True)
    want = plain.generate(prompts, 30)
    np.testing.assert_array_equal(graph.generate(prompts, 30), want)
    others = np.random.default_rng(6).integers(0, info.config.vocab_size, (2, 12))
    np.testing.assert_array_equal(graph.generate(others, 30), plain.generate(others, 30))
    assert graph.runs == 58
    settings = SamplingSettings(max_new_tokens=30, greedy=True, ignore_eos=True)
    growing = [r.tokens for r in generate(OrtBackend(info, ProviderKind.cuda), [""] * 2, settings, prompt_ids=prompts.tolist())]
    assert (np.array(growing) == want).mean() >= 0.8


def test_the_draw_on_the_device_follows_the_host_sampler_on_cuda(tiny):
    """decode_static on CUDA (fp16): the CUDA graph's draws equal the plain steps', and follow the host sampler on
    the export's growing cache (another attention kernel in fp16: a near boundary may part them, hence 0.8)."""
    _, infos = tiny
    info = infos[Precision.fp16]
    prompts = np.random.default_rng(8).integers(0, info.config.vocab_size, (1, 7))
    settings = SamplingSettings(temperature=0.9, seed=5, max_new_tokens=30, ignore_eos=True)
    plain = decode_static(StaticDecoder(info, ProviderKind.cuda, capacity=48, sampling=True), prompts, settings)
    graph = decode_static(StaticDecoder(info, ProviderKind.cuda, capacity=48, sampling=True, cuda_graph=True), prompts,
                          settings)
    np.testing.assert_array_equal(graph, plain)
    host = generate(OrtBackend(info, ProviderKind.cuda), [""], settings, prompt_ids=prompts.tolist())[0].tokens
    assert (np.array(host) == plain[0]).mean() >= 0.8


def test_generate_decodes_on_the_fixed_cache_and_its_cuda_graph_by_default_on_cuda(tiny):
    """`gpt2x generate --provider cuda`'s decoder (fixed_cache=None, auto): an fp16 export greedy and sampled runs on
    the fixed cache with its step a CUDA graph replayed on CUDA's provider, with the tokens of StaticDecoder's plain
    steps (decode_static: the same sampler's uniforms); an fp32 export stays on the growing cache."""
    _, infos = tiny
    info = infos[Precision.fp16]
    prompts = np.random.default_rng(9).integers(0, info.config.vocab_size, (2, 8))
    backend = OrtBackend(info, ProviderKind.cuda)
    for settings in (SamplingSettings(greedy=True, max_new_tokens=24, ignore_eos=True),
                     SamplingSettings(temperature=0.9, seed=2, max_new_tokens=24, ignore_eos=True)):
        got = generate(backend, [""] * 2, settings, prompt_ids=prompts.tolist(), fixed_cache=None)
        assert {r.decoder for r in got} == {"fixed cache + CUDA graph"}
        plain = StaticDecoder(info, ProviderKind.cuda, rows=2, capacity=64, sampling=not settings.greedy)
        np.testing.assert_array_equal([r.tokens for r in got], decode_static(plain, prompts, settings))
    assert backend.fixed_decoder(2, 32).providers[0] == "CUDAExecutionProvider"
    fp32 = generate(OrtBackend(infos[Precision.fp32], ProviderKind.cuda), [""] * 2, settings, prompt_ids=prompts.tolist(),
                    fixed_cache=None)
    assert {r.decoder for r in fp32} == {None}
