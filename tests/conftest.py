"""The suite's fixtures (what tests share that is not a fixture lives in helpers.py): the run's shared
exports (the bundled model's, and tiny random GPT-2s'), ports, one core per pytest-xdist worker, and
how the workers split the run."""

from __future__ import annotations

import os
import tempfile

# No test touches the network: huggingface_hub reads this when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"
# The run's own HOME (set before anything reads it; the workers and every process they start inherit it): nothing
# the tests run reads or writes the user's, and OpenVINO's and NNCF's usage telemetry is declined in it, in the
# consent file they read there, as CI systems decline it. Otherwise each conversion forks the process it runs in to
# reach Google Analytics, and each process waits for those sends at exit.
_HOME = os.path.join(tempfile.gettempdir(), f"gpt2x-tests-{os.getuid()}", "home")
_CONSENT = os.path.join(_HOME, "intel", "openvino_telemetry")
if not os.path.isfile(_CONSENT):  # written once, atomically: the workers start together
    os.makedirs(os.path.dirname(_CONSENT), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(_CONSENT), delete=False) as _f:
        _f.write("0")
    os.replace(_f.name, _CONSENT)
os.environ["HOME"] = _HOME
# Ray starts no idle Python workers ahead of its actors: every cluster the tests start (in this process
# and in the servers they run) then spends the cores only on the processes it uses.
os.environ.setdefault("RAY_enable_worker_prestart", "0")
# Every prefill on ONNX Runtime, wherever an fp32 or int8 export has an OpenVINO prefill graph: the export's timing picks
# auto's runtime, so it could differ between runs; the tests of that prefill choose it explicitly.
os.environ.setdefault("GPT2X_PREFILL", "onnxruntime")
# and no export made during the run (by the tests, or the commands they run) builds that graph unless asked: it
# costs each fp32 or int8 export seconds (tests/onnx/test_openvino_prefill.py and its runtime twin ask for it).
os.environ.setdefault("GPT2X_OPENVINO_PREFILL", "0")
# Nor an int8 export its batched decode graph (a second quantization, gate and timing: seconds); the tests of that
# graph ask for it (tests/onnx/test_batched.py, tests/runtime/test_batched.py).
os.environ.setdefault("GPT2X_BATCHED_DECODE", "0")

import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# torch and .helpers (gpt2x, onnx, transformers: seconds) are imported where used: pytest-xdist's controller process
# loads this file too, and starts the workers only after.

