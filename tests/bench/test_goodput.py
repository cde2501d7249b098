"""`gpt2x loadtest --goodput`: which requests are good (vLLM's ttft, tpot and e2el goals, and gpt2x's itl), each level's
goodput and good share, the highest rate that held the SLO, the option parsing that refuses bad goals and sweeps
before any request, and a rate sweep against a real `gpt2x serve` in this process (a tiny random model, a few
requests of a few tokens)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import httpx  # noqa: F401 (the test extra's: a broken install fails here, rather than skipping)
import pytest

from gpt2x.bench.loadtest import (
    LoadtestSettings,
    RequestRecord,
    goal_metrics,
    is_good,
    loadtest_tables,
    parse_goals,
    parse_rates,
    run_loadtest,
    slo_summary,
    summarize_level,
    within_slo,
)
from gpt2x.errors import UsageError

from ..helpers import assert_one_line_error, cli, http_server, uvicorn_server


def done(ttft: float | None, e2e: float, tokens: int, itl: list[float]) -> RequestRecord:
    return RequestRecord(ok=True, ttft=ttft, e2e=e2e, output_tokens=tokens, chunks=tokens, itl=itl)


# Times in seconds, each exact in binary (so that a metric equal to its goal is exactly equal, in ms too):
#   request  ttft ms  tpot ms                 worst itl ms  e2el ms
#   A        125      (625-125)/4 = 125       187.5         625
#   B        250      (1250-250)/8 = 125      250           1250
#   C        500      0 (one token, as vLLM)  0 (one chunk) 500
#   E        62.5     (2062.5-62.5)/4 = 500   1000          2062.5
#   D failed, and a sixth request never finished (the level's deadline): neither is ever good.
RECORDS = [
    done(0.125, 0.625, 5, [0.0625, 0.1875, 0.125, 0.125]),
    done(0.25, 1.25, 9, [0.125] * 6 + [0.25, 0.125]),
    done(0.5, 0.5, 1, []),
    RequestRecord(ok=False, error="http_500", detail="boom"),
    done(0.0625, 2.0625, 5, [1.0, 0.5, 0.25, 0.25]),
]


def test_goal_metrics_of_a_request_in_ms():
    assert goal_metrics(RECORDS[0]) == {"ttft": 125.0, "tpot": 125.0, "itl": 187.5, "e2el": 625.0}
    assert goal_metrics(RECORDS[2]) == {"ttft": 500.0, "tpot": 0.0, "itl": 0.0, "e2el": 500.0}
    # an answer that streamed no text has no first token: its TTFT is its whole latency
    assert goal_metrics(done(None, 0.75, 0, []))["ttft"] == 750.0
    assert is_good(RECORDS[0], {"e2el": 625}) and not is_good(RECORDS[0], {"e2el": 624.9})
    assert not is_good(RECORDS[3], {"e2el": 1e9})  # a failed request meets no goal


@pytest.mark.parametrize("goals, good", [
    ({"ttft": 250}, 3),  # A, B (at its goal exactly: "at or below"), E; not C (500)
    ({"tpot": 125}, 3),  # A and B at the goal, C (one token: 0); not E (500)
    ({"ttft": 250, "tpot": 125}, 2),  # A, B: every goal, not any one
    ({"e2el": 1000}, 2),  # A, C
    ({"itl": 250}, 3),  # A, B, C (no gap)
    ({"itl": 200}, 2),  # A, C: B's one 250 ms gap is its worst
    ({"ttft": 250, "tpot": 125, "itl": 200, "e2el": 1000}, 1),  # A alone
    ({"tpot": 0.001}, 1),  # C: vLLM counts a one-token answer's TPOT as 0
    ({"ttft": 0.001}, 0),
])
def test_goodput_of_hand_made_requests(goals, good):
    """Six requests sent over 2 s: the good ones (completed, every goal met), their share of the six and their rate."""
    lv = summarize_level(4, RECORDS, 2.0, 6, rate=3.0, goals=goals, slo_fraction=0.5)
    assert lv["good"] == good
    assert lv["good_fraction"] == pytest.approx(good / 6)
    assert lv["goodput_rps"] == pytest.approx(good / 2.0)
    assert lv["meets_slo"] is (good >= 3) and lv["rate"] == 3.0
    assert lv["completed"] == 4 and lv["failures"] == {"deadline": 1, "http_500": 1}


def test_without_goals_a_level_states_no_goodput():
    lv = summarize_level(1, RECORDS, 2.0, 5)
    assert (lv["good"], lv["good_fraction"], lv["goodput_rps"], lv["meets_slo"]) == (None, None, None, None)
    assert within_slo([lv], 0.5) == (None, None)


def level(rate, fraction, concurrency=4):
    return {"rate": rate, "concurrency": concurrency, "good_fraction": fraction, "goodput_rps": fraction * (rate or 1)}


def test_the_highest_rate_within_the_slo_of_hand_made_levels():
    levels = [level(1, 1.0), level(2, 0.95), level(4, 0.9), level(8, 0.5), level(16, 0.2)]
    assert within_slo(levels, 0.9) == (4, None)  # 0.9 of requests at 4 req/s: "at least" the fraction
    assert within_slo(levels, 0.91) == (2, None)
    assert within_slo(levels, 1.0) == (1, None)
    assert within_slo(levels, 0.1) == (16, None)
    assert within_slo(levels[3:], 0.9) == (None, None)  # none held: null
    # the highest that held, not the last before the first miss: 2 req/s missed by noise, 4 held
    assert within_slo([level(1, 1.0), level(2, 0.8), level(4, 0.95), level(8, 0.3)], 0.9) == (4, None)
    # closed-loop levels answer with their concurrency
    closed = [level(None, 1.0, 1), level(None, 0.92, 4), level(None, 0.4, 16)]
    assert within_slo(closed, 0.9) == (None, 4) and within_slo(closed, 0.95) == (None, 1)


def test_the_summary_line_of_hand_made_results():
    settings = {"goodput": {"ttft": 500.0, "tpot": 50.0}, "slo_fraction": 0.9, "stop_after_misses": 2}
    levels = [level(1, 1.0), level(2, 0.95), level(4, 0.5), level(8, 0.2)]
    result = {"settings": settings, "levels": levels, "max_rate_within_slo": 2, "rates_not_run": [16, 32]}
    assert slo_summary(result) == ("highest rate within SLO: 2 req/s (at least 90% of requests met ttft <= 500 ms, "
                                   "tpot <= 50 ms; goodput 1.90 req/s); the sweep stopped after 2 consecutive rates "
                                   "missed (16, 32 req/s not run)")
    result = {"settings": settings, "levels": levels[2:], "max_rate_within_slo": None, "rates_not_run": []}
    assert slo_summary(result) == ("no rate within SLO: fewer than 90% of requests met ttft <= 500 ms, tpot <= 50 ms "
                                   "at every rate tried (4, 8 req/s)")
    assert slo_summary({"settings": {"goodput": {}}, "levels": levels}) is None  # no goals, no line


def test_goal_and_rate_syntax():
    assert parse_goals(["ttft:500", "tpot=50,e2el:2000ms", "ITL:80 "]) == {"ttft": 500, "tpot": 50, "e2el": 2000, "itl": 80}
    assert parse_goals(["ttft:500 tpot:50"]) == {"ttft": 500, "tpot": 50}  # vLLM's space-separated list, quoted
    assert parse_goals([]) == {}
    for bad, message in (("ttft", "is not METRIC:MS"), ("ttft:", "is not METRIC:MS"), ("ttft:fast", "is not METRIC:MS"),
                         ("ttft:500:1", "is not METRIC:MS"), ("latency:5", "unknown metric 'latency'"),
                         ("ttft:0", "positive number of ms"), ("ttft:-5", "positive number of ms"),
                         ("ttft:nan", "positive number of ms"), ("ttft:1,ttft:2", "ttft is given twice")):
        with pytest.raises(UsageError, match=message):
            parse_goals([bad])
    assert parse_rates("8,1,2,4,2", None) == [1, 2, 4, 8]
    assert parse_rates(None, "1:4:1") == [1, 2, 3, 4] and parse_rates(None, "0.1:0.3:0.1") == [0.1, 0.2, 0.3]
    assert parse_rates(None, "1:4.5:2") == [1, 3] and parse_rates(None, None) is None
    for rates, sweep in (("1,x", None), ("0,1", None), (",", None), (None, "1:4"), (None, "4:1:1"), (None, "1:2:0"),
                         (None, "1:100000:1"), ("1", "1:2:1")):
        with pytest.raises(UsageError):
            parse_rates(rates, sweep)


class Counting(BaseHTTPRequestHandler):
    """Answers nothing useful: it only counts what reaches it."""

    hits = 0

    def log_message(self, *args):
        pass

    def do_GET(self):
        Counting.hits += 1
        self.send_response(404)
        self.end_headers()

    do_POST = do_GET


@pytest.fixture(scope="module")
def counting_url():
    with http_server(Counting) as url:
        yield url


@pytest.fixture
def counting_server(counting_url):
    Counting.hits = 0
    return counting_url


@pytest.mark.parametrize("args, message", [
    (["--goodput", "ttft"], "--goodput: 'ttft' is not METRIC:MS"),
    (["--goodput", "ttft:500", "--goodput", "latency:5"], "--goodput: unknown metric 'latency'"),
    (["--goodput", "ttft:500,tpot:zero"], "--goodput: 'tpot:zero' is not METRIC:MS"),
    (["--goodput", "e2el:0"], "--goodput: the e2el goal must be a positive number of ms"),
    (["--rates", "1,fast"], "--rates: 'fast' is not a positive number"),
    (["--sweep-rate", "1:8"], "--sweep-rate: '1:8' is not START:STOP:STEP"),
    (["--sweep-rate", "8:1:1"], "--sweep-rate: STOP 1 is below START 8"),
    (["--rates", "1,2", "--sweep-rate", "1:2:1"], "--rates cannot be used together with --sweep-rate"),
    (["--rates", "1,2", "--rate", "3"], "--rate cannot be used with a rate sweep"),
    (["--rates", "1,2", "--concurrency", "1,4"], "--concurrency takes one value with a rate sweep"),
    (["--goodput", "ttft:500", "--slo-fraction", "0"], "--slo-fraction must be in (0, 1]"),
    (["--goodput", "ttft:500", "--slo-fraction", "1.5"], "--slo-fraction must be in (0, 1]"),
    (["--stop-after-misses", "-1"], "--stop-after-misses must be >= 0"),
])
def test_bad_goals_and_sweeps_are_one_line_before_any_request(counting_server, capsys, args, message):
    code, out, err = cli(capsys, "loadtest", counting_server, "--requests", "2", *args)
    assert_one_line_error(code, err, UsageError.exit_code, message)
    assert Counting.hits == 0 and out == ""


def test_the_counting_server_counts(counting_server, capsys):
    """The check above can fail: valid goals reach the server (which answers 404 to everything: every request fails)."""
    code, _, err = cli(capsys, "loadtest", counting_server, "--requests", "2", "--concurrency", "1", "--goodput", "ttft:500")
    assert code == 11 and Counting.hits == 3, err  # GET /v1/models, then two completions


@pytest.fixture(scope="module")
def served(tiny_export):
    """`gpt2x serve`'s app on a tiny random model (its export made once per test run), on uvicorn in this process."""
    import uvicorn  # noqa: F401 (uvicorn_server's: missing, the tests fail)

    from gpt2x.runtime.ort import OrtBackend
    from gpt2x.serve.core.engine import EngineSettings
    from gpt2x.serve.openai.routes import local_app
    from gpt2x.serve.openai.service import CompletionService

    _, _, info = tiny_export()
    service = CompletionService(OrtBackend(info, threads=1), EngineSettings(max_batch_size=4), "tiny")
    with uvicorn_server(local_app(service)) as port:
        yield f"http://127.0.0.1:{port}"
    service.close()


