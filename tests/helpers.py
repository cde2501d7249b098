"""What several test modules share: tiny GPT-2s with random weights saved by transformers (so the
loader is tested against files it did not write), the CLI run in-process and in a subprocess, servers
on ephemeral ports, and the spies and schemas of more than one module. Fixtures live in conftest.py."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from gpt2x.bench import run as bench
from gpt2x.cli.app import main
from gpt2x.fileio import sha256
from gpt2x.lmeval.index import INDEX_ENV
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import EXPORTS_ENV, MODEL_FILE, attention_layout, read_export
from gpt2x.onnx.graph_cache import GRAPHS_ENV
from gpt2x.onnx.optimize import count_ops, mha_to_gqa
from gpt2x.onnx.trace import TRACES_ENV
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.serve.core.outputs import Failed, Finished, TokenOut
from gpt2x.tokenizer import EOT_ID

REPO = Path(__file__).resolve().parent.parent


# Prompts of different lengths: generated as one batch, they exercise left padding.
PROMPTS = ["ROMEO:", "The king is dead, and", "What light through yonder window breaks? It is the east"]


TINY = dict(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4)


def make_hf_model(folder: Path, seed: int = 0, safe: bool = True, **overrides):
    """A random-weight transformers GPT2LMHeadModel saved to `folder`; returns the HF model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(**{**TINY, **overrides}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # larger-than-default weights make differences visible in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    if not safe:  # a pickled checkpoint, as older hub repos have (transformers 5 writes safetensors only)
        from safetensors.torch import load_file

        path = folder / "model.safetensors"
        torch.save(load_file(path), folder / "pytorch_model.bin")
        path.unlink()
    return model


@contextmanager
def refusing_port():
    """A port bound by this process and not listening, for as long as the block runs: connecting to it is
    refused, and no other process can take it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def run_cli(*args: str, env: dict | None = None, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m gpt2x ARGS` in a subprocess, as a user runs it."""
    full_env = {k: v for k, v in os.environ.items() if k != "GPT2X_DEBUG"}
    full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "gpt2x", *args], capture_output=True, text=True, encoding="utf-8", env=full_env,
        input=stdin, timeout=timeout,
    )


@contextmanager
def http_server(handler) -> Iterator[str]:
    """A stdlib HTTP server with `handler` (a BaseHTTPRequestHandler class) on an ephemeral port, on a thread of its
    own: its base URL, and the server shut down after."""
    from http.server import ThreadingHTTPServer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextmanager
def uvicorn_server(app):
    """`app` on uvicorn, 127.0.0.1 and an ephemeral port, in a thread of this process; yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def served_models(slots) -> Iterator:
    """Several models behind one server (serve.openai.many: `slots`, ModelSlots), every one loaded, on uvicorn in this
    process: an httpx client of it, and the models closed after."""
    import httpx

    from gpt2x.serve.openai.many import Models, models_app

    models = Models(slots)
    models.load_all()
    try:
        with uvicorn_server(models_app(models)) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            yield c
    finally:
        models.close_all()


def cuda_loads() -> bool:
    from gpt2x.runtime.providers import available_providers

    return available_providers()["loadable"]["cuda"] == "ok"


def local_service(export_dir, model: str = "shakespeare", batch: int = 4, chat_template=None):
    """The bundled export served in this process, as the API tests serve it: ONNX Runtime on one thread, a batch of
    `batch`, `chat_template` for chat (None: no template)."""
    from gpt2x.onnx.artifact import read_export
    from gpt2x.runtime.ort import OrtBackend
    from gpt2x.serve.core.engine import EngineSettings
    from gpt2x.serve.openai.service import CompletionService

    return CompletionService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=batch), model,
                             chat_template=chat_template)


def post(client, **body) -> dict:
    """The JSON body of a completion that must succeed."""
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()



def histogram_count(families: dict, name: str) -> float:
    return value(families, f"gpt2x:{name}", f"gpt2x:{name}_count")

# Runs the gpt2x CLI with torch, onnxscript and transformers made unimportable: any attempt to import
# them (or a submodule) raises ImportError, exactly as on an install without the `export` extra.
BLOCKED_RUNNER = """
import os, sys

