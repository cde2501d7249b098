"""runtime/providers.py: the options every ONNX Runtime session gpt2x opens is given."""

from __future__ import annotations

import subprocess
import sys

import onnxruntime as ort
import pytest

from gpt2x.errors import UsageError
from gpt2x.runtime.providers import SPIN_ENV, SPIN_KEY, SPIN_US, session_options


def spin_of(options: ort.SessionOptions) -> str | None:
    try:
        return options.get_session_config_entry(SPIN_KEY)
    except RuntimeError:  # ONNX Runtime's answer for a key never set: its own default applies
        return None


def test_sessions_spin_a_millisecond_after_a_run_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert SPIN_US == 1000 and spin_of(session_options(2)) == "1000"
    monkeypatch.setenv(SPIN_ENV, "250")
    assert spin_of(session_options(2)) == "250"
    monkeypatch.setenv(SPIN_ENV, "default")
    assert spin_of(session_options(2)) is None
    for bad in ("abc", "-5", "1.5", ""):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(UsageError, match=SPIN_ENV):
            session_options(2)


def test_a_bad_spin_is_one_line_from_the_command_before_any_session(export_dir, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", SPIN_ENV: "soon"}
    r = subprocess.run([sys.executable, "-m", "gpt2x", "generate", "ROMEO:", "--onnx", str(export_dir),
                        "--max-new-tokens", "2"], capture_output=True, text=True, encoding="utf-8", env=env, timeout=120)
    assert r.returncode == UsageError.exit_code, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {SPIN_ENV} must be a whole number of microseconds or 'default', "
                                             "got 'soon'"]
