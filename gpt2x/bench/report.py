"""A bench result (results.BenchResult) as Rich tables (the CLI prints them) and as a PNG plot (the
JSON file holds every figure)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.table import Table

from ..errors import UsageError
from ..fileio import write_atomic
from .results import BenchResult, PageFigures


def _f(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def bench_tables(result: BenchResult) -> list[Table]:
    env, bw, settings = result.environment, result.bandwidth, result.settings
    ref = result.reference
    ref_ppl = "not measured" if ref.perplexity is None else f"{ref.perplexity:.2f}"
    parity = Table(title=f"parity vs torch fp32 (reference perplexity {ref_ppl} on {ref.text_tokens} tokens)")
    for col in ("backend", "precision", "max |Δ|", "p99 |Δ|", "rel. max", "top-1", "mean KL", "greedy prefix", "ppl", "Δppl", "gate"):
        parity.add_column(col, justify="right")
    for p in result.parity:
        lg, g = p.logits or {}, p.greedy  # None: an export gated without a parity check
        change = p.perplexity_rel_change
        parity.add_row(
            p.backend.value, p.precision.value, _f(lg.get("max_abs")), _f(lg.get("p99_abs")), _f(lg.get("max_rel")),
            _f(lg.get("top1_agreement"), ".3f"), _f(lg.get("mean_kl")),
            "/".join(map(str, g["identical_prefix"])) + f" of {g['tokens']}" if g else "-",
            _f(p.perplexity, ".2f"), "-" if change is None else f"{change * 100:+.2f}%",
            "pass" if p.passed else "[red]FAIL[/]",
        )
    speed = Table(title=f"speed on {settings.provider.value} ({env.cpu}, {settings.threads} threads; "
                        f"{bw.kind}: {bw.bytes_per_s / 1e9:.1f} GB/s)")
    shares = any(e.native_share is not None for e in result.speed)
    pages = any(e.page is not None for e in result.speed)
    fixed = any(e.decoder is not None for e in result.speed)
    for col in ("backend", "precision", "batch", "cold s", "TTFT ms", "p50 ms", "p90 ms", "p99 ms", "decode tok/s",
                "e2e tok/s", "roofline tok/s", "% roofline", *(["x ort"] if shares else []), "peak RSS MB",
                *(["page tok/s", "page x ort", "page MB"] if pages else []), *(["same tokens"] if fixed else [])):
        speed.add_column(col, justify="right")
    for e in result.speed:
        lat = e.decode_latency
        speed.add_row(
            e.backend.value if e.decoder is None else f"{e.backend.value}, {e.decoder}", e.precision.value, str(e.batch),
            _f(e.cold_start_s, ".2f"), _f(e.ttft_ms, ".1f"),
            _f(lat.get("p50_ms"), ".2f"), _f(lat.get("p90_ms"), ".2f"), _f(lat.get("p99_ms"), ".2f"),
            _f(e.decode_tokens_per_s, ".1f"), _f(e.e2e_tokens_per_s, ".1f"), _f(e.roofline_tokens_per_s, ".0f"),
            f"{e.roofline_share * 100:.0f}%", *([_f(e.native_share, ".2f")] if shares else []),
            _f(e.peak_rss_mb, ".0f"),
            *(page_cells(e.page) if pages else []),
            *([_f(e.same_tokens and e.same_tokens * 100, ".0f") + "%" if e.same_tokens is not None else "-"] if fixed else []),
        )
    skipped = [f"{x.backend.value}/{x.precision.value} ({x.reason})" for x in result.skipped if x.draft is None]
    if skipped:
        speed.caption = "not run: " + "; ".join(skipped)
    tables = [parity, speed]
    best = fastest_table(result)
    if best is not None:
        tables.append(best)
    spec = speculative_table(result)
    if spec is not None:
        tables.append(spec)
    return tables


def fastest_table(result: BenchResult) -> Table | None:
    """The configurations measured best, with the `gpt2x serve` flags that run each; None when no row counts."""
    best = result.fastest
    if not best:
        return None
    env = result.environment
    table = Table(title=f"fastest here ({env.cpu}, {result.settings.threads} threads; parity-passing rows only)")
    for col in ("goal", "backend", "precision", "batch", "decode tok/s", "TTFT ms", "serve with"):
        table.add_column(col, justify="right")
    for f in best:
        flags = f"--backend {f.backend.value} --precision {f.precision.value}"
        if f.goal == "decode" and f.batch > 1:
            flags += f" --max-batch-size {f.batch}"
        table.add_row(f.goal.replace("_", " "), f.backend.value, f.precision.value, str(f.batch),
                      _f(f.decode_tokens_per_s, ".1f"), _f(f.ttft_ms, ".1f"), flags)
    table.caption = "gpt2x serve --from-bench FILE takes the decode row of a bench saved with --output FILE"
    return table


def page_cells(page: PageFigures | None) -> list[str]:
    """A speed row's page tok/s, page x ort and page MB ("-" for a backend without a page)."""
    if page is None:
        return ["-"] * 3
    return [_f(page.decode_tokens_per_s, ".1f"), _f(page.native_share, ".2f"), _f(page.memory_mb, ".0f")]