BLOCKED = set(os.environ.get("BLOCKED", "torch,onnxscript,transformers").split(","))

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, Block())
sys.argv = ["gpt2x", *sys.argv[1:]]
from gpt2x.bench import run as bench
from gpt2x.cli.app import main
main()
"""

NUM = (int, float)

OPT_NUM = (int, float, type(None))

LOGITS = {"positions": int, "max_abs": NUM, "p99_abs": NUM, "scale": NUM, "max_rel": NUM, "worst_row_max_abs": NUM,
          "top1_agreement": NUM, "mean_kl": NUM, "present_max_rel": NUM, "cases": list}

TOLERANCE = {"max_rel": NUM, "max_kl": NUM, "min_top1": OPT_NUM, "min_greedy": NUM, "why": str}

# Every field of `gpt2x bench --json` (README, "gpt2x bench"): a dict is a nested object, [x] a list of x.
class Opt:
    """A field that may be absent; where present, of the type given."""

    def __init__(self, schema):
        self.schema = schema


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run the console entry point in-process; returns (exit code, stdout, stderr)."""
    old = sys.argv
    sys.argv = ["gpt2x", *args]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, expected_code: int, fragment: str) -> None:
    assert code == expected_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert "Traceback" not in err


class DraftSpy:
    """What the decode loop asked of a drafter and got back, one list per sequence (`reset` starts one)
    of (the sequence it drafted for, the drafted tokens): DraftSpy(drafter) wraps one drafter, handed
    to the loop in its place; DraftSpy.on records every drafter of the classes given (those the code
    under test opens itself)."""

    def __init__(self, drafter=None):
        self.drafter = drafter
        self.runs: list[list[tuple[list[int], list[int]]]] = []

    def __getattr__(self, name):  # name, n_positions, sync, keep: the wrapped drafter's
        return getattr(self.__dict__["drafter"], name)

    def reset(self) -> None:
        self.runs.append([])
        self.drafter.reset()

    def propose(self, tokens, k, sampler, history=None):
        proposal = self.drafter.propose(tokens, k, sampler, history)
        self.runs[-1].append((list(tokens), list(proposal.tokens)))
        return proposal

    @classmethod
    def on(cls, monkeypatch, *classes) -> DraftSpy:
        spy = cls()
        for klass in classes:
            def reset(drafter, original=klass.reset):
                spy.runs.append([])
                original(drafter)

            def propose(drafter, tokens, k, sampler, history=None, original=klass.propose):
                proposal = original(drafter, tokens, k, sampler, history)
                spy.runs[-1].append((list(tokens), list(proposal.tokens)))
                return proposal

            monkeypatch.setattr(klass, "reset", reset)
            monkeypatch.setattr(klass, "propose", propose)
        return spy


def greedy_counts(rounds, sequence: list[int]) -> tuple[int, int, int, bool]:
    """(drafted, accepted, drafts, open) of a greedy run's proposals (DraftSpy), counted from the
    sequence the run produced (prompt and output), not from its counters: a drafted token is accepted
    while it is the sequence's token at its place (greedy verification replaces the first one it
    rejects by the target's argmax, another token). `open`: a round agreed up to the end of `sequence`
    (one cut short at end of text), so it may have accepted more than counted."""
    drafted = accepted = drafts = 0
    open_end = False
    for tokens, d in rounds:
        assert sequence[: len(tokens)] == tokens  # drafted for the sequence the run produced
        if not d:
            continue  # nothing drafted: the round was a plain step
        following = sequence[len(tokens) : len(tokens) + len(d)]
        agreed = next((i for i, (x, y) in enumerate(zip(d, following)) if x != y), len(following))
        open_end |= len(tokens) + agreed == len(sequence)
        drafts, drafted, accepted = drafts + 1, drafted + len(d), accepted + agreed
    return drafted, accepted, drafts, open_end


