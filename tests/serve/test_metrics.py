"""`/metrics`, `/tokenize` and `/detokenize` of a replica in this process (openai/routes.py's local_app, the routes
Ray Serve serves): the metrics scraped with prometheus-client's own parser after a known set of
requests and checked against what the responses said (usage, finish reasons, one observation per
choice); the tokenizer routes against gpt2x's tokenizer; every bad input a 4xx in OpenAI's error
shape. The same metrics summed over two replicas through Ray: tests/test_serve.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Finished, Output, TokenOut
from gpt2x.serve.openai import metrics as prom
from gpt2x.serve.openai.routes import local_app
from gpt2x.serve.openai.service import CompletionService
from gpt2x.tokenizer import EOT_ID, decode, encode

from ..helpers import counts, expected_moves, histogram_count, scrape, streamed, value

KEY = "metrics-key-7"
LINES_FOR_CACHE = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
                   "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"]
# gpt2x's names and vLLM's (the README's table): every one of these is on /metrics.
NAMES = {
    "gpt2x:num_requests_running": ("gauge", "vllm:num_requests_running"),
    "gpt2x:num_requests_waiting": ("gauge", "vllm:num_requests_waiting"),
    "gpt2x:prompt_tokens": ("counter", "vllm:prompt_tokens_total"),
    "gpt2x:generation_tokens": ("counter", "vllm:generation_tokens_total"),
    "gpt2x:request_success": ("counter", "vllm:request_success_total"),
    "gpt2x:time_to_first_token_seconds": ("histogram", "vllm:time_to_first_token_seconds"),
    "gpt2x:inter_token_latency_seconds": ("histogram", "vllm:inter_token_latency_seconds"),
    "gpt2x:e2e_request_latency_seconds": ("histogram", "vllm:e2e_request_latency_seconds"),
    "gpt2x:num_replicas": ("gauge", None),
    "gpt2x:prefix_cache_queries": ("counter", "vllm:prefix_cache_queries_total"),
    "gpt2x:prefix_cache_hits": ("counter", "vllm:prefix_cache_hits_total"),
    "gpt2x:kv_cache_usage_perc": ("gauge", "vllm:kv_cache_usage_perc"),
    "gpt2x:num_requests_waiting_by_reason": ("gauge", "vllm:num_requests_waiting_by_reason"),
    "gpt2x:num_preemptions": ("counter", "vllm:num_preemptions_total"),
    "gpt2x:cache_config_info": ("gauge", "vllm:cache_config_info"),
    "gpt2x:iteration_tokens_total": ("histogram", "vllm:iteration_tokens_total"),
    **{f"gpt2x:{name}": ("histogram", f"vllm:{name}") for name in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_num_preemptions")},
}


@pytest.fixture(scope="module")
def service(export_dir):
    s = CompletionService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=8), "shakespeare")
    yield s
    s.close()














def test_metrics_count_what_the_responses_said(client):
    before = scrape(client.get("/metrics").text)
    answers = []
    for body in ({"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0},
                 {"prompt": ["JULIET: O", "KING HENRY:"], "max_tokens": 30, "temperature": 0.9, "seed": 3},
                 {"prompt": [encode("First Citizen:")], "max_tokens": 40, "temperature": 1.0, "seed": 1},
                 {"prompt": "", "max_tokens": 200, "temperature": 1.0, "seed": 5},
                 # the bundled model all but never writes <|endoftext|>: a bias makes it end choices so
                 {"prompt": ["ROMEO:", "JULIET:"], "max_tokens": 40, "temperature": 1.0, "seed": 2,
                  "logit_bias": {str(EOT_ID): 16}},
                 {"prompt": "KING:", "max_tokens": 10, "logit_bias": {str(EOT_ID): 100}}):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        answers.append((r.json()["usage"], [c["finish_reason"] for c in r.json()["choices"]]))
    answers.append(streamed(client, {"prompt": ["To be", "or not"], "max_tokens": 25, "temperature": 0}))
    answers.append(streamed(client, {"prompt": "HAMLET:", "max_tokens": 250, "temperature": 1.0, "seed": 9}))
    after = scrape(client.get("/metrics").text)
    moved = {k: after_v - counts(before)[k] for k, after_v in counts(after).items()}
    assert moved == expected_moves(answers, stop_strings=False)
    assert moved["stop"] >= 3 and moved["length"] > 0  # both reasons seen (seeded: the same every run)


def test_stop_strings_and_errors(client):
    before = counts(scrape(client.get("/metrics").text))
    full = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0}).json()
    cut = full["choices"][0]["text"][5:8]
    answers = [(full["usage"], [full["choices"][0]["finish_reason"]])]
    r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0, "stop": cut}).json()
    answers.append((r["usage"], [r["choices"][0]["finish_reason"]]))
    answers.append(streamed(client, {"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0, "stop": [cut]}))
    assert answers[1][1] == answers[2][1] == ["stop"]
    # refused requests count nothing (vLLM counts a request once it has finished)
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": -1}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "a", "model": "other"}).status_code == 404
    after = counts(scrape(client.get("/metrics").text))
    moved = {k: after[k] - before[k] for k in after}
    want = expected_moves(answers, stop_strings=True)
    assert {k: moved[k] for k in want} == want
    assert moved["inter_token_latency_seconds"] >= want["generation"] - 3


def test_the_text_format_and_its_names(client):
    client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = scrape(r.text)
    twins = {name: name.replace("gpt2x:", "vllm:") for name, (_, vllm) in NAMES.items() if vllm}
    assert {name: kind for name, (kind, _) in families.items()} == \
        {name: kind for name, (kind, _) in NAMES.items()} | {twins[name]: kind for name, (kind, _) in NAMES.items() if name in twins}
    for name, (kind, vllm) in NAMES.items():  # the text names them as vLLM does, and again under gpt2x's prefix
        assert f"# TYPE {(vllm or name).replace('vllm:', 'gpt2x:')} {kind}\n" in r.text
        if vllm:  # vLLM's own name, unchanged (_total and all): its dashboards and metric tests find it
            assert f"# TYPE {vllm} {kind}\n" in r.text
            ours = {(sample.replace("gpt2x:", "vllm:"), labels): v for (sample, labels), v in families[name][1].items()}
            assert families[twins[name]][1] == ours, name  # the same values under both
    assert value(families, "gpt2x:num_replicas") == 1
    deadline = time.monotonic() + 10  # the engine counts a batch running until its thread is back from it
    while value(families, "gpt2x:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.02)
        families = scrape(client.get("/metrics").text)
    assert value(families, "gpt2x:num_requests_running") == 0 and value(families, "gpt2x:num_requests_waiting") == 0
    for spec in prom.HISTOGRAMS:  # cumulative buckets, the last (+Inf) equal to the count
        samples = families[f"gpt2x:{spec.name}"][1]
        buckets = sorted(((float(dict(labels)["le"]), v) for (name, labels), v in samples.items() if name.endswith("_bucket")))
        assert [b for b, _ in buckets] == [*spec.buckets, float("inf")]
        assert all(a <= b for (_, a), (_, b) in zip(buckets, buckets[1:]))
        assert buckets[-1][1] == histogram_count(families, spec.name) > 0
        total = value(families, f"gpt2x:{spec.name}", f"gpt2x:{spec.name}_sum")
        if spec is prom.PREEMPTIONS:  # never preempted: every choice a 0, in the first bucket
            assert total == 0 and buckets[0][1] == buckets[-1][1]
        else:
            assert total > 0


def test_merge_sums_replicas_and_drops_the_gauges_of_silent_ones():
    a, b = prom.ReplicaMetrics(), prom.ReplicaMetrics()
    a.answered(5, 7, [("stop", 0.2)])
    b.answered(3, 4, [("length", 2.0), ("length", 0.04)])
    sa, sb = a.snapshot(), b.snapshot()
    sa["gauges"], sb["gauges"] = {"running": 2, "waiting": 1}, {"running": 3, "waiting": 0}
    merged = prom.merge([sa, {**sb, "age": 3.5}])  # b has missed fourteen reports (0.25 s apart): gone
    assert prom.merge([sa, {**sb, "age": 1.0}])["gauges"] == {"running": 5, "waiting": 1}  # four missed: still there
    assert merged["counters"] == {"prompt_tokens": 8, "generation_tokens": 11}
    a.aborted(2)
    assert prom.merge([a.snapshot()])["success"] == {"stop": 1, "length": 0, "abort": 2}
    assert merged["success"] == {"stop": 1, "length": 2, "abort": 0}  # every reason written, aborts too
    assert merged["gauges"] == {"running": 2, "waiting": 1} and merged["replicas"] == 1
    e2e = merged["histograms"]["e2e_request_latency_seconds"]
    assert sum(e2e["counts"]) == 3 and e2e["sum"] == pytest.approx(2.24)
    assert e2e["counts"][prom.E2E.buckets.index(0.05)] == 1  # 0.04 s in the (0.025, 0.05] bucket
    families = scrape(prom.render(merged, "m").decode())
    assert families["gpt2x:request_success"][1][("gpt2x:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 2


# ------------------------------------------------------------------ /tokenize and /detokenize


TEXTS = ["ROMEO: wherefore art thou", "", "naïve café — 日本語 🎭", "a<|endoftext|>b", "  spaces\n\tand\ttabs  "]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_and_detokenize_agree_with_the_tokenizer(client, text):
    r = client.post("/tokenize", json={"model": "shakespeare", "prompt": text})
    assert r.status_code == 200, r.text
    ids = encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    assert client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == ids  # GPT-2 adds none
    back = client.post("/detokenize", json={"model": "shakespeare", "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": decode(ids)} and decode(ids) == text


def test_token_strings_and_raw_ids(client):
    body = client.post("/tokenize", json={"prompt": "Hello world<|endoftext|>", "return_token_strs": True}).json()
    assert body["tokens"] == [15496, 995, EOT_ID] and body["token_strs"] == ["Hello", "Ġworld", "<|endoftext|>"]
    split = encode("日")  # a character over more than one token: the pieces are no text alone
    assert len(split) > 1 and client.post("/detokenize", json={"tokens": split[:1]}).json()["prompt"] == decode(split[:1])
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


BAD_TOKENIZE = [
    ("/tokenize", b"{", 400, None), ("/tokenize", b"[1]", 400, None), ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"), ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "gpt2-xl"}, 404, "model"),
    ("/tokenize", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413, None),
    ("/detokenize", {}, 400, "tokens"), ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 50257]}, 400, "tokens"), ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens"), ("/detokenize", {"tokens": [1], "model": "x"}, 404, "model"),
    ("/detokenize", b'{"tokens": [1], "x": NaN}', 400, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_TOKENIZE, ids=[f"{i}-{p}-{s}" for i, (p, _, s, _) in enumerate(BAD_TOKENIZE)])
def test_bad_tokenizer_input_is_a_4xx_json_error(client, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert "Traceback" not in r.text


def test_the_api_key_guards_metrics_and_the_tokenizer(service):
    with TestClient(local_app(service, api_key=KEY)) as c:
        for method, path in (("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize")):
            r = c.request(method, path, json={"prompt": "a", "tokens": [1]})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/metrics", headers=auth).status_code == 200
        assert c.post("/tokenize", json={"prompt": "a"}, headers=auth).json()["tokens"] == encode("a")
        schema = c.get("/openapi.json").json()
        assert {"/tokenize", "/detokenize"} <= set(schema["paths"]) and "/metrics" not in schema["paths"]
        for name in ("TokenizeRequest", "DetokenizeRequest", "TokenizeResponse", "DetokenizeResponse"):
            assert name in schema["components"]["schemas"]
        assert schema["paths"]["/tokenize"]["post"]["security"] == [{"bearer": []}, {}]


def test_speculative_counters_are_the_engines(export_dir):
    """With a draft, vLLM's spec_decode counters: the drafts (verifications), drafted and accepted
    tokens the engine counted (/health's drafts, drafted, accepted); without one, none are written."""
    from gpt2x.generation.speculative import NgramDrafter

    service = CompletionService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=1),
                                "shakespeare", drafter=NgramDrafter(), draft_name="ngram")
    try:
        with TestClient(local_app(service)) as c:
            text = "To be, or not to be, that is the question. To be, or not to be, that is"
            for seed in range(3):
                assert c.post("/v1/completions", json={"prompt": text, "max_tokens": 40, "temperature": 0.5,
                                                       "seed": seed}).status_code == 200
            h = c.get("/health").json()
            families = scrape(c.get("/metrics").text)
    finally:
        service.close()
        service.backend.close()
    assert h["drafts"] > 0 and h["drafted"] > 0
    assert value(families, "gpt2x:spec_decode_num_drafts", "gpt2x:spec_decode_num_drafts_total") == h["drafts"]
    assert value(families, "gpt2x:spec_decode_num_draft_tokens", "gpt2x:spec_decode_num_draft_tokens_total") == h["drafted"]
    assert value(families, "gpt2x:spec_decode_num_accepted_tokens",
                 "gpt2x:spec_decode_num_accepted_tokens_total") == h["accepted"]
    assert histogram_count(families, "time_to_first_token_seconds") == 3  # one per choice, drafted or not


