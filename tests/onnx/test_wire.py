"""The ONNX field numbers that reading an export walks without importing onnx (onnx/wire.py's FIELDS), each checked
against onnx's own protobuf descriptors."""

from __future__ import annotations

import onnx
import pytest

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
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