def check_step_greedy(backend):
    """A backend's step_greedy against the argmax of its step's logits: a batch of 3 with a
    left-padded row, from the prompt and then from a past (each kind of step on its own cache).
    Returns step_greedy's first cache, for checks of where it lives."""
    ids = np.random.default_rng(9).integers(0, backend.vocab_size, (3, 7))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    logits, past = backend.step(ids, mask, positions(mask, 7), None)
    tokens, greedy_past = backend.step_greedy(ids, mask, positions(mask, 7), None)
    assert tokens.dtype == np.int64 and np.array_equal(tokens, logits.argmax(axis=-1))
    mask2 = np.concatenate([mask, np.ones((3, 1), dtype=np.int64)], axis=1)
    logits2, _ = backend.step(tokens[:, None], mask2, positions(mask2, 1), past)
    tokens2, _ = backend.step_greedy(tokens[:, None], mask2, positions(mask2, 1), greedy_past)
    assert np.array_equal(tokens2, logits2.argmax(axis=-1))
    return greedy_past


def as_gqa(info, folder):
    """A copy of an fp32 export whose attention is GroupQueryAttention, with its metadata updated."""
    shutil.copytree(info.folder, folder)
    proto = onnx.load(str(folder / MODEL_FILE))
    assert mha_to_gqa(proto) == info.config.n_layer
    onnx.save(proto, str(folder / MODEL_FILE))
    meta = json.loads((folder / "gpt2x.json").read_text())
    meta["fused_operators"] = count_ops(proto)
    meta["attention"] = attention_layout(meta["fused_operators"])
    meta["files"][MODEL_FILE] = sha256(folder / MODEL_FILE)
    meta["sizes"][MODEL_FILE] = (folder / MODEL_FILE).stat().st_size
    (folder / "gpt2x.json").write_text(json.dumps(meta))
    return read_export(folder)


class Noisy(TorchBackend):
    """The reference model with Gaussian noise of a given size on its logits."""

    def __init__(self, model, sigma: float):
        super().__init__(model)
        self.sigma, self.rng = sigma, np.random.default_rng(0)

    def run(self, *args):
        logits, present = super().run(*args)
        return logits + self.rng.normal(0, self.sigma, logits.shape).astype(np.float32), present

    def step(self, *args):
        logits, present = super().step(*args)
        return logits + self.rng.normal(0, self.sigma, logits.shape).astype(np.float32), present


LINES = [line for line in (REPO / "tests/data/tinyshakespeare.txt").read_text().splitlines() if len(line) > 12]


class Collect:
    """A row's callback that records its events and, after `after` tokens, calls `then` once."""

    def __init__(self, after: int = 0, then=None):
        self.tokens: list[int] = []
        self.end: tuple[str, object] | None = None
        self.done = threading.Event()
        self.after, self.then = after, then

    def __call__(self, out) -> None:
        if isinstance(out, TokenOut):
            self.tokens.append(out.token)
            if self.then and len(self.tokens) == self.after:
                self.then()
                self.then = None
        elif isinstance(out, (Finished, Failed)):
            self.end = ("done", out.reason) if isinstance(out, Finished) else ("error", out.message)
            self.done.set()


class EndsAt:
    """The backend, with <|endoftext|> made the most likely token at sequence position `at`."""

    def __init__(self, inner, at: int):
        self.inner, self.at = inner, at

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, ids, mask, pos, past):
        logits, past = self.inner.run(ids, mask, pos, past)
        predicts = mask.shape[1] - ids.shape[1] + 1  # the position row 0's logits choose the token of
        for t in range(ids.shape[1]):
            if predicts + t == self.at:
                logits[:, t, EOT_ID] = logits[:, t].max() + 10
        return logits, past

    def step(self, ids, mask, pos, past):
        logits, past = self.inner.step(ids, mask, pos, past)
        if mask.shape[1] == self.at:
            logits[:, EOT_ID] = logits.max() + 10
        return logits, past


