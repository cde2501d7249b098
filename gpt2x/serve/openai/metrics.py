"""The served API's Prometheus metrics (`GET /metrics`), named as vLLM names its own (`vllm:prompt_tokens_total`),
each written again under gpt2x's prefix (`gpt2x:prompt_tokens_total`, the names of earlier releases), summed over
every replica.

Each replica keeps plain counters and histogram buckets (`ReplicaMetrics`): the engine's thread times
each token a row samples (engine.Observer: a row's first token from when it was queued, then the gap
since its previous token; the end-of-text token that ends a row is one), and the HTTP side counts each request it answered, from what the client
received (its usage, its choices' finish reasons, how long each choice took). A `snapshot()` is plain
values; a replica hands its snapshot to one place shared by the replicas (ray/deploy.py's hub under Ray
Serve, the replica itself in one process: `LocalExchange`), and `/metrics` sums the snapshots
(`merge`) and writes them in Prometheus' text format with prometheus-client (`render`).

What counts as a request is vLLM's: vLLM splits a completions request with k prompts into k requests,
so a choice is a request here: `request_success_total` counts choices by finish reason, and the
time-to-first-token and end-to-end histograms have one observation per choice. Token counts are the
responses' usage. The running and waiting gauges are rows in the engines (choices), as vLLM's are
requests in its scheduler; a replica that stopped reporting (it died) adds its counters, which
Prometheus expects never to go down, and no longer its gauges.

vLLM's per-request histograms: each choice's prompt and generated tokens (from its response), each
prompt's n and max_tokens (vLLM's request is a prompt with its n), and each row's phases as the engine
saw them (engine.Observer.finished): queued, prefill (to its first token), decode (to its last),
inference (both); `iteration_tokens_total`, vLLM's tokens of each model step: the prompt tokens it ran and the
tokens it sampled (a prompt's last chunk adds its rows' first tokens; one per live row of a decode step; speculative
rounds are not counted), P + G for a request of P prompt tokens and G generated. Gauges: the KV in use
(`kv_cache_usage_perc`: the positions the batch's cache holds, of max_batch_size x the context),
requests waiting by reason (all for "capacity": none is deferred), the cache's settings
(`cache_config_info`); `num_preemptions_total` is 0: the scheduler never preempts a row.
"""

from __future__ import annotations

import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ..core.engine import Engine, Row

# vLLM's names, unchanged, so that its dashboards and metric tests find them; gpt2x's own prefix kept as an alias.
PREFIX = "vllm:"
ALIAS_PREFIX = "gpt2x:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# A replica whose last snapshot is older than this no longer adds its gauges: a replica reports every 0.25 s where its
# values changed, at least every 1 s (ray/hub.REPORT_S, IDLE_REPORT_S), so three idle reports missed.
GAUGE_STALE_S = 3.0
# Always written, 0 until counted (vLLM writes each of its reasons); "abort": a choice whose client
# left before it ended (routes.py notices a disconnect, streamed or not).
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class HistogramSpec:
    name: str  # without the prefix
    help: str
    buckets: tuple[float, ...]  # upper bounds, ascending; +Inf is added


# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones below its first where a small model on
# a CPU lands: gaps between tokens of a few milliseconds, whole requests under 0.3 s.
TTFT = HistogramSpec("time_to_first_token_seconds", "Histogram of time to first token in seconds.", (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0))
ITL = HistogramSpec("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0))
E2E = HistogramSpec("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0))
_LADDER = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)  # vLLM's 1-2-5 buckets (to 10k tokens)
_REQUEST_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
              960.0, 1920.0, 7680.0)
