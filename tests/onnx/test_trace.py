"""Tracing once per architecture: a later model of the same config gets the traced graph with its own
weights, byte for byte what tracing it afresh gives (the reference); a graph whose weights cannot be
mapped one to one is traced every time."""

from __future__ import annotations

import pytest
import torch

from gpt2x.model.config import GPT2Config
from gpt2x.model.gpt2 import GPT2
from gpt2x.onnx import trace

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


def test_a_second_model_of_the_architecture_is_refilled_not_traced(traces, afresh, tmp_path, monkeypatch):
    """In this process's memory, and so even where the cache folder cannot be written: that costs only the trace."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(trace.TRACES_ENV, str(blocker / "traces"))  # under a file: mkdir fails
    a, b = model(1), model(2)
    first = trace.trace_to_onnx(a, OPSET)
    assert len(first.graph.node) > 0 and not (blocker / "traces").exists()
    refilled = trace.trace_to_onnx(b, OPSET)
    assert traces == [a]  # b took a's graph
    assert refilled.SerializeToString() == afresh
    assert first.SerializeToString() != afresh  # the weights differ
    scaled = Scaled(CFG).init_weights(1).eval()  # the same config, another forward: its own trace
    trace.trace_to_onnx(scaled, OPSET)
    assert traces == [a, scaled]


class Scaled(GPT2):
    def forward(self, *args, **kwargs):
        logits, presents = super().forward(*args, **kwargs)
        return 2 * logits, presents


def test_weights_that_do_not_map_one_to_one_are_traced_every_time(traces):
    twin = model(3)
    with torch.no_grad():  # the MLP's input weight equals the embedding (both 64 x 16): its folded transpose matches both
        twin.h[0].mlp.c_fc.weight.copy_(twin.wte.weight)
    trace.trace_to_onnx(twin, OPSET)
    assert trace._TEMPLATES[(GPT2, CFG, OPSET, torch.__version__)] is None
    other = model(4)
    trace.trace_to_onnx(other, OPSET)
    assert traces == [twin, other]


def test_a_later_process_takes_the_graph_kept_on_disk(traces, afresh, tmp_path, monkeypatch):
    """GPT2X_TRACES: the first trace is kept there; a process without it in memory refills the kept graph, byte for
    byte what tracing afresh gives, and a kept file that is cut short, or of another architecture, is traced again."""
    kept = tmp_path / "traces"
    monkeypatch.setenv(trace.TRACES_ENV, str(kept))
    a, b = model(1), model(2)
    trace.trace_to_onnx(a, OPSET)
    [file] = kept.iterdir()
    trace._TEMPLATES.clear()  # as a new process
    refilled = trace.trace_to_onnx(b, OPSET)
    assert traces == [a]
    assert refilled.SerializeToString() == afresh

    whole = file.read_bytes()
    file.write_bytes(whole[: len(whole) // 2])
    trace._TEMPLATES.clear()
    trace.trace_to_onnx(b, OPSET)
    assert traces == [a, b] and file.read_bytes() == whole  # traced again, and kept whole again
    wider = GPT2(GPT2Config(vocab_size=64, n_positions=24, n_embd=32, n_layer=1, n_head=2)).init_weights(5).eval()
    file.rename(kept / f"{trace._disk_key(wider, OPSET)}.onnx")  # a file under another architecture's name
    trace._TEMPLATES.clear()
    trace.trace_to_onnx(wider, OPSET)
    assert traces == [a, b, wider]
    assert trace._disk_key(wider, OPSET) != trace._disk_key(b, OPSET) != trace._disk_key(Scaled(CFG), OPSET)