@contextmanager
def serving(*args: str, env: dict | None = None, timeout: float = 180) -> Iterator[tuple[subprocess.Popen, dict]]:
    """`python -m gpt2x serve ARGS --json` in a subprocess, as a user starts it: the process and its ready line, once
    printed; killed on the way out where the block did not stop it."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2x", "serve", *args, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, encoding="utf-8", env=full_env)
    try:
        yield proc, json.loads(read_line(proc, timeout))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    raise AssertionError(f"no line from gpt2x serve within {timeout} s: {proc.stderr.read() if proc.poll() is not None else ''}")


def scrape(text: str) -> dict:
    """{family name: (type, {(sample name, labels as a sorted tuple): value})}, by prometheus-client's parser."""
    families = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        families[family.name] = (family.type, samples)
    return families


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    labels = tuple(sorted({"model_name": "shakespeare", **labels}.items()))
    return families[family][1][(sample or family, labels)]


def counts(families: dict) -> dict:
    """What a known set of requests must move, as numbers."""
    return {
        "prompt": value(families, "gpt2x:prompt_tokens", "gpt2x:prompt_tokens_total"),
        "generation": value(families, "gpt2x:generation_tokens", "gpt2x:generation_tokens_total"),
        "stop": value(families, "gpt2x:request_success", "gpt2x:request_success_total", finished_reason="stop"),
        "length": value(families, "gpt2x:request_success", "gpt2x:request_success_total", finished_reason="length"),
        **{name: histogram_count(families, name) for name in
           ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds")},
    }


def streamed(client, body: dict, url: str = "", headers: dict | None = None) -> tuple[dict, list[str]]:
    """A streamed request's usage (asked for) and its choices' finish reasons, by index."""
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "stream_options": {
            "include_usage": True}}, headers=headers) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    reasons = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
    return chunks[-1]["usage"], [reasons[i] for i in sorted(reasons)]


def expected_moves(answers: list[tuple[dict, list[str]]], stop_strings: bool) -> dict:
    """What the metrics must have moved by for these answers (usage, finish reasons per choice). Each
    choice is one request (vLLM's count): one time to first token, one end-to-end latency; its gaps
    between tokens are its tokens - 1, the end-of-text token that ends a "stop" choice counted (it
    is sampled; usage leaves it out). With stop strings a row may sample past the string before it
    is cancelled, so the gaps are only bounded below."""
    reasons = [r for _, rs in answers for r in rs]
    moves = {"prompt": sum(u["prompt_tokens"] for u, _ in answers),
             "generation": sum(u["completion_tokens"] for u, _ in answers),
             "stop": reasons.count("stop"), "length": reasons.count("length"),
             "time_to_first_token_seconds": len(reasons), "e2e_request_latency_seconds": len(reasons)}
    if not stop_strings:
        moves["inter_token_latency_seconds"] = moves["generation"] + reasons.count("stop") - len(reasons)
    return moves


