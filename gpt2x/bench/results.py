"""`gpt2x bench`'s result as typed records, built once by run.py, written by `BenchResult.to_json` and read back
from any schema version by `from_json`. A new figure is a field here (`spec`: its key, reader, optionality); a
renamed key is a new SCHEMA_VERSION, with `from_dict` still reading the old name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from ..choices import BackendKind, Precision, ProviderKind
from ..errors import UsageError

# 2: `speculative` rows, and the settings drafts, draft_tokens and prompt_text; 3: speed rows' native_share
# and native_ttft_ratio (against ort), and the web backend's page_* figures; 4: draft_tokens (settings and
# speculative rows) renamed num_speculative_tokens, vLLM's name (read under both)
SCHEMA_VERSION = 4


def spec(*, key: str | None = None, read: Callable[[Any], Any] | None = None, optional: bool = False, **kw):
    """A record's field: its JSON key (default: its name), how to read it back, and whether None leaves it out."""
    meta = {"key": key, "read": read, "optional": optional}
    return field(metadata=meta, **kw)


def each(read: Callable[[Any], Any]) -> Callable[[list], list]:
    return lambda items: [read(x) for x in items]


def _json_value(value: Any) -> Any:
    """A field's value as JSON holds it: enums by value, records as objects, lists item by item."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


class Record:
    """A dataclass written as, and read from, the JSON object of its fields (see the module's docstring)."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            out[f.metadata.get("key") or f.name] = _json_value(value)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """The record of a JSON object; a key that is absent takes the field's default."""
        kwargs = {}
        for f in fields(cls):
            key = f.metadata.get("key") or f.name
            if key in d:
                read = f.metadata.get("read")
                kwargs[f.name] = d[key] if read is None or d[key] is None else read(d[key])
        return cls(**kwargs)


# ---------------------------------------------------------------- the run: settings, machine, model, bandwidth


@dataclass(frozen=True, kw_only=True)
class RunSettings(Record):
    """The settings a bench ran with, resolved."""

    model: str
    provider: ProviderKind = spec(read=ProviderKind)
    backends: list[BackendKind] = spec(read=each(BackendKind))
    precisions: list[Precision] = spec(read=each(Precision))
    batches: list[int]
    prompt_len: int
    new_tokens: int
    repeat: int
    warmup: int
    threads: int
    text: str
    greedy_tokens: int
    drafts: list[str] = spec(default_factory=list)  # schema 2 on
    num_speculative_tokens: int | None = None  # schema 2 and 3: draft_tokens; None in schema 1
    prompt_text: str | None = None
    kv_cache: str = "auto"  # the ort rows' KV cache form (choices.KvCache); results before it: auto
    fixed_cache: bool | None = spec(default=None, optional=True)  # --fixed-cache as asked (None: on CUDA only)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSettings:
        if "draft_tokens" in d:
            d = {**d, "num_speculative_tokens": d["draft_tokens"]}
        return super().from_dict(d)


@dataclass(frozen=True, kw_only=True)
class Environment(Record):
    """The machine and software measured on (system_info); every field may be absent (tests give the cores alone)."""

    gpt2x: str | None = spec(default=None, optional=True)
    date: str | None = spec(default=None, optional=True)
    platform: str | None = spec(default=None, optional=True)
    cpu: str | None = spec(default=None, optional=True)
    cores: int | None = spec(default=None, optional=True)
    gpu: str | None = spec(default=None, optional=True)
    packages: dict[str, str] | None = spec(default=None, optional=True)
    providers_listed: str | None = spec(default=None, optional=True, key="providers listed")
    providers_loadable: dict[str, str] | None = spec(default=None, optional=True, key="providers loadable")
    hub_cache: str | None = spec(default=None, optional=True, key="hub cache")
    hub_offline: bool | None = spec(default=None, optional=True, key="hub offline")
    exports: str | None = spec(default=None, optional=True)
    git: str | None = spec(default=None, optional=True)


@dataclass(frozen=True, kw_only=True)
class ModelFacts(Record):
    name: str
    config: dict[str, Any]  # GPT2Config.to_dict()
    parameters: int


@dataclass(frozen=True, kw_only=True)
class Bandwidth(Record):
    """The roofline's bandwidth: the higher of before and after the rows (a transient slowdown must not make the
    roofline look easy to reach)."""

    kind: str  # what was measured: a CPU read with N threads, or a GPU device-to-device copy
    samples_bytes_per_s: list[float]
    bytes_per_s: float


@dataclass(frozen=True, kw_only=True)
class Reference(Record):
    """The PyTorch fp32 model every row is compared with: its perplexity (None without PyTorch)."""

    backend: BackendKind = spec(read=BackendKind)
    precision: Precision = spec(read=Precision)
    perplexity: float | None
    text_tokens: int


# ---------------------------------------------------------------- rows


@dataclass(frozen=True, kw_only=True)
class ParityRow(Record):
    """One backend x precision against the reference: the parity gate's figures and perplexity on the bench's text."""

    backend: BackendKind = spec(read=BackendKind)
    precision: Precision = spec(read=Precision)
    source: str  # measured against torch fp32, or recorded at export
    passed: bool
    message: str
    logits: dict[str, Any] | None
    greedy: dict[str, Any] | None
    tolerance: dict[str, Any] | None
    perplexity: float
    perplexity_rel_change: float | None  # None without a reference perplexity


@dataclass(frozen=True, kw_only=True)
class ContextLatency(Record):
    """The median decode step at a context length (one of 8 buckets along the run, for the plot)."""

    context: int
    ms: float


@dataclass(frozen=True, kw_only=True)
class PageFigures(Record):
    """A page backend's own figures, without the logits' trip to Python; flattened into its speed row as page_*."""

    memory_mb: float = spec(key="page_memory_mb")  # the page's process (a browser's renderer), peak
    info: dict[str, Any] = spec(key="page")  # onnxruntime-web's version, threads, isolation, user agent
    ttft_ms: float | None = spec(default=None, optional=True, key="page_ttft_ms")
    decode_tokens_per_s: float | None = spec(default=None, optional=True, key="page_decode_tokens_per_s")
    decode_latency: dict[str, float] | None = spec(default=None, optional=True, key="page_decode_latency")
    native_share: float | None = spec(default=None, optional=True, key="page_native_share")  # its decode tok/s over ort's


@dataclass(frozen=True, kw_only=True)
class SpeedRow(Record):
    """One backend x precision x batch: the timed runs' median, against the roofline and ort's row (`native_*`)."""

    backend: BackendKind = spec(read=BackendKind)
    precision: Precision = spec(read=Precision)
    batch: int
    cold_start_s: float  # opening the backend and its first step
    ttft_ms: float
    decode_latency: dict[str, float]  # metrics.summarize_latencies: p50_ms, p90_ms, p99_ms, mean_ms
    decode_tokens_per_s: float
    e2e_tokens_per_s: float
    roofline_tokens_per_s: float
    roofline_share: float
    latency_by_context: list[ContextLatency] = spec(read=each(ContextLatency.from_dict))
    peak_rss_mb: float
    peak_gpu_mb: float | None = spec(default=None, optional=True)
    native_share: float | None = spec(default=None, optional=True)  # decode tok/s over ort's
    native_ttft_ratio: float | None = spec(default=None, optional=True)  # time to first token over ort's
    page: PageFigures | None = spec(default=None, optional=True)
    prefill: str | None = spec(default=None, optional=True)  # the runtime that ran the prompt (ort: onnxruntime or openvino)
    decoder: str | None = spec(default=None, optional=True)  # ort's rows on StaticDecoder: "fixed cache" (+ " + CUDA graph")
    same_tokens: float | None = spec(default=None, optional=True)  # those rows: the share of tokens equal to ort's plain row's

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        page = out.pop("page", None)
        return out if page is None else {**out, **page}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeedRow:
        row = super().from_dict({k: v for k, v in d.items() if k != "page"})
        if "page_memory_mb" not in d:
            return row
        return cls(**{f.name: getattr(row, f.name) for f in fields(cls) if f.name != "page"},
                   page=PageFigures.from_dict(d))


@dataclass(frozen=True, kw_only=True)
class SpeculativeRow(Record):
    """One backend x precision with one draft (greedy, batch 1) against plain decoding in the same interleaved
    rounds; the draft statistics are vLLM's counters summed over the timed runs."""

    backend: BackendKind = spec(read=BackendKind)
    precision: Precision = spec(read=Precision)
    draft: str  # as asked for: int4, ngram, a model, a folder
    draft_name: str  # the drafter's own name
    num_speculative_tokens: int  # K, the most tokens drafted per verification (schema 2 and 3: draft_tokens)
    adaptive: bool
    prompt_len: int
    new_tokens: int
    timed_runs: int
    acceptance_rate: float | None  # accepted / drafted; None when nothing was drafted
    mean_acceptance_length: float | None  # 1 + accepted / verifications
    drafted: int
    accepted: int
    drafts: int  # verifications: rounds that drafted at least one token
    plain_steps: int
    decode_tokens_per_s: float
    plain_decode_tokens_per_s: float
    speedup: float
    ttft_ms: float
    plain_ttft_ms: float
    step_cost_ms: list[float]  # the target's step over N = 1..8 new tokens
    step_cost_ratio: list[float]  # each over the N = 1 step
    greedy_identical: bool
    first_difference: int | None  # the first token where a speculative run differs

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeRow:
        if "draft_tokens" in d:
            d = {**d, "num_speculative_tokens": d["draft_tokens"]}
        return super().from_dict(d)


