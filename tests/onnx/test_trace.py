"""Tracing once per architecture: a later model of the same config gets the traced graph with its own
weights, byte for byte what tracing it afresh gives (the reference); a graph whose weights cannot be
mapped one to one is traced every time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from gpt2x.model.config import GPT2Config
from gpt2x.model.gpt2 import GPT2
from gpt2x.onnx import names, trace
from gpt2x.onnx.artifact import DEFAULT_OPSET

CFG = GPT2Config(vocab_size=64, n_positions=24, n_embd=16, n_layer=1, n_head=2)
OPSET = 17


@pytest.fixture
def traces(monkeypatch):
    """An empty cache of traced graphs (this process's; none kept on disk), and the list of models torch's
    exporter traced."""
    monkeypatch.setattr(trace, "_TEMPLATES", {})
    monkeypatch.setenv(trace.TRACES_ENV, "off")
    traced = []
    real = trace._trace

    def counted(model, opset):
        traced.append(model)
        return real(model, opset)

    monkeypatch.setattr(trace, "_trace", counted)
    return traced


def model(seed: int) -> GPT2:
    return GPT2(CFG).init_weights(seed).eval()


@pytest.fixture(scope="module")
def afresh() -> bytes:
    """model(2) traced afresh by torch's exporter, no cache in between: what a refilled graph must equal byte for byte
    (each trace takes seconds; the tests below share this one)."""
    return trace._trace(model(2), OPSET).SerializeToString()


def test_a_second_model_is_refilled_from_memory_or_from_the_graph_a_later_process_finds_on_disk(traces, afresh, tmp_path,
                                                                                                  monkeypatch):
    """A later model of the architecture takes the traced graph with its own weights, byte for byte what tracing it
    afresh gives: from this process's memory, even where the cache folder cannot be written (that costs only the
    trace), and, in a process without it in memory, from GPT2X_TRACES, where the first trace was kept. A kept file cut
    short, or under another architecture's name, is not used; a model with another forward is traced."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(trace.TRACES_ENV, str(blocker / "traces"))  # under a file: mkdir fails
    a, b = model(1), model(2)
    first = trace.trace_to_onnx(a, OPSET).SerializeToString()
    assert not (blocker / "traces").exists()
    refilled = trace.trace_to_onnx(b, OPSET)
    assert traces == [a]  # b took a's graph
    assert refilled.SerializeToString() == afresh and first != afresh  # the weights differ

    kept = tmp_path / "traces"
    monkeypatch.setenv(trace.TRACES_ENV, str(kept))
    trace._TEMPLATES.clear()  # as a new process
    trace.trace_to_onnx(b, OPSET)
    assert traces == [a, b]
    [file] = kept.iterdir()
    trace._TEMPLATES.clear()
    assert trace.trace_to_onnx(a, OPSET).SerializeToString() == first  # a's weights in the graph b's process kept
    assert traces == [a, b]
    scaled = Scaled(CFG).init_weights(1).eval()  # the same config, another forward: its own trace, not a's graph
    trace.trace_to_onnx(scaled, OPSET)
    assert traces == [a, b, scaled]

    whole = file.read_bytes()
    params = trace._parameters(a)
    assert trace._load_template(file, params) is not None
    file.write_bytes(whole[: len(whole) // 2])
    assert trace._load_template(file, params) is None  # cut short: traced again, as with no file
    file.write_bytes(whole)
    wider = GPT2(GPT2Config(vocab_size=64, n_positions=24, n_embd=32, n_layer=1, n_head=2)).init_weights(5).eval()
    file.rename(kept / f"{trace._disk_key(wider, OPSET)}.onnx")  # a file under another architecture's name
    trace._TEMPLATES.clear()
    trace.trace_to_onnx(wider, OPSET)
    assert traces == [a, b, scaled, wider]
    assert len({trace._disk_key(wider, OPSET), trace._disk_key(b, OPSET), trace._disk_key(scaled, OPSET)}) == 3


def test_another_context_length_takes_the_traced_graph_with_its_own_position_rows(traces, tmp_path, monkeypatch):
    """A model that differs only in n_positions (wpe's rows) takes the graph traced for another, from memory and from
    GPT2X_TRACES, and ONNX Runtime runs it as PyTorch runs that model up to its last position: the graph reads the
    context length nowhere else."""
    import onnxruntime as ort

    longer = GPT2(replace(CFG, n_positions=40)).init_weights(2).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = longer(ids)[0].numpy()
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((2, 40), np.int64),
             "position_ids": np.tile(np.arange(40), (2, 1))}
    feeds.update({name(0): np.zeros((2, CFG.n_head, 0, CFG.n_embd // CFG.n_head), np.float32)
                  for name in (names.past_key, names.past_value)})
    monkeypatch.setenv(trace.TRACES_ENV, str(tmp_path / "traces"))
    trace.trace_to_onnx(model(1), DEFAULT_OPSET)
    for _ in range(2):  # from this process's memory, then as a new process from the file the first trace kept
        graph = trace.trace_to_onnx(longer, DEFAULT_OPSET).SerializeToString()
        got = ort.InferenceSession(graph, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
        trace._TEMPLATES.clear()
    assert len(traces) == 1
    assert len(list((tmp_path / "traces").iterdir())) == 1


class Scaled(GPT2):
    def forward(self, *args, **kwargs):
        logits, presents = super().forward(*args, **kwargs)
        return 2 * logits, presents


def test_weights_that_do_not_map_one_to_one_are_traced_every_time(traces):
    twin = model(3)
    with torch.no_grad():  # the MLP's input weight equals the embedding (both 64 x 16): its folded transpose matches both
        twin.h[0].mlp.c_fc.weight.copy_(twin.wte.weight)
    trace.trace_to_onnx(twin, OPSET)
    assert trace._TEMPLATES[(GPT2, trace._architecture(twin), OPSET, torch.__version__)] is None
    other = model(4)
    trace.trace_to_onnx(other, OPSET)
    assert traces == [twin, other]


def test_processes_tracing_one_architecture_at_once_take_turns(traces, afresh, tmp_path, monkeypatch):
    """Two tracers of one architecture at once with a cache folder (two `gpt2x export` processes; here two threads, as
    the lock is the operating system's): the first traces and keeps the graph, the other waits for it and refills it
    with its own weights; the folder holds the graph alone."""
    import threading
    import time

    import onnx

    monkeypatch.setenv(trace.TRACES_ENV, str(tmp_path / "traces"))
    traced = []

    def slow(model, opset):  # the exporter's graph of model(2), taking the time a trace takes
        traced.append(model)
        time.sleep(0.5)
        return onnx.load_from_string(afresh)

    monkeypatch.setattr(trace, "_trace", slow)
    graphs: list = [None, None]

    def export(i: int) -> None:
        graphs[i] = trace.trace_to_onnx(model(2), OPSET).SerializeToString()

    threads = [threading.Thread(target=export, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(traced) == 1 and graphs == [afresh, afresh]
    assert [p.suffix for p in (tmp_path / "traces").iterdir()] == [".onnx"]