BENCH_SCHEMA = {
    "schema_version": int,
    "settings": {"model": str, "provider": str, "backends": [str], "precisions": [str], "batches": [int],
                 "prompt_len": int, "new_tokens": int, "repeat": int, "warmup": int, "threads": int, "text": str,
                 "greedy_tokens": int, "drafts": [str], "num_speculative_tokens": int, "prompt_text": (str, type(None)), "kv_cache": str,
                 "fixed_cache": Opt(bool)},
    "environment": dict,
    "model": {"name": str, "config": {"vocab_size": int, "n_positions": int, "n_embd": int, "n_layer": int, "n_head": int,
                                      "layer_norm_epsilon": float}, "parameters": int},
    "bandwidth": {"kind": str, "samples_bytes_per_s": [float], "bytes_per_s": float},
    "reference": {"backend": str, "precision": str, "perplexity": float, "text_tokens": int},
    "parity": [{"backend": str, "precision": str, "source": str, "passed": bool, "message": str, "logits": LOGITS,
                "greedy": {"tokens": int, "identical_prefix": [int], "share": NUM}, "tolerance": TOLERANCE,
                "perplexity": float, "perplexity_rel_change": float}],
    "speed": [{"backend": str, "precision": str, "batch": int, "cold_start_s": float, "ttft_ms": float,
               "decode_latency": {"p50_ms": float, "p90_ms": float, "p99_ms": float, "mean_ms": float},
               "decode_tokens_per_s": float, "e2e_tokens_per_s": float, "roofline_tokens_per_s": float,
               "roofline_share": float, "peak_rss_mb": float,
               "latency_by_context": [{"context": int, "ms": float}],
               # against ort at the same precision and batch, in rows of other backends where ort ran
               "native_share": Opt(float), "native_ttft_ratio": Opt(float),
               # the runtime that ran the prompt, in the rows of a backend that says (ort)
               "prefill": Opt(str),
               # the ort rows timed on StaticDecoder (--fixed-cache)
               "decoder": Opt(str), "same_tokens": Opt(float),
               # the web backend's rows (tests/test_web.py)
               "page_memory_mb": Opt(float), "page": Opt(dict), "page_ttft_ms": Opt(float),
               "page_decode_tokens_per_s": Opt(float), "page_decode_latency": Opt(dict), "page_native_share": Opt(float)}],
    "speculative": [{"backend": str, "precision": str, "draft": str, "draft_name": str, "num_speculative_tokens": int, "adaptive": bool,
                     "prompt_len": int, "new_tokens": int, "timed_runs": int,
                     "acceptance_rate": OPT_NUM, "mean_acceptance_length": OPT_NUM,
                     "drafted": int, "accepted": int, "drafts": int, "plain_steps": int,
                     "decode_tokens_per_s": float, "plain_decode_tokens_per_s": float, "speedup": float,
                     "ttft_ms": float, "plain_ttft_ms": float, "step_cost_ms": [float], "step_cost_ratio": [float],
                     "greedy_identical": bool, "first_difference": (int, type(None))}],
    "skipped": [{"backend": str, "precision": str, "reason": str}],
    "passed": bool,
    "fastest": [{"goal": str, "backend": str, "precision": str, "batch": int, "decode_tokens_per_s": float, "ttft_ms": float}],
}


def validate(value, schema, where: str = "result") -> None:
    """`value` has exactly the fields of `schema`, each of its type (recursively)."""
    if isinstance(schema, dict):
        assert isinstance(value, dict), where
        required = {key for key, sub in schema.items() if not isinstance(sub, Opt)}
        assert required <= set(value) <= set(schema), \
            f"{where}: fields {sorted((set(value) - set(schema)) | (required - set(value)))} differ"
        for key, sub in schema.items():
            if key in value:
                validate(value[key], sub.schema if isinstance(sub, Opt) else sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            validate(item, schema[0], f"{where}[{i}]")
    else:
        assert isinstance(value, schema) and not (schema is int and isinstance(value, bool)), f"{where}: {value!r}"


class StepClock:
    """The bench's clock (run.py's `time.perf_counter`) made deterministic: it stands still but in the
    forwards (run, step, step_greedy) of the backend being timed (by timed_generation,
    timed_speculative or step_costs), each of which moves it by `base + per_token * T` ms, T the new
    positions, as `costs` gives for the backend's class. So every time the bench reports is known in
    advance. `spec_runs` holds each timed_speculative run's proposals (DraftSpy) and whole sequence;
    `forwards` each timed forward's (backend, T, real seconds, the page's own ms where it reports one)."""

    def __init__(self, monkeypatch, costs: dict[type, tuple[float, float]]):
        self.now, self.target, self.depth = 0.0, None, 0
        self.spec_runs: list[tuple[list, list[int]]] = []
        self.forwards: list[tuple[object, int, float, float | None]] = []
        monkeypatch.setattr(bench, "time", self)
        for cls, (base_ms, per_token_ms) in costs.items():
            for name in ("run", "step", "step_greedy"):
                if getattr(cls, name, None) is not None:
                    monkeypatch.setattr(cls, name, self._forward(getattr(cls, name), base_ms, per_token_ms))
        for name in ("timed_generation", "step_costs"):
            monkeypatch.setattr(bench, name, self._timing(getattr(bench, name)))
        monkeypatch.setattr(bench, "timed_speculative", self._speculative(self._timing(bench.timed_speculative)))

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):  # anything else run.py takes from `time`
        return getattr(time, name)

    def _forward(self, method, base_ms: float, per_token_ms: float):
        def forward(backend, input_ids, *args):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                out = method(backend, input_ids, *args)
            finally:
                self.depth -= 1
            if backend is self.target and self.depth == 0:  # once per call (step_greedy may call step)
                self.now += (base_ms + per_token_ms * input_ids.shape[1]) / 1e3
                page = getattr(backend, "page_ms", None)
                self.forwards.append((backend, input_ids.shape[1], time.perf_counter() - t0, page[-1] if page else None))
            return out

        return forward

    def _timing(self, helper):
        def timed(backend, *args, **kwargs):
            self.target = backend
            try:
                return helper(backend, *args, **kwargs)
            finally:
                self.target = None

        return timed

    def _speculative(self, helper):
        def timed(target, drafter, prompt_ids, *args, **kwargs):
            spy = DraftSpy(drafter)
            run = helper(target, spy, prompt_ids, *args, **kwargs)
            self.spec_runs.append((spy.runs[-1], list(prompt_ids) + run["tokens"][0]))
            return run

        return timed