_FINE_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1)  # below vLLM's first bucket, where a small model on a CPU lands
PROMPT_TOKENS = HistogramSpec("request_prompt_tokens", "Number of prefill tokens processed.", _LADDER)
GENERATION_TOKENS = HistogramSpec("request_generation_tokens", "Number of generation tokens processed.", _LADDER)
ITERATION_TOKENS = HistogramSpec("iteration_tokens_total", "Histogram of number of tokens per engine_step.", (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
PARAMS_N = HistogramSpec("request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
PARAMS_MAX_TOKENS = HistogramSpec("request_params_max_tokens", "Histogram of the max_tokens request parameter.", _LADDER)
QUEUE = HistogramSpec("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                      _FINE_S + _REQUEST_S)
INFERENCE = HistogramSpec("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                          _FINE_S + _REQUEST_S)
PREFILL = HistogramSpec("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                        _FINE_S + _REQUEST_S)
DECODE = HistogramSpec("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                       _FINE_S + _REQUEST_S)
# Each choice's preemptions, as vLLM observes each finished request's: the scheduler never preempts, so every one is 0.
PREEMPTIONS = HistogramSpec("request_num_preemptions", "Number of preemptions per request.", (1, 2, 3, 4, 5, 10, 20))
HISTOGRAMS = (TTFT, ITL, E2E, PROMPT_TOKENS, GENERATION_TOKENS, ITERATION_TOKENS, PARAMS_N, PARAMS_MAX_TOKENS, QUEUE,
              INFERENCE, PREFILL, DECODE, PREEMPTIONS)

# The engine's counters that a replica may have (engine.stats(): speculative ones with a draft, the
# prefix cache's with one) and their vLLM names.
ENGINE_COUNTERS = {"drafts": "spec_decode_num_drafts", "drafted": "spec_decode_num_draft_tokens",
                   "accepted": "spec_decode_num_accepted_tokens", "prefix_cache_queries": "prefix_cache_queries",
                   "prefix_cache_hits": "prefix_cache_hits"}
# Written only where a replica has them (vLLM writes its speculative ones only with a draft), with vLLM's help.
OPTIONAL_COUNTERS = {
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
}


class Histogram:
    """Bucket counts (not cumulative; the last is +Inf) and the sum of what was observed."""

    def __init__(self, spec: HistogramSpec):
        self.spec = spec
        self.counts = [0] * (len(spec.buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.spec.buckets, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value


class ReplicaMetrics:
    """One replica's counters and histograms. Thread-safe: the engine's thread calls `token`, the
    event loop `answered`, any thread `snapshot`. Given an engine, it is that engine's observer (the
    one: a second ReplicaMetrics on the same engine takes its place) and reads its gauges."""

    def __init__(self, engine: Engine | None = None):
        self._lock = threading.Lock()
        self._engine = engine
        self._last: weakref.WeakKeyDictionary[Row, float] = weakref.WeakKeyDictionary()  # a row's last token
        self._first: weakref.WeakKeyDictionary[Row, float] = weakref.WeakKeyDictionary()  # a row's first token
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.histograms = {spec.name: Histogram(spec) for spec in HISTOGRAMS}
        self.drained = False  # this replica's engine has stopped (a server's stop), said in its snapshots
        self.config: dict[str, str] = {}  # cache_config_info's labels: the engine's cache settings
        if engine is not None:
            engine.observer = self
            s, cache = engine.settings, engine.prefix_cache
            self.config = {"max_batch_size": str(s.max_batch_size), "max_model_len": str(engine.backend.n_positions),
                           "enable_prefix_caching": str(cache is not None), "prefix_cache_mb": f"{s.prefix_cache_mb:g}",
                           "block_size": str(cache.block_tokens if cache is not None else 0)}

    def token(self, row: Row, now: float) -> None:
        """engine.Observer: a token told to `row` at `now` (time.monotonic)."""
        with self._lock:
            last = self._last.get(row)
            if last is None:
                self.histograms[TTFT.name].observe(max(0.0, now - row.queued_at))
                self._first[row] = now
            else:
                self.histograms[ITL.name].observe(max(0.0, now - last))
            self._last[row] = now

    def finished(self, row: Row, now: float) -> None:
        """engine.Observer: `row` ended at `now`. Its phases, as vLLM times them: queued (from its
        arrival to the engine taking it), prefill (to its first token), decode (to its last) and
        inference (prefill and decode). A row that never ran (cancelled while waiting) has none."""
        if row.scheduled_at is None:
            return
        with self._lock:
            first = self._first.get(row, now)
            last = self._last.get(row, now)
            h = self.histograms
            h[QUEUE.name].observe(max(0.0, row.scheduled_at - row.queued_at))
            h[PREFILL.name].observe(max(0.0, first - row.scheduled_at))
            h[DECODE.name].observe(max(0.0, last - first))
            h[INFERENCE.name].observe(max(0.0, last - row.scheduled_at))

    def iteration(self, tokens: int) -> None:
        """engine.Observer: a model step ran `tokens` tokens."""
        with self._lock:
            self.histograms[ITERATION_TOKENS.name].observe(tokens)

    def answered(self, prompt_tokens: int, generation_tokens: int, choices: Iterable[tuple[str, float]],
                 tokens: Iterable[tuple[int, int]] = (), params: Iterable[tuple[int, int]] = ()) -> None:
        """A request answered in full: its usage, each choice's finish reason and seconds from the
        request's arrival to the choice's end, each choice's prompt and generated tokens (`tokens`),
        and each prompt's n and max_tokens (`params`: vLLM's request is a prompt with its n)."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            for reason, seconds in choices:
                self.success[reason] = self.success.get(reason, 0) + 1
                self.histograms[E2E.name].observe(max(0.0, seconds))
                self.histograms[PREEMPTIONS.name].observe(0)
            for prompt, generated in tokens:
                self.histograms[PROMPT_TOKENS.name].observe(prompt)
                self.histograms[GENERATION_TOKENS.name].observe(generated)
            for n, max_tokens in params:
                self.histograms[PARAMS_N.name].observe(n)
                self.histograms[PARAMS_MAX_TOKENS.name].observe(max_tokens)

    def aborted(self, choices: int) -> None:
        """Choices abandoned by their client before they ended (vLLM's finished_reason "abort")."""
        with self._lock:
            self.success["abort"] = self.success.get("abort", 0) + choices

    def snapshot(self) -> dict:
        """Plain values (sent between processes): counters, histograms, the engine's gauges and
        speculative counters, when it was taken (time.time) and whether the replica has drained."""
        stats = self._engine.stats() if self._engine is not None else {}
        with self._lock:
            counters = {"prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                        **{name: stats[key] for key, name in ENGINE_COUNTERS.items() if key in stats}}
            return {
                "at": time.time(), "drained": self.drained, "counters": counters, "success": dict(self.success),
                "gauges": {"running": stats.get("running", 0), "waiting": stats.get("waiting", 0),
                           "kv_cache_usage_perc": stats.get("kv_cache_usage_perc", 0.0)},
                "config": self.config,
                "histograms": {name: {"counts": list(h.counts), "sum": h.sum} for name, h in self.histograms.items()},
            }


def merge(snapshots: Iterable[dict], now: float | None = None) -> dict:
    """The replicas' snapshots summed: counters, finish reasons and histograms of every snapshot; gauges
    of those no older than GAUGE_STALE_S (their `age` where the hub gave one, on its clock; else from their
    `at` to `now`, time.time); `replicas`, how many those are."""
    now = time.time() if now is None else now
    total: dict = {"counters": {}, "success": dict.fromkeys(FINISH_REASONS, 0), "config": {},
                   "gauges": {"running": 0, "waiting": 0},
                   "histograms": {spec.name: {"counts": [0] * (len(spec.buckets) + 1), "sum": 0.0} for spec in HISTOGRAMS},
                   "replicas": 0}
    for snap in snapshots:
        for name, value in snap["counters"].items():
            total["counters"][name] = total["counters"].get(name, 0) + value
        for reason, value in snap["success"].items():
            total["success"][reason] = total["success"].get(reason, 0) + value
        for name, h in snap["histograms"].items():
            into = total["histograms"].get(name)
            if into is not None and len(into["counts"]) == len(h["counts"]):  # the same buckets (same code)
                into["counts"] = [a + b for a, b in zip(into["counts"], h["counts"])]
                into["sum"] += h["sum"]
        total["config"] = total["config"] or snap.get("config", {})  # the replicas' own (the same settings)
        if snap.get("age", now - snap["at"]) < GAUGE_STALE_S:
            total["replicas"] += 1
            for name, value in snap["gauges"].items():
                total["gauges"][name] = total["gauges"].get(name, 0) + value
    return total


class _Collector:
    """A merged snapshot as prometheus-client's metric families (a custom collector)."""

    def __init__(self, merged: dict, model: str, prefix: str = PREFIX):
        self.merged = merged
        self.model = model
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        m, labels, model, prefix = self.merged, ["model_name"], [self.model], self.prefix
        gauges = (("num_requests_running", "running", "Number of requests in model execution batches."),
                  ("num_requests_waiting", "waiting", "Number of requests waiting to be processed."))
        for name, key, text in gauges:
            g = GaugeMetricFamily(prefix + name, text, labels=labels)
            g.add_metric(model, m["gauges"].get(key, 0))
            yield g
        # KV in use across the replicas: their mean (vLLM's is one engine's fraction, 1 = full)
        kv = GaugeMetricFamily(prefix + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        kv.add_metric(model, m["gauges"].get("kv_cache_usage_perc", 0.0) / max(1, m["replicas"]))
        yield kv
        # Every waiting request waits for room in the batch ("capacity"); none is deferred (vLLM's
        # other reason: waiting on something else, such as a grammar's compilation).
        by_reason = GaugeMetricFamily(prefix + "num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
                                      labels=["model_name", "reason"])
        by_reason.add_metric([self.model, "capacity"], m["gauges"].get("waiting", 0))
        by_reason.add_metric([self.model, "deferred"], 0)
        yield by_reason
        # The scheduler never preempts a running row (a join waits until every row keeps room): always 0.
        preemptions = CounterMetricFamily(prefix + "num_preemptions", "Cumulative number of preemption from the engine.",
                                          labels=labels)
        preemptions.add_metric(model, 0)
        yield preemptions
        config = m.get("config") or {}
        info = GaugeMetricFamily(prefix + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["model_name", *sorted(config)])
        info.add_metric([self.model, *(config[k] for k in sorted(config))], 1)
        yield info
        if prefix == ALIAS_PREFIX:  # gpt2x's own, under its own prefix only (vLLM has no such name)
            replicas = GaugeMetricFamily(prefix + "num_replicas", "Replicas whose metrics are summed here.", labels=labels)
            replicas.add_metric(model, m["replicas"])
            yield replicas
        counters = (("prompt_tokens", "Number of prefill tokens processed."),
                    ("generation_tokens", "Number of generation tokens processed."))
        for name, text in counters:
            c = CounterMetricFamily(prefix + name, text, labels=labels)
            c.add_metric(model, m["counters"].get(name, 0))
            yield c
        success = CounterMetricFamily(prefix + "request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        for reason, value in sorted(m["success"].items()):
            success.add_metric([self.model, reason], value)
        yield success
        for name, text in OPTIONAL_COUNTERS.items():  # only where a replica has them
            if name in m["counters"]:
                c = CounterMetricFamily(prefix + name, text, labels=labels)
                c.add_metric(model, m["counters"][name])
                yield c
        for hspec in HISTOGRAMS:
            h = m["histograms"][hspec.name]
            cumulative, buckets = 0, []
            for bound, count in zip((*hspec.buckets, float("inf")), h["counts"]):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family = HistogramMetricFamily(prefix + hspec.name, hspec.help, labels=labels)
            family.add_metric(model, buckets, h["sum"])
            yield family


class _Models:
    """Several models' merged snapshots as one set of families: each family once (its HELP and TYPE once), with
    every model's samples under its own model_name, so that several models make one valid exposition."""

    def __init__(self, models: Sequence[tuple[dict, str]], prefix: str):
        self.models = models
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for merged, model in self.models:
            for family in _Collector(merged, model, self.prefix).collect():
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        yield from families.values()


def render(merged: dict, model: str) -> bytes:
    """A merged snapshot in Prometheus' text format (CONTENT_TYPE), every metric labelled model_name, under vLLM's
    names and again under gpt2x's prefix."""
    return render_models([(merged, model)])


def render_models(models: Sequence[tuple[dict, str]]) -> bytes:
    """`render` for several models' merged snapshots (each with its model_name), as one exposition."""
    registry = CollectorRegistry(auto_describe=False)
    for prefix in (PREFIX, ALIAS_PREFIX):
        registry.register(_Models(models, prefix))
    return generate_latest(registry)


class LocalExchange:
    """Where a replica served in one process (routes.local_app) finds the replicas' snapshots: itself."""

    shared = False

    async def publish(self, snapshot: dict) -> None:
        return None

    async def gather(self, own: dict) -> list[dict]:
        return [own]
