"""`gpt2x loadtest` against a tiny OpenAI-compatible stub server on 127.0.0.1 (ephemeral port, bounded
request counts, stopped at the end of the module): the measured latencies bracket the stub's sleeps."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import httpx  # noqa: F401 (the test extra's: a broken install fails here, rather than skipping)
import pytest

from gpt2x.bench.loadtest import LoadtestSettings, base_url, run_loadtest, stated_prompt_tokens  # noqa: E402
from gpt2x.errors import EndpointError, UsageError  # noqa: E402
from gpt2x.tokenizer import encode  # noqa: E402

from ..helpers import (  # noqa: E402
    assert_one_line_error,
    cli,
    http_server,
    refusing_port,  # noqa: E402
)

FIRST_S, BETWEEN_S, CHUNKS = 0.020, 0.005, 8


class Stub(BaseHTTPRequestHandler):
    mode = "ok"  # ok | fail_every_3 | 429 | malformed | no_usage | cached_openai | cached_llamacpp
    count = 0
    lock = threading.Lock()
    seen: list[dict] = []

    def log_message(self, *args):
        pass

    def _json(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with Stub.lock:
            Stub.count += 1
            n = Stub.count
            Stub.seen.append({**body, "auth": self.headers.get("Authorization")})
        if self.path != "/v1/completions":
            return self._json(404, {"error": "not found"})
        if Stub.mode == "429":
            return self._json(429, {"error": "rate limited"})
        if Stub.mode == "fail_every_3" and n % 3 == 0:
            return self._json(500, {"error": "boom"})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(obj) -> None:
            self.wfile.write(f"data: {obj}\n\n".encode())
            self.wfile.flush()

        try:
            time.sleep(FIRST_S)
            for i in range(CHUNKS):
                if i:
                    time.sleep(BETWEEN_S)
                if Stub.mode == "malformed" and i == 2:
                    send("{not json")
                    return
                send(json.dumps({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f" tok{i}"}]}))
            # The cached modes: request n states 10 n prompt tokens, n * n of them cached (OpenAI's/vLLM's
            # usage.prompt_tokens_details, or llama.cpp's server's timings.cache_n and prompt_n).
            if Stub.mode == "cached_openai":
                send(json.dumps({"id": "x", "choices": [], "usage": {
                    "prompt_tokens": 10 * n, "completion_tokens": 2 * CHUNKS, "prompt_tokens_details": {"cached_tokens": n * n}}}))
            elif Stub.mode == "cached_llamacpp":
                send(json.dumps({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                                 "usage": {"completion_tokens": 2 * CHUNKS, "prompt_tokens": 10 * n},
                                 "timings": {"cache_n": n * n, "prompt_n": 10 * n - n * n, "predicted_n": 2 * CHUNKS}}))
            elif Stub.mode != "no_usage":  # two tokens per chunk: usage wins over counting chunks
                send(json.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2 * CHUNKS}}))
            send("[DONE]")
        except (BrokenPipeError, ConnectionResetError):  # the client left mid-stream (after a malformed event)
            pass


@pytest.fixture(scope="module")
def server():
    with http_server(Stub) as url:
        yield url


@pytest.fixture
def stub(server):
    def set_mode(mode: str) -> str:
        Stub.mode, Stub.count, Stub.seen = mode, 0, []
        return server

    yield set_mode
    Stub.mode = "ok"


def test_latencies_bracket_the_stub_delays(stub):
    url = stub("ok")
    result = run_loadtest(LoadtestSettings(url=url + "/v1", requests=12, concurrency=[1, 4], max_tokens=16, timeout=10), {})
    assert result["schema_version"] == 3 and result["settings"]["model"] == "stub-model"
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    assert Stub.count == 24 and all(r["model"] == "stub-model" and r["stream"] and r["max_tokens"] == 16 for r in Stub.seen)
    for lv in result["levels"]:
        assert lv["completed"] == 12 and lv["failed"] == 0 and lv["failures"] == {}
        assert lv["total_output_tokens"] == 12 * 2 * CHUNKS  # from usage.completion_tokens
        assert lv["ttft"]["p50_ms"] >= FIRST_S * 1e3
        assert lv["itl"]["p50_ms"] >= BETWEEN_S * 1e3
        assert lv["itl"]["p99_ms"] <= lv["itl"]["max_ms"] and lv["e2e"]["max_ms"] >= lv["e2e"]["p99_ms"]
        assert lv["e2e"]["p50_ms"] >= (FIRST_S + (CHUNKS - 1) * BETWEEN_S) * 1e3
        assert lv["e2e"]["p50_ms"] < 1000 and lv["ttft"]["p99_ms"] <= lv["e2e"]["p99_ms"]
        assert lv["tpot"]["p50_ms"] > 0
        assert lv["request_throughput"] == pytest.approx(12 / lv["wall_s"])
        assert lv["output_token_throughput"] == pytest.approx(lv["total_output_tokens"] / lv["wall_s"])
        # prompt tokens stated (3 each), cached ones not: no hit rate
        assert lv["prompt_tokens"] == 12 * 3 and lv["prompt_tokens_stated"] == 12
        assert lv["cached_prompt_tokens"] is None and lv["prefix_cache_hit_rate"] is None
    # four in flight finish the same work faster than one
    assert result["levels"][1]["wall_s"] < result["levels"][0]["wall_s"]
    json.dumps(result)


def test_without_usage_tokens_are_chunks_and_the_key_is_sent(stub):
    url = stub("no_usage")
    s = LoadtestSettings(url=url, model="mine", requests=3, concurrency=[2], api_key="sekret", timeout=10)
    result = run_loadtest(s, {})
    assert result["levels"][0]["total_output_tokens"] == 3 * CHUNKS
    assert {r["auth"] for r in Stub.seen} == {"Bearer sekret"} and {r["model"] for r in Stub.seen} == {"mine"}
    assert result["settings"]["api_key"] == "***"


def test_poisson_arrivals(stub):
    url = stub("ok")
    result = run_loadtest(LoadtestSettings(url=url, requests=6, concurrency=[8], rate=50, timeout=10), {})
    assert result["levels"][0]["completed"] == 6 and Stub.count == 6


@pytest.mark.parametrize("mode, failures", [("fail_every_3", {"http_500": 3}), ("429", {"http_429": 9}), ("malformed", {"malformed_stream": 9})])
def test_failures_are_counted_by_kind(stub, mode, failures):
    url = stub(mode)
    lv = run_loadtest(LoadtestSettings(url=url, requests=9, concurrency=[3], timeout=10), {})["levels"][0]
    assert lv["failures"] == failures and lv["failed"] == sum(failures.values()) and lv["completed"] == 9 - lv["failed"]
    assert set(lv["failure_examples"]) == set(failures)


def test_request_timeout_and_level_deadline(stub):
    url = stub("ok")
    lv = run_loadtest(LoadtestSettings(url=url, requests=2, concurrency=[2], timeout=0.01), {})["levels"][0]
    assert lv["failures"] == {"timeout": 2}
    lv = run_loadtest(LoadtestSettings(url=url, requests=40, concurrency=[1], timeout=10, max_duration=0.2), {})["levels"][0]
    assert lv["failures"].get("deadline", 0) >= 30 and lv["completed"] + lv["failed"] == 40 and Stub.count < 40


def test_bad_settings_and_unreachable_server():
    for kwargs in ({"url": "localhost:8000"}, {"url": "ftp://x"}, {"url": "http://x", "requests": 0},
                   {"url": "http://x", "concurrency": [0]}, {"url": "http://x", "rate": -1}, {"url": "http://x", "max_tokens": 0}):
        with pytest.raises(UsageError):
            run_loadtest(LoadtestSettings(**kwargs), {})
    with refusing_port() as port, pytest.raises(EndpointError, match="cannot reach"):
        run_loadtest(LoadtestSettings(url=f"http://127.0.0.1:{port}", requests=1, timeout=5), {})
    assert base_url("http://h:1/v1/") == base_url("http://h:1") == "http://h:1"


def test_cli_table_json_and_plot(stub, capsys, tmp_path):
    url = stub("fail_every_3")
    import matplotlib  # noqa: F401 (the plot's: missing, the test fails)
    code, out, err = cli(capsys, "loadtest", url, "--requests", "6", "--concurrency", "1,2", "--max-tokens", "8",
                         "--output", str(tmp_path / "lt.json"), "--plot", str(tmp_path / "lt.png"))
    assert code == 0, err
    assert "loadtest" in out and "TTFT p50 p90 p99" in out and "http_500" in out
    data = json.loads((tmp_path / "lt.json").read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2] and "environment" in data
    assert data["levels"][0]["failures"] == {"http_500": 2}
    assert (tmp_path / "lt.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_json_switch_and_the_old_json_path(stub, capsys, tmp_path):
    """--json prints the JSON alone on stdout (the table goes to stderr); the old `--json PATH` still
    writes the file, with a one-line deprecation notice; a URL after --json is the server's."""
    url = stub("ok")
    code, out, err = cli(capsys, "loadtest", url, "--requests", "3", "--concurrency", "1", "--max-tokens", "4", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [lv["concurrency"] for lv in data["levels"]] == [1] and data["levels"][0]["completed"] == 3
    assert "TTFT p50 p90 p99" in err and "deprecated" not in err
    code, out, err = cli(capsys, "loadtest", "--json", url, "--requests", "2", "--concurrency", "1", "--max-tokens", "4")
    assert code == 0 and json.loads(out)["settings"]["requests"] == 2, err
    code, out, err = cli(capsys, "loadtest", url, "--requests", "2", "--concurrency", "1", "--max-tokens", "4",
                         "--json", str(tmp_path / "old.json"))
    assert code == 0 and "TTFT p50 p90 p99" in out, err
    assert json.loads((tmp_path / "old.json").read_text())["settings"]["requests"] == 2
    assert [line for line in err.splitlines() if "deprecated" in line] == [
        "warning: --json PATH is deprecated; use --output PATH (--json now prints the JSON on stdout)"]


def test_cli_errors_are_one_line(stub, capsys, monkeypatch):
    url = stub("429")
    code, out, err = cli(capsys, "loadtest", url, "--requests", "2", "--concurrency", "1")
    assert_one_line_error(code, err, EndpointError.exit_code, "every request failed: 2 x http_429")
    assert "loadtest" in out  # the table is printed first
    with refusing_port() as port:
        code, _, err = cli(capsys, "loadtest", f"http://127.0.0.1:{port}", "--requests", "1")
    assert_one_line_error(code, err, EndpointError.exit_code, "cannot reach")
    code, _, err = cli(capsys, "loadtest", "not-a-url")
    assert_one_line_error(code, err, UsageError.exit_code, "'not-a-url' is not an http:// or https:// URL")
    code, _, err = cli(capsys, "loadtest", url, "--requests", "0")
    assert_one_line_error(code, err, UsageError.exit_code, "--requests must be at least 1")
    code, _, err = cli(capsys, "loadtest", url, "--concurrency", "1,x")
    assert_one_line_error(code, err, UsageError.exit_code, "--concurrency")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "httpx" else object())
    code, _, err = cli(capsys, "loadtest", url)
    assert_one_line_error(code, err, 10, "pip install 'gpt2x[serve]'")