def run_gpt2x(*args: str, cwd, blocked: bool, block: str | None = None) -> subprocess.CompletedProcess:
    """gpt2x ARGS in `cwd`, its exports by model name in cwd/exported (GPT2X_EXPORTS)."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", EXPORTS_ENV: str(Path(cwd) / "exported"),
           **({TRACES_ENV: os.environ[TRACES_ENV]} if os.environ.get(TRACES_ENV) else {}),
           **({GRAPHS_ENV: os.environ[GRAPHS_ENV]} if os.environ.get(GRAPHS_ENV) else {}),  # never the user's cache
           **({INDEX_ENV: os.environ[INDEX_ENV]} if os.environ.get(INDEX_ENV) else {}),
           # the export's extra graphs the run turns off (conftest): each costs an int8 export seconds of gating and timing
           **{name: os.environ[name] for name in ("GPT2X_BATCHED_DECODE", "GPT2X_INT8_KV") if name in os.environ},
           **({"BLOCKED": block} if block else {}),
           # a checkout other than the installed one (a git worktree) runs its own gpt2x
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {})}
    cmd = [sys.executable, "-c", BLOCKED_RUNNER, *args] if blocked else [sys.executable, "-m", "gpt2x", *args]
    return subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", cwd=cwd, env=env, timeout=600)


def torch_last_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """PyTorch's last-position logits of whole (left-padded) sequences, without a cache: an independent reference."""
    with torch.no_grad():
        logits, _ = model(torch.tensor(ids), torch.tensor(mask), torch.tensor(positions(mask, ids.shape[1])))
    return logits[:, -1].numpy()


def with_int8_kv(info, folder: Path, model_name: str = "shakespeare"):
    """A copy of an int8 export in `folder` with int8 KV cache scales calibrated as the export calibrates them and
    recorded as used (not gated or timed: tests/onnx/test_kvcache.py checks those), as an ExportInfo."""
    from gpt2x.onnx.artifact import KV_KEY, KV_SCALES_FILE, METADATA_FILE, ExportInfo
    from gpt2x.onnx.build import write_kv_scales
    from gpt2x.workflows.models import load_model

    shutil.copytree(info.folder, folder)
    model, _ = load_model(model_name)
    write_kv_scales(model, folder)
    meta = json.loads((folder / METADATA_FILE).read_text())
    meta[KV_KEY] = {"kept": True, "file": KV_SCALES_FILE, "use": True}
    return ExportInfo(folder, meta)