def test_prefix_cache_counters_are_what_the_responses_said(client):
    """The prefix cache's counters (vLLM's, in tokens) move by the prompt tokens looked up and by the
    cached tokens the responses state (usage.prompt_tokens_details): a prompt sent again finds every
    whole block of it but the one holding its last token (16 tokens a block), streamed or not."""
    prompt = " ".join(LINES_FOR_CACHE)
    ids = encode(prompt)
    before = scrape(client.get("/metrics").text)
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
    again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
    streamed_usage, _ = streamed(client, {"prompt": prompt, "max_tokens": 3, "temperature": 0})
    after = scrape(client.get("/metrics").text)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"] == streamed_usage["prompt_tokens_details"] == \
        {"cached_tokens": (len(ids) - 1) // 16 * 16}
    hits = [u["prompt_tokens_details"]["cached_tokens"] for u in (first["usage"], again["usage"], streamed_usage)]
    moved = {name: value(after, f"gpt2x:{name}", f"gpt2x:{name}_total") - value(before, f"gpt2x:{name}", f"gpt2x:{name}_total")
             for name in ("prefix_cache_queries", "prefix_cache_hits")}
    assert moved == {"prefix_cache_queries": 3 * len(ids), "prefix_cache_hits": sum(hits)}


def test_no_speculative_counters_without_a_draft(client):
    assert not any(name.startswith("gpt2x:spec_decode") for name in scrape(client.get("/metrics").text))