# CI runs property tests derandomized: the same examples every run, so a failure is reproducible.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    from .helpers import make_hf_model

    folder = tmp_path_factory.mktemp("tiny-hf")
    model = make_hf_model(folder)
    return folder, model


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory, worker_id) -> Path:
    """A folder that every pytest-xdist worker of this run shares (the workers' base temp's parent)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


@pytest.fixture(scope="session")
def tiny_export(shared_dir):
    """tiny_export(precision=fp32, seed=31, gated=True, gqa=False, openvino_prefill=False, batched=False, **config) -> (GPT2,
    ModelSource, ExportInfo): a tiny random GPT-2 (helpers.make_hf_model: TINY with `config`'s overrides,
    n_positions 96 unless given) and its export, each made once per run in the workers' shared folder (under
    a file lock) and only read by the tests. `gated`: through the precision's parity gate; `gqa`: the fp32
    export rewritten to GroupQueryAttention (helpers.as_gqa); `openvino_prefill`: an int8 or fp32 export with
    its OpenVINO prefill graph (else none: it costs seconds, and the tests run ONNX Runtime's prefill); `batched`: an
    int8 export with its batched decode graph (else none, for the same reason); `int8_kv`: an int8, int4 or fp32 export with
    its int8 KV cache's scales (else none)."""
    from filelock import FileLock

    from gpt2x.choices import Precision
    from gpt2x.model.weights import load_model
    from gpt2x.onnx.artifact import is_export, read_export
    from gpt2x.workflows.exports import export_model

    from .helpers import as_gqa, make_hf_model

    root = shared_dir / "tiny"
    models: dict = {}

    def model_of(seed: int, config: dict):
        key = f"seed{seed}" + "".join(f"-{k}{v}" for k, v in sorted(config.items()))
        if key not in models:
            folder = root / key
            with FileLock(f"{folder}.lock"):
                if not (folder / "config.json").is_file():
                    make_hf_model(folder, seed=seed, **config)
            models[key] = (key, *load_model(str(folder)))
        return models[key]

    def get(precision: Precision = Precision.fp32, seed: int = 31, gated: bool = True, gqa: bool = False,
            openvino_prefill: bool = False, batched: bool = False, int8_kv: bool = False, **config):
        config.setdefault("n_positions", 96)
        key, model, source = model_of(seed, config)
        name = f"{key}-{Precision(precision).value}" + ("-gated" if gated else "") + \
            ("-ovprefill" if openvino_prefill else "") + ("-batched" if batched else "") + ("-kv8" if int8_kv else "")
        folder = root / "exports" / name
        with FileLock(f"{folder}.lock"):
            if not is_export(folder):
                export_model(model, source, folder, Precision(precision), check_parity=gated,
                             openvino_prefill=openvino_prefill, batched_decode=batched, int8_kv=int8_kv)
            info = read_export(folder)
            if gqa:
                gqa_folder = root / "exports" / f"{name}-gqa"
                info = read_export(gqa_folder) if is_export(gqa_folder) else as_gqa(info, gqa_folder)
        return model, source, info

    return get


@pytest.fixture(scope="session", autouse=True)
def one_core_per_worker(worker_id):
    """In parallel runs, each pytest-xdist worker (and what it starts) keeps to a core of its own, and
    ONNX Runtime and PyTorch size their thread pools to it (gpt2x counts the cores it may use): two
    workers each spinning threads on both cores would only slow each other down."""
    if worker_id == "master" or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if len(cores) > 1 and workers <= len(cores):
        core = {cores[int(worker_id.removeprefix("gw")) % len(cores)]}
        # Every thread of the process, not only this one: threads started before (OpenMP's pool among them)
        # keep the mask they were born with, and a test that later asks PyTorch for two threads would spin
        # one of them on the other worker's core (a 20x slower test, measured).
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), core)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """What a test sets PyTorch's thread count to (a backend built with threads=2) ends with it."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def session_exports(shared_dir) -> Path:
    """GPT2X_EXPORTS (and GPT2X_TRACES, GPT2X_GRAPHS) for the whole run: the exports made by model name (by the tests, and by
    the CLI they run) land in one folder that the workers share, never in the user's cache. The library's
    lock (fileio.folder_lock, in workflows.ensure_export) lets one worker make each export while the
    others wait for it and then use it. A test that must see exports made from nothing sets its own
    (`own_exports`)."""
    from gpt2x.lmeval.index import INDEX_ENV
    from gpt2x.onnx.artifact import EXPORTS_ENV
    from gpt2x.onnx.build import INT8_KV_ENV
    from gpt2x.onnx.graph_cache import GRAPHS_ENV
    from gpt2x.onnx.trace import TRACES_ENV

    root = shared_dir / "exported"
    os.environ[EXPORTS_ENV] = str(root)
    # Exports by name without the int8 KV cache's scales: their gate times steps on both caches (seconds), and whether
    # the runtime then holds int8 would follow those timings from run to run. tests/onnx/test_kvcache.py asks for them.
    os.environ[INT8_KV_ENV] = "0"
    os.environ[TRACES_ENV] = str(shared_dir / "traces")  # the run's traced graphs, never the user's
    os.environ[GRAPHS_ENV] = str(shared_dir / "graphs")  # and its graphs rewritten at load (onnx.graph_cache)
    os.environ[INDEX_ENV] = str(shared_dir / "lm-eval-index")  # and lm-eval's task indexes (lmeval.index)
    return root


@pytest.fixture
def own_exports(tmp_path, monkeypatch) -> Path:
    """GPT2X_EXPORTS set to TMP/exported for one test: what it exports by name lands there and only there."""
    from gpt2x.onnx.artifact import EXPORTS_ENV

    root = tmp_path / "exported"
    monkeypatch.setenv(EXPORTS_ENV, str(root))
    return root


@pytest.fixture(scope="session")
def bundled_export(session_exports):
    """bundled_export(precision) -> ExportInfo: the bundled model's export at that precision, parity-
    gated, made once per test run (workflows.ensure_export in the shared folder) and shared by every
    test and worker. The tests only read these folders: one that changes an export copies it first."""
    from gpt2x.choices import Precision
    from gpt2x.onnx.artifact import default_export_dir
    from gpt2x.workflows.exports import ensure_export

    def get(precision: Precision = Precision.fp32):
        precision = Precision(precision)  # the shared folder, whatever GPT2X_EXPORTS a test set meanwhile
        return ensure_export("shakespeare", precision, folder=default_export_dir("shakespeare", precision, session_exports))

    return get


WHOLE_RUN_ITEMS = 500  # the suite has over a thousand tests; a run of fewer is a subset


@pytest.fixture(scope="session", autouse=True)
def bundled_exports_made_side_by_side(request, worker_id, bundled_export):
    """In a parallel run of the suite, each worker first makes a different one of the bundled model's fp32
    and int8 exports (both are used): otherwise both start by needing fp32, and one waits idle for
    the other to make it (about 5 s of a core, measured). A run of a few tests makes only what they ask for."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker_id == "master" or workers < 2 or len(request.session.items) < WHOLE_RUN_ITEMS:
        return
    order = ["fp32", "int8"]
    if int(worker_id.removeprefix("gw")) % 2:
        order.reverse()
    for precision in order:
        bundled_export(precision)


@pytest.fixture(scope="session")
def export_dir(bundled_export):
    """The bundled model's fp32 export folder, for the tests that serve or score it; they only read it."""
    return bundled_export().folder