def test_help_has_examples(capsys):
    code, out, _ = cli(capsys, "loadtest", "--help")
    assert code == 0 and "Example" in out and "--concurrency" in out


@pytest.mark.parametrize("mode", ["cached_openai", "cached_llamacpp"])
def test_prefix_cache_hit_rate_from_what_the_server_states(stub, mode):
    url = stub(mode)
    lv = run_loadtest(LoadtestSettings(url=url, requests=4, concurrency=[2], timeout=10), {})["levels"][0]
    assert lv["completed"] == 4
    # requests 1..4 state 10, 20, 30, 40 prompt tokens, 1, 4, 9, 16 of them cached
    assert lv["prompt_tokens"] == 100 and lv["cached_prompt_tokens"] == 30
    assert lv["prefix_cache_hit_rate"] == pytest.approx(0.3)
    assert all(r["stream_options"] == {"include_usage": True} for r in Stub.seen)


def test_stated_prompt_tokens_field_styles():
    assert stated_prompt_tokens({"usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}}) == (7, 5)
    assert stated_prompt_tokens({"usage": {"prompt_tokens": 7, "prompt_tokens_details": None}}) == (7, None)  # vLLM without details
    assert stated_prompt_tokens({"usage": {"prompt_tokens": 7}, "timings": {"cache_n": 4, "prompt_n": 3}}) == (7, 4)
    assert stated_prompt_tokens({"timings": {"cache_n": 4, "prompt_n": 3}}) == (7, 4)  # llama.cpp's timings alone
    assert stated_prompt_tokens({"choices": [{"text": "x"}]}) == (None, None)


def test_shared_prefix_prompts_share_exactly_the_prefix(stub):
    url = stub("ok")
    P, K, n = 64, 3, 9
    s = LoadtestSettings(url=url, requests=n, concurrency=[1, 3], max_tokens=4, timeout=10,
                         shared_prefix_tokens=P, prefixes=K, suffix_tokens=8, seed=5)
    result = run_loadtest(s, {})
    assert result["settings"]["prefix_token_counts"] == [P] * K and result["settings"]["prompts"] == n
    prompts = [r["prompt"] for r in Stub.seen]
    assert len(prompts) == 2 * n and len(set(prompts)) == 2 * n  # every suffix its own, across levels too
    ids = [encode(p) for p in prompts]
    newline = encode("\n")
    for level in (ids[:n], ids[n:]):
        groups: dict[tuple, int] = {}
        for t in level:
            assert t[P : P + 1] == newline  # the prefix is exactly P tokens, then the newline
            assert 8 - 3 <= len(t) - P - 1 <= 8 + 3  # about suffix_tokens after it
            groups[tuple(t[:P])] = groups.get(tuple(t[:P]), 0) + 1
        assert sorted(groups.values()) == [n // K] * K  # K prefixes, each as often in every level
    heads = {tuple(t[:P]) for t in ids}
    assert len(heads) == K and len({h[:4] for h in heads}) == K  # different prefixes differ from their start
    # seeded: the same settings send the same prompts; another seed, other ones
    stub("ok")
    run_loadtest(s, {})
    assert sorted(r["prompt"] for r in Stub.seen) == sorted(prompts)
    stub("ok")
    s.seed = 6
    run_loadtest(s, {})
    assert {tuple(encode(r["prompt"])[:P]) for r in Stub.seen} != heads


def test_cli_shared_prefix_table_json_and_bad_values(stub, capsys, tmp_path):
    url = stub("cached_openai")
    code, out, err = cli(capsys, "loadtest", url, "--requests", "4", "--concurrency", "1", "--max-tokens", "4",
                         "--shared-prefix-tokens", "32", "--prefixes", "2", "--suffix-tokens", "8", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["settings"]["shared_prefix_tokens"] == 32 and data["settings"]["prefixes"] == 2
    assert data["levels"][0]["prefix_cache_hit_rate"] == pytest.approx(0.3)
    assert "cache hit" in err and "30.0%" in err and "shared prefix 32 tok x 2" in err
    for args, message in ((["--prefixes", "0"], "--prefixes must be at least 1"),
                          (["--suffix-tokens", "0"], "--suffix-tokens must be at least 1"),
                          (["--shared-prefix-tokens", "-1"], "--shared-prefix-tokens must be >= 0"),
                          (["--shared-prefix-tokens", "8", "--prompts-file", str(tmp_path / "p.txt")], "--prompts-file and --shared-prefix-tokens")):
        code, _, err = cli(capsys, "loadtest", url, *args)
        assert_one_line_error(code, err, UsageError.exit_code, message)


def test_a_version_1_result_still_renders(stub):
    from rich.console import Console

    from gpt2x.bench.loadtest import loadtest_table

    result = run_loadtest(LoadtestSettings(url=stub("cached_openai"), requests=2, concurrency=[1], timeout=10), {})
    result["schema_version"] = 1
    for key in ("shared_prefix_tokens", "prefixes", "suffix_tokens", "prefix_token_counts"):
        del result["settings"][key]
    for key in ("prompt_tokens", "prompt_tokens_stated", "cached_prompt_tokens", "prefix_cache_hit_rate"):
        del result["levels"][0][key]
    console = Console(width=400, record=True)
    console.print(loadtest_table(result))
    text = console.export_text()
    assert "5 prompts" in text and "n/a" in text


@pytest.mark.parametrize("width", [80, 100])
def test_the_table_keeps_every_figure_whole_at_80_and_100_columns(stub, width):
    """rich cut a figure that did not fit (`3…`, every number at 100 columns); the table folds or wraps instead:
    each figure of each level is whole on some line of the rendered text, and nothing is cut."""
    from rich.console import Console

    from gpt2x.bench.loadtest import _ms, loadtest_table

    result = run_loadtest(LoadtestSettings(url=stub("cached_openai"), requests=4, concurrency=[1, 2], timeout=10), {})
    console = Console(width=width, record=True)
    console.print(loadtest_table(result))
    text = console.export_text()
    assert "…" not in text
    words = set(text.split())
    for lv in result["levels"]:
        figures = [f"{lv['output_token_throughput']:.1f}", f"{lv['wall_s']:.2f}"]
        figures += [_ms(lv[m], k) for m in ("ttft", "itl", "e2e") for k in ("p50_ms", "p90_ms", "p99_ms")]
        assert all(f in words for f in figures), (figures, text)