@dataclass(frozen=True, kw_only=True)
class Skipped(Record):
    """A backend x precision not run (`draft` None), or a draft not measured on it, and why."""

    backend: BackendKind = spec(read=BackendKind)
    precision: Precision = spec(read=Precision)
    reason: str
    draft: str | None = spec(default=None, optional=True)


@dataclass(frozen=True, kw_only=True)
class Fastest(Record):
    """The configuration measured best at one goal (`decode` or `first_token`, see BenchResult.best)."""

    goal: str
    backend: BackendKind = spec(read=BackendKind)
    precision: Precision = spec(read=Precision)
    batch: int
    decode_tokens_per_s: float
    ttft_ms: float

    @classmethod
    def of(cls, goal: str, row: SpeedRow) -> Fastest:
        return cls(goal=goal, backend=row.backend, precision=row.precision, batch=row.batch,
                   decode_tokens_per_s=row.decode_tokens_per_s, ttft_ms=row.ttft_ms)


GOALS = ("decode", "first_token")


# ---------------------------------------------------------------- the whole result


@dataclass(frozen=True, kw_only=True)
class BenchResult(Record):
    """Every figure of one `gpt2x bench` run. `passed`: every parity row passed its gate."""

    settings: RunSettings = spec(read=RunSettings.from_dict)
    environment: Environment = spec(read=Environment.from_dict)
    model: ModelFacts = spec(read=ModelFacts.from_dict)
    bandwidth: Bandwidth = spec(read=Bandwidth.from_dict)
    reference: Reference = spec(read=Reference.from_dict)
    parity: list[ParityRow] = spec(read=each(ParityRow.from_dict))
    speed: list[SpeedRow] = spec(read=each(SpeedRow.from_dict))
    speculative: list[SpeculativeRow] = spec(default_factory=list, read=each(SpeculativeRow.from_dict))  # schema 2 on
    skipped: list[Skipped] = spec(default_factory=list, read=each(Skipped.from_dict))
    schema_version: int = SCHEMA_VERSION  # of the file read; what to_json writes is SCHEMA_VERSION

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.parity)

    @property
    def fastest(self) -> list[Fastest]:
        """The best measured configuration for each goal (GOALS) among every backend (see `best`)."""
        return [f for f in (self.best(goal) for goal in GOALS) if f is not None]

    def best(self, goal: str, among: tuple[BackendKind, ...] | None = None, batch: int | None = None) -> Fastest | None:
        """The speed row best at `goal` (`decode`: most decode tokens/s at any batch, or at `batch` when given;
        `first_token`: shortest time to first token at batch 1) among rows that did not fail a parity gate; None when
        none qualifies."""
        if goal not in GOALS:
            raise ValueError(f"goal must be one of {', '.join(GOALS)}, not {goal!r}")
        failed = {(p.backend, p.precision) for p in self.parity if not p.passed}
        # A fixed-cache row is not a configuration `gpt2x serve` runs: never named.
        rows = [r for r in self.speed if (r.backend, r.precision) not in failed and (among is None or r.backend in among)
                and (batch is None or r.batch == batch) and r.decoder is None]
        if goal == "first_token":
            rows = [r for r in rows if r.batch == 1]
            return Fastest.of(goal, min(rows, key=lambda r: r.ttft_ms)) if rows else None
        return Fastest.of(goal, max(rows, key=lambda r: r.decode_tokens_per_s)) if rows else None

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        del out["schema_version"]
        return {"schema_version": SCHEMA_VERSION, **out, "passed": self.passed,
                "fastest": [f.to_dict() for f in self.fastest]}

    def to_json(self) -> str:
        """The result as the JSON document `gpt2x bench` writes (schema SCHEMA_VERSION)."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> BenchResult:
        """A result written by `gpt2x bench` (any schema version so far)."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_user_file(cls, text: str, where: str) -> BenchResult:
        """As from_json, for a file a user names: what is not a bench result is one UsageError line."""
        try:
            return cls.from_json(text)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"{where} is not a gpt2x bench result (saved with gpt2x bench --output FILE): "
                             f"{type(e).__name__}: {e}") from None
