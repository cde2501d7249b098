"""The web backend: onnxruntime-web's WebAssembly build in a real headless Chromium (Debian's), checked
against two independent references: the PyTorch model (the parity gate of each precision) and native
ONNX Runtime on the same export (logits, generated tokens, cache operations). Nothing here is
mocked: each backend launches Chromium, loads the export from the loopback server and runs it."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest

from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import ArtifactError, MissingDependencyError, ProviderError
from gpt2x.evaluate import parity
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import EXPORTS_ENV, MODEL_FILE, ExportInfo, default_export_dir
from gpt2x.runtime import web
from gpt2x.runtime.base import CPU_PRECISIONS, Capabilities
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.runtime.web import WebBackend
from gpt2x.workflows.backends import export_backend, require_provider

from ..helpers import BENCH_SCHEMA, PROMPTS, StepClock, assert_one_line_error, check_step_greedy, cli, validate

PRECISIONS = [Precision.fp32, Precision.int8, Precision.int4]
SOURCES: dict = {}  # the tiny model's ModelSource, for the bench


@pytest.fixture(scope="module")
def tiny(tiny_export):
    """A tiny random GPT-2 and its fp32, int8 and int4 exports (the run's shared ones; the tests below
    gate the web backend against the model itself)."""
    exports = {p: tiny_export(p) for p in PRECISIONS}
    model, SOURCES["tiny"], _ = exports[Precision.fp32]
    return model, {p: e[2] for p, e in exports.items()}


@pytest.fixture(scope="module")
def pages(tiny):
    """One web backend per precision, shared by the tests below (each is a Chromium)."""
    _, infos = tiny
    backends = {p: WebBackend(infos[p], threads=2) for p in PRECISIONS}
    yield backends
    for b in backends.values():
        b.close()


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.value)
def test_parity_gate_against_torch(tiny, pages, precision):
    """The gate every backend passes at its precision: random shapes with left padding and a past
    handed in from torch (batched multi-token steps over a past included), and greedy agreement."""
    model, _ = tiny
    result = parity.check(TorchBackend(model), pages[precision], precision)
    assert result["status"] == "passed", result["message"]
    assert any(c["batch"] > 1 and c["past"] > 0 and c["seq"] > 1 for c in result["logits"]["cases"])
    if precision is Precision.fp32:
        assert result["logits"]["top1_agreement"] == 1.0 and result["greedy"]["share"] == 1.0


def test_the_page_is_cross_origin_isolated_and_threaded(pages):
    info = pages[Precision.fp32].page_info
    assert info["crossOriginIsolated"] is True  # the COOP/COEP headers took effect: SharedArrayBuffer exists
    assert info["threads"] == 2
    assert info["version"] == web.ort_web_version()
    assert "HeadlessChrome" in info["userAgent"]
    assert info["inputs"][:3] == ["input_ids", "attention_mask", "position_ids"]


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.value)
def test_logits_match_native_onnx_runtime(tiny, pages, precision):
    """The same graph on native ONNX Runtime: fp32 to summation order; int8 and int4 within what the
    two builds' MatMulNBits kernels differ by (native computes with int8 activations)."""
    _, infos = tiny
    native = OrtBackend(infos[precision], in_place_kv=False)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 50257, (2, 9))
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    want, want_past = native.run(ids[:, :6], mask[:, :6], positions(mask[:, :6], 6), None)
    got, got_past = pages[precision].run(ids[:, :6], mask[:, :6], positions(mask[:, :6], 6), None)
    scale = np.abs(want).max()
    tol = 1e-5 if precision is Precision.fp32 else 0.05
    real = mask[:, :6].astype(bool)
    assert np.abs(got[real] - want[real]).max() <= tol * scale
    want2, _ = native.step(ids[:, 6:], mask, positions(mask, 3), want_past)
    got2, _ = pages[precision].step(ids[:, 6:], mask, positions(mask, 3), got_past)
    assert got2.shape == want2.shape == (2, 50257)
    assert np.abs(got2 - want2).max() <= tol * scale