@pytest.fixture(scope="module")
def reference(export_dir):
    """A second backend over that export, in the test's process: the independent forwards (gpt2x's
    own generation code) that every served answer is checked against."""
    from gpt2x.onnx.artifact import read_export
    from gpt2x.runtime.ort import OrtBackend

    return OrtBackend(read_export(export_dir), threads=1)


# Ports for servers that bind their own (Ray Serve's proxy, `gpt2x serve` in a subprocess), which
# cannot be handed a bound socket: below Linux's ephemeral range (32768-60999, where port-0 binds land)
# and above Ray's worker ports (10002-19999), each handed out once per run across the workers.
RESERVED_PORTS = range(20000, 32000)


@pytest.fixture(scope="session")
def reserve_port(shared_dir):
    """reserve_port() -> a port that no other test of this run is given and that binds now: from a
    counter in the workers' shared folder (under a file lock), skipping ports something holds."""
    from filelock import FileLock

    counter = shared_dir / "next-port"

    def reserve() -> int:
        with FileLock(f"{counter}.lock"):
            port = int(counter.read_text()) if counter.exists() else RESERVED_PORTS.start
            while True:
                assert port in RESERVED_PORTS, "the test run used up its reserved ports"
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", port))
                        break
                    except OSError:
                        port += 1
            counter.write_text(str(port + 1))
        return port

    return reserve


# The tests that start Ray (marked xdist_group("ray")): run in one pytest-xdist worker, one after
# another, so that two Ray clusters never share the 2 cores. xdist's own loadgroup scheduling reads
# that mark by rewriting node ids, which pytest 9.2 no longer lets it do; the scheduler below groups
# by this list instead, and the collection hook checks that the list and the marks agree.
RAY_TESTS = ("tests/serve/test_ray.py::",
             "tests/cli/test_serve.py::test_a_signal_stops_the_server_cleanly_within_10_s[ray-")


def xdist_scope(nodeid: str) -> str:
    """The unit of work a worker is given: every Ray test together, otherwise a whole module (its
    module-scoped fixtures, the exports and browsers they make, are then made once)."""
    return "ray" if nodeid.startswith(RAY_TESTS) else nodeid.split("::", 1)[0]


# The longest units, longest first (measured: `--junitxml`, times summed per unit). loadscope orders the rest by
# their number of tests, which would leave a unit of a few long tests (the soaks) for the end of the run, one
# worker busy with it while the other has finished. A unit missing here is only scheduled by its size.
LONGEST_FIRST = ("ray", "tests/generation/test_speculative.py", "tests/runtime/test_web.py",
                 "tests/onnx/test_export.py", "tests/cli/test_robustness.py", "tests/lmeval/test_eval.py",
                 "tests/serve/test_api.py", "tests/generation/test_structured.py", "tests/cli/test_serve.py",
                 "tests/onnx/test_trace.py", "tests/serve/test_draft.py", "tests/onnx/test_openvino_prefill.py")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleAndRayScheduling(LoadScopeScheduling):
        """loadscope's scheduling over xdist_scope's units, LONGEST_FIRST first, then the largest."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            first = next((unit for unit in LONGEST_FIRST if unit in self.workqueue), None)
            if first is not None:
                self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ModuleAndRayScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests marked `xdist_group("ray")` are those RAY_TESTS names. Tests marked `cuda` run wherever
    ONNX Runtime's CUDA provider loads. Elsewhere they are skipped, saying why, unless they were asked
    for (`-m cuda`): then they run, and fail, rather than report a GPU run that did not happen."""
    gone = [unit for unit in LONGEST_FIRST if unit != "ray" and not (config.rootpath / unit).is_file()]
    if gone:
        raise pytest.UsageError(f"conftest.LONGEST_FIRST names modules that are gone: {', '.join(gone)}")
    for item in items:
        group = item.get_closest_marker("xdist_group")
        if (group is not None and group.args == ("ray",)) != item.nodeid.startswith(RAY_TESTS):
            raise pytest.UsageError(f"{item.nodeid}: its xdist_group('ray') mark and conftest.RAY_TESTS disagree")
    from .helpers import cuda_loads

    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items or cuda_loads():
        return
    markexpr = config.getoption("markexpr") or ""
    if "cuda" in markexpr and "not cuda" not in markexpr:
        return
    skip = pytest.mark.skip(reason="ONNX Runtime's CUDA provider does not load on this machine (gpt2x info says why)")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def openai_client(service):
    """OpenAI's client of the module's `service` (a CompletionService), served by uvicorn in this process."""
    import openai

    from gpt2x.serve.openai.routes import local_app

    from .helpers import uvicorn_server

    with uvicorn_server(local_app(service)) as port:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def client(service):
    """An in-process HTTP client of the module's `service` (a CompletionService) through the local app."""
    from fastapi.testclient import TestClient

    from gpt2x.serve.openai.routes import local_app

    with TestClient(local_app(service)) as c:
        yield c


