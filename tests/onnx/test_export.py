"""The ONNX export and ONNX Runtime backend against the PyTorch model (a second, independent backend):
random shapes with empty past and left padding, step-by-step decoding, the bundled model's greedy
tokens, int8's gate, metadata, and what happens when things go wrong."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2x.choices import Precision, ProviderKind
from gpt2x.errors import ArtifactError, OutputError, ParityError, ProviderError, UsageError
from gpt2x.evaluate import parity
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.model.checkpoints import ModelSource
from gpt2x.model.config import GPT2Config
from gpt2x.model.gpt2 import GPT2
from gpt2x.model.weights import load_model
from gpt2x.onnx import artifact, build, optimize
from gpt2x.onnx import names as io
from gpt2x.onnx.artifact import read_export
from gpt2x.onnx.interop import INTEROP_FILES
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.providers import available_providers
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.workflows.exports import export_model as export

from ..helpers import make_hf_model, run_cli

REL_TOL = parity.TOLERANCES[Precision.fp32].max_rel
CUDA_LOADS = available_providers()["loadable"]["cuda"] == "ok"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_hf_model(folder, seed=11)
    model, source = load_model(str(folder))
    info = export(model, source, tmp_path_factory.mktemp("exp") / "tiny-fp32")
    return model, source, info


@pytest.fixture(scope="module")
def bundled(bundled_export):
    """The bundled model, and the folder of its exports (the run's shared ones; fp32 made here if first)."""
    model, source = load_model("shakespeare")
    return model, source, bundled_export(Precision.fp32).folder.parent


def rel_err(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(ref - got).max() / np.abs(ref).max())


@pytest.mark.parametrize("batch,past,seq,pad", [(1, 0, 9, 0), (3, 0, 6, 2), (2, 5, 1, 0), (4, 7, 4, 3), (1, 20, 3, 0)])
def test_ort_logits_and_presents_match_torch(tiny, batch, past, seq, pad):
    model, _, info = tiny
    ort_b = OrtBackend(info)
    gen = torch.Generator().manual_seed(batch * 100 + past)
    ids = torch.randint(0, 50257, (batch, past + seq), generator=gen)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    mask[0, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        _, torch_past = model(ids[:, :past], mask[:, :past], pos[:, :past]) if past else (None, None)
        ref, ref_present = model(ids[:, past:], mask, pos[:, past:], torch_past)
    ort_past = ort_b.past_from_numpy([t.numpy() for kv in torch_past for t in kv]) if past else None
    got, present = ort_b.run(ids[:, past:].numpy(), mask.numpy(), pos[:, past:].numpy(), ort_past)
    real = mask[:, past:].bool().numpy()
    assert got.shape == (batch, seq, 50257)
    assert rel_err(ref.numpy()[real], got[real]) <= REL_TOL
    arrays = present.to_numpy()
    held = mask.bool().numpy()  # a padded position's entry is never read: what a layer past the first holds there is not the model's
    for (k, v), ok, ov in zip(ref_present, arrays[0::2], arrays[1::2]):
        assert ok.shape == (batch, model.config.n_head, past + seq, model.config.head_dim)
        for ref_kv, got_kv in ((k.numpy(), ok), (v.numpy(), ov)):
            assert rel_err(ref_kv.transpose(0, 2, 1, 3)[held], got_kv.transpose(0, 2, 1, 3)[held]) <= REL_TOL


def test_step_by_step_onnx_equals_full_torch_forward(tiny):
    model, _, info = tiny
    ort_b = OrtBackend(info)
    ids = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :2] = 0  # second row left-padded
    with torch.no_grad():
        full, _ = model(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
    past = None
    for t in range(12):
        m = mask[:, : t + 1].numpy()
        pos = np.maximum(m.cumsum(-1) - 1, 0)[:, -1:]
        logits, past = ort_b.run(ids[:, t : t + 1].numpy(), m, pos, past)
        real = mask[:, t].bool().numpy()
        assert rel_err(full[:, t].numpy()[real], logits[:, 0][real]) <= REL_TOL


@pytest.mark.parametrize("batch,past,seq", [(1, 0, 9), (3, 0, 6), (2, 5, 4), (2, 5, 1)])
def test_logits_to_keep_gives_the_last_positions_of_the_full_logits(tiny, batch, past, seq):
    """The graph's optional logits_to_keep input, fed directly (as a user of the graph would), against
    the same graph's full logits and against PyTorch's; and `step` (which keeps 1) against `run`."""
    import onnxruntime as ort

    model, _, info = tiny
    backend = OrtBackend(info, in_place_kv=False)  # the export's own graph, whose session is fed directly below
    rng = np.random.default_rng(batch * 10 + seq)
    ids = rng.integers(0, 50257, (batch, past + seq), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :2] = 0  # left padding
    pos = np.maximum(mask.cumsum(-1) - 1, 0)
    cache = backend.run(ids[:, :past], mask[:, :past], pos[:, :past], None)[1] if past else None
    full, _ = backend.run(ids[:, past:], mask, pos[:, past:], cache)
    feeds = {io.INPUT_IDS: ids[:, past:], io.ATTENTION_MASK: mask, io.POSITION_IDS: pos[:, past:]}
    past_arrays = cache.to_numpy() if past else \
        [np.zeros((batch, model.config.n_head, 0, model.config.head_dim), np.float32)] * (2 * model.config.n_layer)
    feeds |= dict(zip(io.input_names(model.config.n_layer)[3:], past_arrays))
    for k in (1, 3, seq + 5):
        got = backend.session.run([io.LOGITS], feeds | {io.LOGITS_TO_KEEP: np.array(k, np.int64)})[0]
        assert got.shape == (batch, min(k, seq), 50257)
        np.testing.assert_allclose(got, full[:, seq - min(k, seq):], rtol=0, atol=1e-5)
    with torch.no_grad():
        torch_past = model(torch.from_numpy(ids[:, :past]), torch.from_numpy(mask[:, :past]), torch.from_numpy(pos[:, :past]))[1] if past else None
        ref = model(torch.from_numpy(ids[:, past:]), torch.from_numpy(mask), torch.from_numpy(pos[:, past:]), torch_past,
                    logits_to_keep=1)[0]
    assert ref.shape == (batch, 1, 50257)
    cache = backend.run(ids[:, :past], mask[:, :past], pos[:, :past], None)[1] if past else None
    last, _ = backend.step(ids[:, past:], mask, pos[:, past:], cache)
    np.testing.assert_allclose(last, full[:, -1], rtol=0, atol=1e-5)
    assert rel_err(ref[:, -1].numpy(), last) <= REL_TOL
    assert isinstance(backend.logits_to_keep[1], ort.OrtValue)  # the graph has the input: step used it


def test_graph_io_names_and_fusions(tiny):
    import onnx

    _, _, info = tiny
    proto = onnx.load(str(info.model_path), load_external_data=False)
    n = info.config.n_layer
    # logits_to_keep is an overridable default: loaders that list the required inputs (Optimum,
    # onnxruntime-genai) see exactly the conventional ones
    assert [i.name for i in proto.graph.input] == io.input_names(n) + [io.LOGITS_TO_KEEP]
    assert [i.name for i in OrtBackend(info).session.get_inputs()] == io.input_names(n)
    assert [o.name for o in proto.graph.output] == io.output_names(n)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    assert dims[io.past_key(0)] == [io.BATCH, info.config.n_head, io.PAST, info.config.head_dim]
    assert proto.ir_version == artifact.IR_VERSION
    counts = info.meta["fused_operators"]
    assert counts["MultiHeadAttention"] == n and counts["FastGelu"] == n
    assert counts["SkipLayerNormalization"] >= 2 * n


def test_metadata_round_trip_and_checks(tiny, tmp_path):
    _, _, info = tiny
    again = read_export(info.folder)
    assert again.meta == info.meta and again.config == info.config
    assert info.meta["parity"]["status"] == "passed"
    assert info.meta["versions"]["onnxruntime"]
    folder = tmp_path / "copy"
    shutil.copytree(info.folder, folder)
    meta = json.loads((folder / "gpt2x.json").read_text())
    (folder / "gpt2x.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ArtifactError, match="format version 99"):
        read_export(folder)
    (folder / "gpt2x.json").write_text(json.dumps({**meta, "tokenizer": {"vocab.bpe": "0"}}))
    with pytest.raises(ArtifactError, match="tokenizer"):
        read_export(folder)
    (folder / "gpt2x.json").write_text(json.dumps(meta))
    data = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ArtifactError, match="corrupt"):
        read_export(folder)
    (folder / "model.onnx").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        read_export(folder)


def test_truncated_graph_is_refused_even_without_hashes(tiny, tmp_path):
    from gpt2x.runtime.providers import create_session

    _, _, info = tiny
    folder = tmp_path / "t"
    shutil.copytree(info.folder, folder)
    data = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(data[:1000])
    with pytest.raises(ArtifactError, match="corrupt or changed since export .1000 bytes"):
        read_export(folder)  # the size recorded at export
    meta = json.loads((folder / "gpt2x.json").read_text())
    del meta["sizes"]  # an export made before sizes were recorded: the graph's own structure tells
    (folder / "gpt2x.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="not a readable ONNX file"):
        read_export(folder)
    with pytest.raises(ArtifactError, match="cannot load"):
        create_session(folder / "model.onnx", ProviderKind.cpu)


def test_loading_parses_no_weights_and_verify_hashes_everything(tiny, tmp_path, monkeypatch):
    """Opening an export reads no weights (onnx.load is not called) and hashes nothing; `verify_export`
    and `gpt2x verify` hash every file, and find a changed byte that keeps the size."""
    import onnx

    _, _, info = tiny
    folder = tmp_path / "v"
    shutil.copytree(info.folder, folder)
    data = bytearray((folder / "model.onnx").read_bytes())
    data[-100] ^= 0xFF  # inside the last weights: same size, still a well-formed protobuf
    (folder / "model.onnx").write_bytes(bytes(data))

    def refuse(*a, **k):
        raise AssertionError("onnx.load called while opening an export")

    with monkeypatch.context() as m:
        m.setattr(onnx, "load", refuse)
        m.setattr(onnx, "load_model", refuse)
        m.setattr(artifact, "sha256", refuse)
        assert read_export(folder).meta == info.meta
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        artifact.verify_export(folder)
    r = run_cli("verify", str(folder))
    assert r.returncode == ArtifactError.exit_code and "sha256 mismatch" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("verify", str(info.folder), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["ok"] and set(got["files"]) == set(info.meta["files"])
    assert all(got["files"][n]["bytes"] == (info.folder / n).stat().st_size for n in got["files"])


def _external_model(folder):
    """A model whose tensors sit in every place ONNX allows, each stored as external data in its own
    file: an initializer, a Constant's attribute, a subgraph's initializer, a sparse initializer's
    values, and a function's Constant."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def external(name: str, location: str):
        t = numpy_helper.from_array(np.arange(4, dtype=np.float32), name)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", "16")):
            t.external_data.add(key=k, value=v)
        (folder / location).write_bytes(np.arange(4, dtype=np.float32).tobytes())
        return t

    then = helper.make_graph([helper.make_node("Identity", ["sub_w"], ["y_then"])], "then", [],
                             [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [4])],
                             initializer=[external("sub_w", "sub.bin")])
    other = helper.make_graph([helper.make_node("Constant", [], ["y_else"], value=external("c2", "else.bin"))], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [4])])
    sparse = helper.make_sparse_tensor(external("sp", "sparse.bin"), numpy_helper.from_array(np.arange(4, dtype=np.int64), "spi"), [8])
    function = helper.make_function("local", "F", [], ["fo"], [helper.make_node("Constant", [], ["fo"], value=external("cf", "function.bin"))],
                                    [helper.make_opsetid("", 18)])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=external("c1", "attr.bin")),
         helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
         helper.make_node("F", [], ["f"], domain="local")],
        "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[external("w", "weights.bin")], sparse_initializer=[sparse],
    )
    model = helper.make_model(graph, functions=[function],
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)])
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))  # as built: save_model would otherwise rewrite the external data
    return path


def test_external_data_locations_read_from_the_wire_format(tmp_path):
    """Against onnx's own parse of the same file: every place a tensor can sit is found, nothing else."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    path = _external_model(tmp_path)
    proto = onnx.load(str(path), load_external_data=False)
    reference = {e.value for t in _get_all_tensors(proto) for e in t.external_data if e.key == "location"}
    assert reference >= {"weights.bin", "attr.bin", "sub.bin", "else.bin"}  # onnx's walk (no sparse, no functions)
    assert artifact.external_data_locations(path) == reference | {"sparse.bin", "function.bin"}
    (tmp_path / "sub.bin").unlink()
    with pytest.raises(ArtifactError, match="sub.bin is missing"):
        artifact.check_external_data(path)


def test_truncated_or_garbage_graphs_fail_with_value_error(tiny, tmp_path):
    """Every truncation of a real graph, and bytes that are not protobuf, give ValueError (shown as
    'not a readable ONNX file') or, cut exactly between two fields, a file whose locations are read:
    never another exception."""
    _, _, info = tiny
    data = info.model_path.read_bytes()
    rng = np.random.default_rng(0)
    cuts = sorted({*rng.integers(1, len(data), 200).tolist(), 1, 2, 10, len(data) - 1})
    path = tmp_path / "cut.onnx"
    for cut in cuts:
        path.write_bytes(data[:cut])
        try:
            assert artifact.external_data_locations(path) == set()
        except ValueError:
            pass
    for junk in (b"", b"\xff" * 64, b"hello world, not an onnx file", rng.bytes(4096)):
        path.write_bytes(junk)
        with pytest.raises(ArtifactError, match="not a readable ONNX file"):
            artifact.check_external_data(path)


def test_existing_output_needs_force(tiny):
    model, source, info = tiny
    with pytest.raises(OutputError):
        export(model, source, info.folder)


def test_interrupted_export_leaves_nothing(tiny, tmp_path, monkeypatch):
    model, source, _ = tiny

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "fuse", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export(model, source, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_parity_gate_fails_a_perturbed_export(tiny, tmp_path, monkeypatch):
    """An export whose graph differs from the model (one weight nudged after tracing) is refused."""
    model, source, _ = tiny
    real_fuse = build.fuse

    def fuse_then_perturb(raw, out, cfg, precision):
        from onnx import numpy_helper

        for init in raw.graph.initializer:  # the traced graph, in memory at this size
            arr = numpy_helper.to_array(init)
            if arr.ndim == 2 and arr.shape[0] == cfg.n_embd:  # a projection matrix
                init.CopyFrom(numpy_helper.from_array(arr + 1e-2, init.name))
                break
        else:
            raise AssertionError("no projection matrix to perturb")
        return real_fuse(raw, out, cfg, precision)

    monkeypatch.setattr(build, "fuse", fuse_then_perturb)
    with pytest.raises(ParityError, match="out of tolerance"):
        export(model, source, tmp_path / "bad")
    assert list(tmp_path.iterdir()) == []


def test_bundled_greedy_identical_on_torch_and_ort(bundled):
    model, source, root = bundled
    info = read_export(root / "shakespeare-fp32")
    s = SamplingSettings(max_new_tokens=64, greedy=True)
    prompts = ["ROMEO:", "KING HENRY VI:\nWhat"]
    ref = generate(TorchBackend(model), prompts, s)
    got = generate(OrtBackend(info), prompts, s)
    assert [r.tokens for r in ref] == [r.tokens for r in got]
    assert all(len(r.tokens) == 64 for r in ref)  # really 64 tokens, no early EOS
    sampled = SamplingSettings(max_new_tokens=32, seed=7, top_k=0)
    assert [r.tokens for r in generate(TorchBackend(model), prompts, sampled)] == \
        [r.tokens for r in generate(OrtBackend(info), prompts, sampled)]


def test_beam_search_on_ort_equals_torch(bundled):
    model, source, root = bundled
    info = read_export(root / "shakespeare-fp32")
    s = SamplingSettings(max_new_tokens=12, num_beams=3)
    assert [r.tokens for r in generate(TorchBackend(model), ["ROMEO:"], s)] == \
        [r.tokens for r in generate(OrtBackend(info), ["ROMEO:"], s)]


def test_int8_export_passes_its_gate(bundled, bundled_export):
    model, source, root = bundled
    info = bundled_export(Precision.int8)  # made by the export, through its gate
    p = info.meta["parity"]
    assert p["status"] == "passed"
    assert info.meta["fused_operators"].get("MatMulNBits", 0) == 4 * model.config.n_layer + 1  # unembedding too
    # Recomputed from scratch on real text: a trained model's confident predictions survive int8,
    # and the next-token distributions stay within the gate's KL.
    from gpt2x.tokenizer import encode

    ids = torch.tensor([encode("ROMEO:\nBut soft, what light through yonder window breaks? It is the east")])
    n = ids.shape[1]
    with torch.no_grad():
        ref = model(ids)[0].numpy()[0].astype(np.float64)
    got, _ = OrtBackend(info).run(ids.numpy(), np.ones((1, n), np.int64), np.arange(n)[None], None)
    got = got[0].astype(np.float64)
    assert (ref.argmax(-1) == got.argmax(-1)).mean() >= 0.9
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(got - got.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    assert (p * np.log(p / q)).sum(-1).mean() <= parity.TOLERANCES[Precision.int8].max_kl


def test_fp16_exports_on_cpu_but_refuses_to_run_there(tiny, tmp_path):
    model, source, _ = tiny
    info = export(model, source, tmp_path / "fp16", Precision.fp16)
    proto_dtype = {i.name: i.type.tensor_type.elem_type for i in __import__("onnx").load(str(info.model_path)).graph.output}
    assert proto_dtype[io.LOGITS] == 1 and proto_dtype[io.present_key(0)] == 10  # fp32 logits, fp16 cache
    # Gated on CUDA where it loads, recorded as not gated (and why) where it does not.
    want = "passed" if CUDA_LOADS else "skipped"
    assert info.meta["parity"]["status"] == want, info.meta["parity"]
    with pytest.raises(ProviderError, match="CUDA only"):
        OrtBackend(info, ProviderKind.cpu)


def test_cuda_request_runs_on_cuda_or_is_one_line_error(tiny):
    """Where CUDA loads, --provider cuda generates the CPU's greedy tokens; elsewhere it is one line."""
    _, _, info = tiny
    r = run_cli("generate", "hi", "--onnx", str(info.folder), "--provider", "cuda", "--greedy", "--max-new-tokens", "8", "--json")
    if CUDA_LOADS:
        cpu = run_cli("generate", "hi", "--onnx", str(info.folder), "--greedy", "--max-new-tokens", "8", "--json")
        assert r.returncode == 0 == cpu.returncode, r.stderr
        assert json.loads(r.stdout)["tokens"] == json.loads(cpu.stdout)["tokens"]
        return
    assert r.returncode == ProviderError.exit_code
    assert r.stderr.strip().count("\n") == 0 and "CUDAExecutionProvider" in r.stderr
    assert "Traceback" not in r.stderr


def test_gpt2_124m_widths_export_parity(tmp_path):
    """GPT-2 124M's widths (768 wide, 12 heads, 50,257 tokens, 1,024 positions) in two of its twelve layers, random
    weights: export, gate, and an independent check. More layers repeat the same block (and took a minute of the
    suite); `gpt2x inspect gpt2` counts the whole 124M (test_architecture)."""
    model = GPT2(replace(GPT2Config(), n_layer=2)).init_weights(seed=0).eval()
    source = ModelSource("random:gpt2, 2 layers", "random", Path("."), None)
    info = export(model, source, tmp_path / "g124")
    assert info.meta["parity"]["status"] == "passed"
    ids = torch.randint(0, 50257, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)[0].numpy()
    got, _ = OrtBackend(info).run(ids.numpy(), np.ones((1, 24), np.int64), np.arange(24)[None], None)
    assert rel_err(ref, got) <= REL_TOL


def test_external_data_export_and_its_checks(tiny, tmp_path, monkeypatch):
    """Past the size limit the weights go to model.onnx.data; missing or escaping data is refused."""
    import onnx

    model, source, _ = tiny
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_BYTES", 10_000)
    monkeypatch.setattr(artifact, "EXTERNAL_MIN_BYTES", 64)  # biases external too, as in gpt2-xl
    info = export(model, source, tmp_path / "ext")
    assert (info.folder / artifact.DATA_FILE).is_file() and artifact.DATA_FILE in info.meta["files"]
    assert info.meta["parity"]["status"] == "passed"
    assert info.meta["fused_operators"] == tiny[2].meta["fused_operators"]  # graph-only fusion, same result
    assert {p.name for p in info.folder.iterdir()} == {"gpt2x.json", "model.onnx", "model.onnx.data", *INTEROP_FILES}
    # Its weights beside the graph: `generate` keeps the growing cache (fixed_cache=None) or says why not (True).
    backend = OrtBackend(info)
    assert "weights are in a data file" in backend.fixed_refusal()
    settings = SamplingSettings(max_new_tokens=4, greedy=True)
    assert generate(backend, ["ROMEO:"], settings, fixed_cache=None)[0].decoder is None
    with pytest.raises(UsageError, match="kv_cache fixed: its weights are in a data file"):
        generate(backend, ["ROMEO:"], settings, fixed_cache=True)
    folder = tmp_path / "evil"
    shutil.copytree(info.folder, folder)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../etc/passwd"
    onnx.save(proto, str(folder / "model.onnx"))
    with pytest.raises(ArtifactError, match="outside the export folder"):
        artifact.check_external_data(folder / "model.onnx")
    (info.folder / artifact.DATA_FILE).unlink()
    with pytest.raises(ArtifactError, match="missing"):
        read_export(info.folder)


def test_unwritable_output_and_disk_full(tiny, tmp_path, monkeypatch):
    model, source, _ = tiny
    with pytest.raises(OutputError, match="cannot write"):
        export(model, source, __import__("pathlib").Path("/proc/gpt2x-test/out"))

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(optimize, "save_onnx", disk_full)  # the first write of a graph into the export
    with pytest.raises(OutputError, match="No space left"):
        export(model, source, tmp_path / "full")
    assert list(tmp_path.iterdir()) == []


def test_export_must_match_the_model_it_serves(bundled, tiny):
    from gpt2x.workflows.exports import check_export_matches

    model, source, root = bundled
    info = read_export(root / "shakespeare-fp32")
    check_export_matches(info, "shakespeare", None)  # the right model: accepted
    stale = artifact.ExportInfo(info.folder, {**info.meta, "model": {**info.meta["model"], "weights_sha256": "0" * 64}})
    with pytest.raises(ArtifactError, match="other shakespeare weights"):
        check_export_matches(stale, "shakespeare", None)
    with pytest.raises(ArtifactError, match="config differs"):
        check_export_matches(tiny[2], "shakespeare", None)


def test_stale_partial_of_a_killed_export_is_removed(tiny, tmp_path):
    model, source, _ = tiny
    dead = tmp_path / ".out.partial-999999999-abc"  # no such process
    dead.mkdir()
    (dead / "model.onnx").write_bytes(b"half")
    info = export(model, source, tmp_path / "out")
    assert not dead.exists() and info.folder.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("precision,limit", [(Precision.int8, 10_000), (Precision.fp16, 10_000), (Precision.fp16, 5_000_000)])
def test_external_data_path_for_lossy_precisions(tiny, tmp_path, monkeypatch, precision, limit):
    """The graph-only fusion of large models feeds int8 quantization and fp16 conversion too; with
    limit 5 MB the fp32 weights (6.5 MB) go external but the fp16 ones (3.3 MB) fit in the graph."""
    import onnx

    model, source, _ = tiny
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_BYTES", limit)
    monkeypatch.setattr(artifact, "EXTERNAL_MIN_BYTES", 64)
    info = export(model, source, tmp_path / precision.value, precision, openvino_prefill=False)
    assert info.meta["parity"]["status"] in ("passed", "skipped")  # fp16 is skipped without CUDA
    ops = info.meta["fused_operators"]
    attention = "GroupQueryAttention" if precision is Precision.int8 else "MultiHeadAttention"
    assert ops[attention] == model.config.n_layer and ops["FastGelu"] == model.config.n_layer
    if precision is Precision.int8:
        assert ops["MatMulNBits"] == 4 * model.config.n_layer + 1
    # Every file is the metadata, the graph, or data the graph refers to: nothing stale stays behind.
    proto = onnx.load(str(info.model_path), load_external_data=False)
    referenced = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert {p.name for p in info.folder.iterdir()} == {"gpt2x.json", "model.onnx", *INTEROP_FILES} | referenced
    if limit == 5_000_000:
        assert referenced == set()
    read_export(info.folder)