def test_a_sweep_with_a_generous_goal_holds_at_every_rate(served, capsys, tmp_path):
    """Every request is good under a minute's goals: goodput is the request throughput, and the highest rate tried is
    the answer; the table, the summary line, the JSON, the PNG and the HTML report all say so."""
    import matplotlib  # noqa: F401 (the plot's: missing, the test fails)

    code, out, err = cli(capsys, "loadtest", served, "--requests", "3", "--rates", "40,20", "--max-tokens", "3",
                         "--goodput", "ttft:60000,tpot:60000", "--goodput", "itl:60000", "--goodput", "e2el:60000",
                         "--output", str(tmp_path / "lt.json"), "--plot", str(tmp_path / "lt.png"),
                         "--report", str(tmp_path / "lt.html"))
    assert code == 0, err
    data = json.loads((tmp_path / "lt.json").read_text())
    assert data["schema_version"] == 3 and data["settings"]["rates"] == [20, 40]
    assert data["settings"]["goodput"] == {"ttft": 60000, "tpot": 60000, "itl": 60000, "e2el": 60000}
    assert [lv["rate"] for lv in data["levels"]] == [20, 40]
    for lv in data["levels"]:
        assert lv["completed"] == 3 and lv["good"] == 3 and lv["good_fraction"] == 1.0 and lv["meets_slo"] is True
        assert lv["goodput_rps"] == pytest.approx(lv["request_throughput"])
        assert lv["concurrency"] == 3  # a sweep's default: no cap beyond the level's requests
    assert data["max_rate_within_slo"] == 40 and data["max_concurrency_within_slo"] is None
    assert data["rates_not_run"] == []
    assert "goodput req/s" in out and "100.0%" in out
    assert "highest rate within SLO: 40 req/s (at least 90% of requests met ttft <= 60000 ms" in out
    assert (tmp_path / "lt.png").read_bytes()[:4] == b"\x89PNG"
    html = (tmp_path / "lt.html").read_text()
    assert html.count("<svg") == 3 and "highest rate within SLO: 40 req/s" in html
    assert "http://" not in html.replace(served, "").replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    assert "<script" not in html and "src=" not in html