def speculative_table(result: BenchResult) -> Table | None:
    """The speculative rows (`gpt2x bench --draft`), or None when the bench measured none and skipped none."""
    rows = result.speculative
    skipped = [f"{x.backend.value}/{x.precision.value} with {x.draft} ({x.reason})" for x in result.skipped if x.draft is not None]
    if not rows and not skipped:
        return None
    title = "Speculative decoding (greedy, batch 1"
    if rows:
        first = rows[0]
        title += f", K up to {first.num_speculative_tokens}{' adaptive' if first.adaptive else ''}, " \
                 f"prompt of {first.prompt_len} tokens, {first.new_tokens} new"
    table = Table(title=title + ")")
    for col in ("backend", "precision", "draft", "accept rate", "mean accept len", "decode tok/s", "plain tok/s",
                "x plain", "TTFT ms", "plain steps", "greedy identical", "step cost x N=1 (N=1..8)"):
        table.add_column(col, justify="right")
    for r in rows:
        same = "yes" if r.greedy_identical else f"[red]no[/] (from token {r.first_difference})"
        table.add_row(
            r.backend.value, r.precision.value, r.draft, _f(r.acceptance_rate, ".2f"), _f(r.mean_acceptance_length, ".2f"),
            _f(r.decode_tokens_per_s, ".1f"), _f(r.plain_decode_tokens_per_s, ".1f"), _f(r.speedup, ".2f"),
            _f(r.ttft_ms, ".1f"), str(r.plain_steps), same, " ".join(f"{x:.1f}" for x in r.step_cost_ratio),
        )
    notes = ["accept rate: accepted / drafted tokens; mean accept len: 1 + accepted / verifications (vLLM's); "
             "step cost: a target step over N new tokens / the N=1 step (a verification of N - 1 drafted tokens)"]
    if skipped:
        notes.append("not run: " + "; ".join(skipped))
    table.caption = "\n".join(notes)
    return table


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install 'gpt2x[plot]'") from None
    return plt


def plot(result: BenchResult, path: Path) -> None:
    """Decode tokens/s and per-token latency against context length, one line per configuration."""
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for e in result.speed:
        ctx = [p.context for p in e.latency_by_context]
        ms = [p.ms for p in e.latency_by_context]
        label = f"{e.backend.value} {e.precision.value} b{e.batch}"
        ax1.plot(ctx, [e.batch * 1e3 / m for m in ms], marker="o", label=label)
        ax2.plot(ctx, ms, marker="o", label=label)
    ax1.set(xlabel="context length (tokens)", ylabel="decode tokens/s", title="decode throughput")
    ax2.set(xlabel="context length (tokens)", ylabel="ms per decode step (log scale)", title="per-token latency", yscale="log")
    env = result.environment
    fig.suptitle(f"gpt2x bench: {result.model.name} on {result.settings.provider.value} "
                 f"({env.cpu or ''}, {env.cores or '?'} cores; GPU: {env.gpu or 'none'})", fontsize=9)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_png(fig, path)


def save_png(fig, path: Path) -> None:
    """Lay out, render and close a matplotlib figure, and write it to `path` atomically as a PNG."""
    plt = require_matplotlib()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def save_results(out: Path, data: dict, markdown: str) -> None:
    """OUT.json (every figure) and OUT.md (its table), each written whole; `out` has no extension."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out.with_suffix(".json"), json.dumps(data, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), markdown)

