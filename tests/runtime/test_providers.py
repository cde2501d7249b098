"""runtime/providers.py: the options every ONNX Runtime session gpt2x opens is given, and the weights it is handed."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from gpt2x.choices import Precision, ProviderKind
from gpt2x.errors import UsageError
from gpt2x.onnx.mapped import mapped_model
from gpt2x.runtime.providers import SPIN_ENV, SPIN_KEY, SPIN_US, create_session, session_options


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


def _feed(session, T: int = 5) -> dict[str, np.ndarray]:
    """A prompt of T tokens on an empty past for an export's graph (its past's dims from the graph's inputs)."""
    feed = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feed[i.name] = (np.arange(T, dtype=np.int64) * 7 % 50)[None]
        elif i.name in ("attention_mask", "position_ids"):
            feed[i.name] = np.ones((1, T), np.int64) if i.name == "attention_mask" else np.arange(T, dtype=np.int64)[None]
        else:  # past_key_values.*: [1, heads, 0, head_dim]
            feed[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    return feed


def test_a_session_copies_the_mapped_weights_it_is_given(tiny_export):
    """create_session on an export's mapped weights: ONNX Runtime copies them into the session (AddExternalInitializers'
    contract), which lets the backends let the mapped file go once their sessions are made. The arrays zeroed after the
    session is made leave its logits as they were; a session that read them where they are would change."""
    info = tiny_export(Precision.fp32)[2]
    graph, weights = mapped_model(info.model_path)
    session = create_session(graph, ProviderKind.cpu, 1, weights=weights)
    feed = _feed(session)
    before = session.run(["logits"], feed)[0]
    for array in weights.values():
        array[...] = 0  # the mapping's private pages: the file itself is untouched
    after = session.run(["logits"], feed)[0]
    assert np.abs(before).max() > 0
    np.testing.assert_array_equal(after, before)
    fresh = create_session(graph, ProviderKind.cpu, 1, weights=weights).run(["logits"], feed)[0]
    assert not np.array_equal(fresh, before)  # the zeroed weights do reach a session made from them


def _mapped_graphs(folder) -> list[str]:
    """The lines of /proc/self/maps that map an ONNX graph file of `folder`."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line and ".onnx" in line]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize("backend", ["ort", "slots"])
def test_an_opened_backend_holds_no_mapping_of_its_graphs(tiny_export, backend):
    """Once its sessions are made, a backend holds no array of the mapped graph file (ONNX Runtime copied them): the
    mapping's pages (the weights' size again, counted in the process's resident memory) are let go."""
    from gpt2x.runtime.ort import OrtBackend
    from gpt2x.runtime.static_decode import SlotBackend

    info = tiny_export(Precision.fp32)[2]
    opened = OrtBackend(info, threads=1) if backend == "ort" else SlotBackend(info, threads=1, slots=2)
    if backend == "slots":
        opened.warm_up()
        opened.decoder.open_prefill()
    gc.collect()
    try:
        assert _mapped_graphs(info.folder) == []
        ids = np.array([[3, 1, 4]])
        logits, _ = opened.step(ids, np.ones((1, 3), np.int64), np.arange(3)[None], None)
        assert np.isfinite(logits).all()
    finally:
        opened.close()


def test_the_cpu_flags_choose_the_mixed_chunks_base_by_the_precisions_kernels(monkeypatch, tmp_path):
    """A joiners' chunk in a decode step's forward starts from 24 tokens where the CPU has the precision's wide kernels
    (int8 and int4: VNNI or AMX; fp32: AVX-512), from 8 (int8, int4) or 20 (fp32) where it has AVX2 alone for them;
    24 off x86."""
    from gpt2x.runtime import providers

    cpuinfo, real = tmp_path / "cpuinfo", providers.Path
    monkeypatch.setattr(providers, "Path", lambda p: real(cpuinfo) if p == "/proc/cpuinfo" else real(p))
    monkeypatch.setattr(providers.platform, "machine", lambda: "x86_64")
    cases = (("fpu avx2 fma", {"fp32": 20, "int8": 8, "int4": 8}),
             ("avx2 avx512f avx512bw", {"fp32": 24, "int8": 8, "int4": 8}),  # Skylake: AVX-512 without VNNI
             ("avx2 avx_vnni", {"fp32": 20, "int8": 24, "int4": 24}),  # Alder Lake: VNNI without AVX-512
             ("avx2 avx512f avx512_vnni amx_int8", {"fp32": 24, "int8": 24, "int4": 24}))
    try:
        for flags, bases in cases:
            cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
            providers.cpu_mixed_chunk_base.cache_clear()
            assert {p: providers.cpu_mixed_chunk_base(Precision(p)) for p in bases} == bases, flags
        monkeypatch.setattr(providers.platform, "machine", lambda: "aarch64")
        providers.cpu_mixed_chunk_base.cache_clear()
        assert providers.cpu_mixed_chunk_base(Precision.int8) == 24
    finally:
        providers.cpu_mixed_chunk_base.cache_clear()