def test_an_impossible_goal_holds_at_no_rate_and_the_sweep_stops(served, capsys):
    """ttft:0.001 (a microsecond): no request is good, no rate holds (null), and the sweep stops after two misses."""
    code, out, err = cli(capsys, "loadtest", served, "--requests", "2", "--sweep-rate", "20:80:20", "--max-tokens", "2",
                         "--goodput", "ttft:0.001", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [lv["rate"] for lv in data["levels"]] == [20, 40] and data["rates_not_run"] == [60, 80]
    for lv in data["levels"]:
        assert lv["completed"] == 2 and lv["good"] == 0 and lv["goodput_rps"] == 0 and lv["meets_slo"] is False
    assert data["max_rate_within_slo"] is None
    assert "no rate within SLO: fewer than 90% of requests met ttft <= 0.001 ms at every rate tried (20, 40 req/s)" in err
    assert "stopped after 2 consecutive rates missed (60, 80 req/s not run)" in err


def test_closed_loop_goodput_and_an_unchanged_closed_loop(served):
    """Goals on closed-loop levels answer with the concurrency; without goals the levels are as before."""
    s = LoadtestSettings(url=served, requests=2, concurrency=[1, 2], max_tokens=2, timeout=30, goodput={"e2el": 60000})
    result = run_loadtest(s, {})
    assert [(lv["concurrency"], lv["rate"], lv["good"]) for lv in result["levels"]] == [(1, None, 2), (2, None, 2)]
    assert result["max_concurrency_within_slo"] == 2 and result["max_rate_within_slo"] is None
    plain = run_loadtest(LoadtestSettings(url=served, requests=2, concurrency=[2], max_tokens=2, timeout=30), {})
    assert plain["levels"][0]["completed"] == 2 and plain["levels"][0]["good"] is None
    assert plain["max_rate_within_slo"] is None and plain["max_concurrency_within_slo"] is None


@pytest.mark.parametrize("width", [80, 100])
def test_the_goodput_table_keeps_every_figure_whole_at_80_and_100_columns(width):
    """A sweep's goodput table, from hand-made levels, beside a latency table without goodput columns (which fills 80
    columns already): each figure whole, nothing cut, and a level that missed says so."""
    from rich.console import Console

    levels = [summarize_level(64, RECORDS[:3], 1.5, 3, rate=r, goals={"ttft": 250.0}) for r in (0.5, 12.5)]
    levels.append(summarize_level(64, RECORDS[:3], 1.5, 3, rate=250.0, goals={"ttft": 250.0}, slo_fraction=0.6))
    settings = {"url": "http://h:1", "model": "m", "requests": 3, "rate": None, "rates": [0.5, 12.5, 250.0],
                "concurrency": [64], "max_tokens": 8, "prompts": 5, "goodput": {"ttft": 250.0}, "slo_fraction": 0.9}
    latency, goodput = loadtest_tables({"settings": settings, "levels": levels})
    assert [c.header for c in latency.columns][0] == "rate" and "good %" not in [c.header for c in latency.columns]
    console = Console(width=width, record=True)
    console.print(goodput)
    text = console.export_text()
    words = " ".join(text.split())  # the title wraps at the table's width
    assert "…" not in text and "good when it completed with ttft <= 250 ms" in words and "at least 90%" in words
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0] in ("│", "|")]
    cells = [[w for w in row if w not in ("│", "|")] for row in rows]
    # rate, sent, good, good %, goodput req/s (2 of 3 good over 1.5 s), req/s (3 over 1.5 s), holds
    assert cells == [["0.5", "3", "2", "66.7%", "1.33", "2.00", "no"], ["12.5", "3", "2", "66.7%", "1.33", "2.00", "no"],
                     ["250", "3", "2", "66.7%", "1.33", "2.00", "yes"]], text


def test_a_version_2_result_renders_without_goodput(tmp_path):
    """Version-2 results (no rate, no goals): the latency table alone, no SLO line, and an HTML report of it."""
    from gpt2x.bench.loadtest_report import write_report

    levels = [summarize_level(c, RECORDS, 2.0, 6) for c in (1, 4)]
    for lv in levels:
        for key in ("rate", "good", "good_fraction", "goodput_rps", "meets_slo"):
            del lv[key]
    result = {"schema_version": 2, "levels": levels, "settings": {
        "url": "http://h:1", "model": "m", "requests": 6, "rate": None, "concurrency": [1, 4], "max_tokens": 8, "prompts": 5}}
    tables = loadtest_tables(result)
    assert len(tables) == 1 and [c.header for c in tables[0].columns][0] == "conc."
    assert slo_summary(result) is None
    write_report(result, tmp_path / "old.html")
    html = (tmp_path / "old.html").read_text()
    assert html.count("<svg") == 2 and "concurrency (requests in flight)" in html and "goodput" not in html.split("<details>")[0]