def moved_histograms(before: dict, after: dict, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(count, sum) each histogram moved by."""
    out = {}
    for name in names:
        family = f"gpt2x:{name}"
        count = value(after, family, f"{family}_count") - value(before, family, f"{family}_count")
        out[name] = (count, value(after, family, f"{family}_sum") - value(before, family, f"{family}_sum"))
    return out


REQUEST_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                      "request_params_max_tokens", "request_queue_time_seconds", "request_inference_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds", "e2e_request_latency_seconds")


def test_vllms_request_histograms_count_a_known_set_of_requests(service):
    with TestClient(local_app(service)) as client:  # its metrics hear the engine (the last app made on it does)
        known_requests(client)


def known_requests(client) -> None:
    lone = "Zebra quartz vowels, softly:"  # shorter than a prefix cache block: prefilled whole, alone
    before = scrape(client.get("/metrics").text)
    a = client.post("/v1/completions", json={"prompt": lone, "max_tokens": 7, "temperature": 0, "ignore_eos": True}).json()
    mid = scrape(client.get("/metrics").text)
    # vLLM observes each step's prompt tokens plus the tokens it sampled (vllm/v1/metrics/loggers.py): the prefill
    # with its first token, then a step of one token for each token after the first, P + G in all
    assert moved_histograms(before, mid, ("iteration_tokens_total",)) == {
        "iteration_tokens_total": (7, len(encode(lone)) + 7)}
    prompts = ["JULIET: O Romeo", "KING HENRY: Once more"]
    b = client.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0.9,
                                              "seed": 1}).json()
    after = scrape(client.get("/metrics").text)
    moved = moved_histograms(before, after, REQUEST_HISTOGRAMS)
    assert moved["request_prompt_tokens"] == (5, len(encode(lone)) + 2 * sum(len(encode(p)) for p in prompts))
    assert moved["request_generation_tokens"] == (5, a["usage"]["completion_tokens"] + b["usage"]["completion_tokens"])
    assert moved["request_params_n"] == (3, 1 + 2 + 2)  # vLLM's request: a prompt, with its n
    assert moved["request_params_max_tokens"] == (3, 7 + 5 + 5)
    for phase in ("queue", "inference", "prefill", "decode"):
        assert moved[f"request_{phase}_time_seconds"][0] == 5
    inference, prefill, decode_ = (moved[f"request_{p}_time_seconds"][1] for p in ("inference", "prefill", "decode"))
    assert inference == pytest.approx(prefill + decode_, abs=1e-6)
    assert moved["request_queue_time_seconds"][1] + inference <= moved["e2e_request_latency_seconds"][1]
    assert value(after, "gpt2x:num_preemptions", "gpt2x:num_preemptions_total") == 0  # never preempts
    assert value(after, "gpt2x:num_requests_waiting_by_reason", reason="capacity") == 0
    assert value(after, "gpt2x:num_requests_waiting_by_reason", reason="deferred") == 0
    info = next(labels for (name, labels) in after["gpt2x:cache_config_info"][1])
    assert dict(info)["max_batch_size"] == "8" and dict(info)["max_model_len"] == "256"


def test_kv_cache_usage_is_the_batchs_positions(service):
    """A lone row's KV usage, read as each of its tokens is told (on the engine's thread): its cache
    holds its prompt and the tokens fed back so far, of max_batch_size x the context."""
    seen: list[float] = []
    done = threading.Event()

    def sink(out: Output) -> None:
        if isinstance(out, TokenOut):
            seen.append(service.engine.stats()["kv_cache_usage_perc"])
        elif isinstance(out, (Finished, Failed)):
            done.set()

    ids = encode("A lone row, to be measured")
    service.engine.submit([Row(ids, SamplingSettings(max_new_tokens=6, greedy=True, ignore_eos=True), sink)])
    assert done.wait(30)
    assert seen == [pytest.approx((len(ids) + t) / (8 * 256)) for t in range(6)]
    assert service.engine.stats()["kv_cache_usage_perc"] == 0.0  # idle