def test_greedy_and_seeded_sampling_equal_native(tiny, pages):
    """The sampler is gpt2x's: with the same seed the web backend gives the tokens native ONNX Runtime
    gives (fp32, whose logits agree to summation order), batched with left padding."""
    _, infos = tiny
    native = OrtBackend(infos[Precision.fp32])
    for settings in (SamplingSettings(max_new_tokens=24, greedy=True), SamplingSettings(max_new_tokens=24, seed=7, top_k=0)):
        want = [r.tokens for r in generate(native, PROMPTS, settings)]
        got = [r.tokens for r in generate(pages[Precision.fp32], PROMPTS, settings)]
        assert got == want


def test_greedy_steps_take_the_argmax_in_the_page(pages):
    """step_greedy (only tokens cross to Python) gives the argmax of step's logits, row by row, with
    a left-padded row, from the prompt and from a past."""
    check_step_greedy(pages[Precision.int8])


def test_beam_search_equals_native(tiny, pages):
    _, infos = tiny
    settings = SamplingSettings(max_new_tokens=12, num_beams=3, greedy=True)
    want = [r.tokens for r in generate(OrtBackend(infos[Precision.fp32]), PROMPTS[:2], settings)]
    assert [r.tokens for r in generate(pages[Precision.fp32], PROMPTS[:2], settings)] == want


def test_cache_round_trip_truncate_and_reorder(tiny, pages):
    """past_from_numpy / to_numpy are exact; truncate keeps the first positions, as a fresh
    run of the shorter sequence computes them; reorder gathers rows."""
    _, infos = tiny
    page = pages[Precision.fp32]
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 50257, (3, 10))
    mask = np.ones_like(ids)
    _, past = page.run(ids, mask, positions(mask, 10), None)
    arrays = past.to_numpy()
    assert len(arrays) == 2 * infos[Precision.fp32].config.n_layer and arrays[0].shape == (3, 4, 10, 8)
    assert all(np.array_equal(a, b) for a, b in zip(page.past_from_numpy(arrays).to_numpy(), arrays))
    short = past.truncate(6)
    assert short.length == 6
    _, fresh = page.run(ids[:, :6], mask[:, :6], positions(mask[:, :6], 6), None)
    for a, b in zip(short.to_numpy(), fresh.to_numpy()):
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(b).max(), 1e-6)
    rows = np.array([2, 0, 0])
    gathered = past.reorder(rows).to_numpy()
    assert all(np.array_equal(g, a[rows]) for g, a in zip(gathered, arrays))
    with pytest.raises(ValueError, match="cannot keep 11"):
        past.truncate(11)


def test_caches_are_released_in_the_page(pages):
    page = pages[Precision.int4]
    ids = np.array([[1, 2, 3]])
    mask = np.ones_like(ids)
    for _ in range(5):
        page.run(ids, mask, positions(mask, 3), None)
    held = page._call("() => window.gpt2x.release([])")  # the number of caches the page holds
    assert held <= 2


def test_speculative_decoding_rolls_back_in_the_page(tiny, pages):
    """An ngram draft over the web target: the output is the target's own greedy output."""
    from gpt2x.generation.speculative import DraftSettings, NgramDrafter

    settings = SamplingSettings(max_new_tokens=20, greedy=True)
    prompt = ["the the the the the the the the"]
    want = generate(pages[Precision.fp32], prompt, settings)[0].tokens
    got = generate(pages[Precision.fp32], prompt, settings, draft=NgramDrafter(DraftSettings()),
                   draft_settings=DraftSettings(adaptive=False))[0]
    assert got.tokens == want and got.speculation["drafted"] > 0


