"""The ONNX field numbers that reading an export walks without importing onnx (onnx/wire.py's FIELDS), each checked
against onnx's own protobuf descriptors."""

from __future__ import annotations

import onnx
import pytest

from gpt2x.choices import Precision
from gpt2x.onnx import wire


@pytest.mark.parametrize("message,name", sorted(wire.FIELDS))
def test_each_field_number_is_onnx_protos(message, name):
    assert wire.field(message, name) == wire.number(getattr(onnx, message), name)


def test_the_cli_and_reading_an_export_import_no_onnx(export_dir):
    """onnx's import (ml_dtypes') took 0.8-2 s of every command's start: the CLI's commands, reading an export and
    mapping its graph for ONNX Runtime do without it (a graph rewritten in memory imports it where it is made)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import gpt2x.cli.app\n"
            "from pathlib import Path\n"
            "from gpt2x.onnx.artifact import read_export\n"
            "from gpt2x.onnx.mapped import mapped_model\n"
            f"info = read_export(Path({str(export_dir)!r}))\n"
            "data, weights = mapped_model(info.model_path)\n"
            "assert data and weights\n"
            "print(sorted(m for m in sys.modules if m == 'onnx' or m.startswith('onnx.')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_later_process_takes_the_rewritten_twin_without_onnx_and_a_damaged_one_is_made_again(export_dir, tmp_path):
    """An fp32 export runs as its GroupQueryAttention twin, rewritten by onnx at load: the rewrite is kept
    (onnx.graph_cache), a later process reads it back importing no onnx and gives the same greedy tokens; a kept graph
    whose bytes changed is not used but rewritten (onnx imported again), with the same tokens."""
    import os
    import subprocess
    import sys

    code = ("import sys\n"
            "from pathlib import Path\n"
            "from gpt2x.onnx.artifact import read_export\n"
            "from gpt2x.runtime.ort import OrtBackend\n"
            "from gpt2x.generation.generate import generate\n"
            "from gpt2x.generation.settings import SamplingSettings\n"
            f"b = OrtBackend(read_export(Path({str(export_dir)!r})))\n"
            "assert b.in_place_kv is True\n"
            "r = generate(b, ['ROMEO:'], SamplingSettings(max_new_tokens=8, greedy=True))[0]\n"
            "print(r.tokens, 'onnx' in sys.modules)\n")
    env = {**os.environ, "GPT2X_GRAPHS": str(tmp_path / "graphs")}

    def run() -> tuple[str, bool]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8", timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        tokens, imported = r.stdout.strip().rsplit(" ", 1)
        return tokens, imported == "True"

    made, imported = run()
    assert imported and len(list((tmp_path / "graphs").glob("*.onnx"))) == 1  # rewritten here, and kept
    assert run() == (made, False)  # read back: no onnx
    kept = next((tmp_path / "graphs").glob("*.onnx"))
    data = kept.read_bytes()
    kept.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    assert run() == (made, True)  # its checksum failed: rewritten, the same tokens
    assert run() == (made, False)  # and kept whole again


def test_a_later_process_opens_the_slots_from_their_kept_graphs_without_onnx(tiny_export, tmp_path):
    """The fixed slots (the server's CPU backend) run graphs rewritten at load: the prompt's, the decode step's and the
    mixed step's, each reading an int8 cache where the slots hold one. They are kept (onnx.graph_cache), and a later
    process opens the slots from them importing no onnx (about a second of a server's start), with the same greedy
    tokens; an export's graphs for an int8 cache are kept apart from those for a float one."""
    import os
    import subprocess
    import sys

    kv8 = tiny_export(Precision.int8, int8_kv=True)[2].folder
    code = ("import os, sys\n"
            "from pathlib import Path\n"
            "from gpt2x.onnx.artifact import read_export\n"
            "from gpt2x.runtime.static_decode import SlotBackend\n"
            "from gpt2x.generation.generate import generate\n"
            "from gpt2x.generation.settings import SamplingSettings\n"
            "for folder, dtype in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    os.environ['GPT2X_KV_CACHE_DTYPE'] = dtype\n"
            "    b = SlotBackend(read_export(Path(folder)), threads=1, slots=4)\n"
            "    assert b.kv_dtype.__name__ == ('int8' if dtype == 'int8' else 'float32'), b.kv_dtype\n"
            "    r = generate(b, ['ROMEO:', 'JULIET: O Romeo'], SamplingSettings(max_new_tokens=8, greedy=True))\n"
            "    print([g.tokens for g in r])\n"
            "print('onnx' in sys.modules)\n")
    env = {**os.environ, "GPT2X_GRAPHS": str(tmp_path / "graphs")}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code, str(kv8), "float", str(kv8), "int8"], capture_output=True,
                           text=True, encoding="utf-8", timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout.split())
    (*made, imported), (*again, imported_again) = runs
    assert imported == "True" and len(list((tmp_path / "graphs").glob("*.onnx"))) == 6  # 3 graphs for each cache, kept
    assert again == made and imported_again == "False"


def test_an_unwritable_graphs_folder_keeps_nothing_and_fails_nothing(tmp_path, monkeypatch):
    """A read-only home (a container's): nothing is kept, nothing raises, and OpenVINO compiles without its cache."""
    import numpy as np

    from gpt2x.onnx.graph_cache import GRAPHS_ENV, InMemoryGraph, load_graph, save_graph
    from gpt2x.runtime.openvino_prefill import openvino_cache_dir

    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(GRAPHS_ENV, str(blocked / "graphs"))
    graph = InMemoryGraph(b"graph", {"w": np.zeros(2, np.float32)}, {})
    save_graph("k", graph)
    assert load_graph("k", graph.weights) is None and openvino_cache_dir() is None
    monkeypatch.setenv(GRAPHS_ENV, str(tmp_path / "graphs"))
    save_graph("k", graph)
    kept = load_graph("k", graph.weights)
    assert kept is not None and kept.graph == b"graph" and openvino_cache_dir() == tmp_path / "graphs" / "openvino"
    monkeypatch.setenv(GRAPHS_ENV, "off")
    assert load_graph("k", graph.weights) is None and openvino_cache_dir() is None