def test_workflows_open_it_and_refuse_cuda(tiny):
    _, infos = tiny
    backend = export_backend(BackendKind.web, infos[Precision.int8], threads=1)
    try:
        assert isinstance(backend, WebBackend)
        assert (backend.name, backend.provider) == ("web", ProviderKind.cpu)
        assert backend.capabilities == Capabilities(runtime="onnxruntime-web's WebAssembly build",
                                                    precisions_by_provider={ProviderKind.cpu: CPU_PRECISIONS},
                                                    takes_past=True, joins_rows=True, rolls_back=True,
                                                    argmax_where_logits_are=True, page=True)
        assert backend.page_info["threads"] == 1
        peak = backend.page_memory_mb()
        assert peak > 10  # the renderer holding the page and its WebAssembly heap
        ids = np.arange(60)[None] + 100
        backend.run(ids, np.ones_like(ids), positions(np.ones_like(ids), 60), None)  # 12 MB of logits, as base64 too
        grown = backend.page_memory_mb()
        backend.reset_page_memory()
        assert 0 < backend.page_memory_mb() <= grown and grown >= peak
    finally:
        backend.close()
    ids = np.array([[1, 2]])
    with pytest.raises(ProviderError, match="closed"):
        backend.step(ids, np.ones_like(ids), positions(np.ones_like(ids), 2), None)
    with pytest.raises(ProviderError, match="no cuda provider"):
        WebBackend(infos[Precision.fp32], ProviderKind.cuda)


def test_an_operator_the_webassembly_build_lacks_is_named(tiny, tmp_path):
    """A graph with an operator whose only kernel is CUDA's: reported in one line naming it."""
    _, infos = tiny
    proto = onnx.load(str(infos[Precision.int8].model_path))
    node = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    node.op_type = "DecoderMaskedMultiHeadAttention"  # a contrib operator with a CUDA kernel only
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("num_heads", 4))
    folder = tmp_path / "cuda-only-op"
    shutil.copytree(infos[Precision.int8].folder, folder)
    onnx.save(proto, str(folder / MODEL_FILE))
    with pytest.raises(ArtifactError) as err:
        WebBackend(ExportInfo(folder, infos[Precision.int8].meta))
    message = str(err.value)
    assert "\n" not in message and "DecoderMaskedMultiHeadAttention" in message, message


def test_a_page_that_fails_to_start_is_one_line_at_once(tiny, tmp_path, monkeypatch):
    """A script error in the page (here a syntax error) is reported from the page, not waited out."""
    broken = tmp_path / "web"
    shutil.copytree(web.WEB_DIR, broken, ignore=shutil.ignore_patterns("node_modules"))
    (broken / "page.mjs").write_text((web.WEB_DIR / "page.mjs").read_text() + "\nconst const = 1;\n")
    monkeypatch.setenv("GPT2X_WEB_MODULES", str(web.node_modules_dir()))
    monkeypatch.setattr(web, "WEB_DIR", broken)
    with pytest.raises(ProviderError, match="page did not start: Unexpected token 'const'") as err:
        WebBackend(tiny[1][Precision.fp32])
    assert "\n" not in str(err.value)


def test_missing_browser_and_npm_package_are_one_line(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2X_CHROMIUM", str(tmp_path / "no-chromium"))
    with pytest.raises(MissingDependencyError, match="not an executable"):
        require_provider([BackendKind.web], ProviderKind.cpu)
    monkeypatch.delenv("GPT2X_CHROMIUM")
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingDependencyError, match="apt-get install chromium"):
        web.chromium_path()
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("GPT2X_WEB_MODULES", str(tmp_path))
    with pytest.raises(MissingDependencyError, match="npm ci --prefix"):
        WebBackend(tiny[1][Precision.fp32])


def test_bench_rows_against_native(tiny, tmp_path, monkeypatch):
    """`gpt2x bench --backends ort,web`: the web rows pass the gate against torch and carry the share of
    native ONNX Runtime, the page's own speed and memory, and what ran them."""
    from gpt2x.bench import run as bench

    model, infos = tiny
    monkeypatch.chdir(tmp_path)  # the bench looks for exports under GPT2X_EXPORTS: the fixture's, copied there
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    shutil.copytree(infos[Precision.int8].folder, default_export_dir(SOURCES["tiny"].name, Precision.int8))
    text = tmp_path / "text.txt"  # perplexity on a short text: the web backend brings every position's logits back
    text.write_text("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.")
    s = bench.BenchSettings(model=SOURCES["tiny"].name, backends=[BackendKind.ort, BackendKind.web], precisions=[Precision.int8],
                            prompt_len=4, new_tokens=6, repeat=1, text=text, greedy_tokens=8)
    # On the bench's clock a forward costs 1 + 1 per new position ms on ort (the prefill 5, a step 2: 500
    # tokens/s) and 4 + 1 on the web backend (8 and 5: 200 tokens/s); the page's own times are its own.
    clock = StepClock(monkeypatch, {OrtBackend: (1, 1), WebBackend: (4, 1)})
    monkeypatch.setattr(bench, "cpu_read_bandwidth", lambda threads: 20e9)  # not what this test checks (test_bench's does)
    result = bench.run_bench(s, {"cpu": "test", "cores": 2}, loaded=(model, SOURCES["tiny"]))
    assert result.passed is True
    assert [p.backend for p in result.parity] == [BackendKind.ort, BackendKind.web]
    assert result.parity[1].source == "measured against torch fp32"
    ort, browser = result.speed
    assert ort.native_share is None and ort.page is None
    assert [ort.ttft_ms, ort.decode_tokens_per_s, browser.ttft_ms, browser.decode_tokens_per_s] == pytest.approx([5, 500, 8, 200])
    assert browser.native_share == pytest.approx(200 / 500) and browser.native_ttft_ratio == pytest.approx(8 / 5)
    # The timed run's decode steps in the page: the page's own time of each (as it reported it) is below
    # the wall time of the same step measured here (it excludes the trip), and makes the page's figures.
    steps = [f for f in clock.forwards if isinstance(f[0], WebBackend)][-(s.new_tokens - 1):]
    assert len(steps) == s.new_tokens - 1 and all(t == 1 and 0 < page_ms < wall_s * 1e3 for _, t, wall_s, page_ms in steps)
    page_rate = len(steps) / (sum(page_ms for *_, page_ms in steps) / 1e3)
    assert page_rate > len(steps) / sum(wall_s for _, _, wall_s, _ in steps)
    assert browser.page.decode_tokens_per_s == pytest.approx(page_rate) and browser.page.native_share == pytest.approx(page_rate / 500)
    assert browser.page.memory_mb > 10
    assert browser.page.info["crossOriginIsolated"] is True and browser.page.info["threads"] == 2
    written = json.loads(result.to_json())
    validate(written, BENCH_SCHEMA)
    assert "native_share" not in written["speed"][0] and "page_memory_mb" not in written["speed"][0]


def test_cli_generate_and_its_errors(tiny, tmp_path, capsys, monkeypatch):
    """In this process (six subprocesses took 17 s of the suite's CPU)."""
    _, infos = tiny
    folder = str(infos[Precision.int4].folder)
    code, out, err = cli(capsys, "generate", "ROMEO:", "--backend", "web", "--onnx", folder, "--greedy", "--max-new-tokens", "8", "--json")
    assert code == 0, err
    row = json.loads(out)
    code, out, err = cli(capsys, "generate", "ROMEO:", "--backend", "ort", "--onnx", folder, "--greedy", "--max-new-tokens", "8", "--json")
    assert row["backend"] == "web" and row["tokens"] == json.loads(out)["tokens"]
    for name, value, words in (("GPT2X_CHROMIUM", str(tmp_path / "none"), "GPT2X_CHROMIUM"),
                               ("GPT2X_WEB_MODULES", str(tmp_path), "npm ci --prefix")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            code, _, err = cli(capsys, "generate", "x", "--backend", "web", "--onnx", folder)
        assert_one_line_error(code, err, MissingDependencyError.exit_code, words)
    code, _, err = cli(capsys, "generate", "x", "--backend", "web", "--provider", "cuda", "--onnx", folder)
    assert code == ProviderError.exit_code and "no cuda provider" in err
    broken = tmp_path / "broken"
    shutil.copytree(infos[Precision.fp32].folder, broken)
    (broken / MODEL_FILE).write_bytes(b"not onnx")
    code, _, err = cli(capsys, "generate", "x", "--backend", "web", "--onnx", str(broken))
    assert code == ArtifactError.exit_code and len(err.strip().splitlines()) == 1, err
