"""Rich tables of a bench result (the CLI prints them; the JSON file holds every figure)."""

from __future__ import annotations

from rich.table import Table


def _f(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def bench_tables(result: dict) -> list[Table]:
    env, bw = result["environment"], result["bandwidth"]
    ref = result["reference"]
    parity = Table(title=f"parity vs torch fp32 (reference perplexity {ref['perplexity']:.2f} on {ref['text_tokens']} tokens)")
    for col in ("backend", "precision", "max |Δ|", "p99 |Δ|", "rel. max", "top-1", "mean KL", "greedy prefix", "ppl", "Δppl", "gate"):
        parity.add_column(col, justify="right")
    for p in result["parity"]:
        lg, g = p["logits"], p["greedy"]
        parity.add_row(
            p["backend"], p["precision"], _f(lg["max_abs"]), _f(lg["p99_abs"]), _f(lg["max_rel"]),
            _f(lg["top1_agreement"], ".3f"), _f(lg["mean_kl"]), "/".join(map(str, g["identical_prefix"])) + f" of {g['tokens']}",
            _f(p["perplexity"], ".2f"), f"{p['perplexity_rel_change'] * 100:+.2f}%", "pass" if p["passed"] else "[red]FAIL[/]",
        )
    speed = Table(title=f"speed on {result['settings']['provider']} ({env.get('cpu')}, {result['settings']['threads']} threads; "
                        f"{bw['kind']}: {bw['bytes_per_s'] / 1e9:.1f} GB/s)")
    for col in ("backend", "precision", "batch", "cold s", "TTFT ms", "p50 ms", "p90 ms", "p99 ms", "decode tok/s",
                "e2e tok/s", "roofline tok/s", "% roofline", "peak RSS MB"):
        speed.add_column(col, justify="right")
    for e in result["speed"]:
        lat = e["decode_latency"]
        speed.add_row(
            e["backend"], e["precision"], str(e["batch"]), _f(e["cold_start_s"], ".2f"), _f(e["ttft_ms"], ".1f"),
            _f(lat.get("p50_ms"), ".2f"), _f(lat.get("p90_ms"), ".2f"), _f(lat.get("p99_ms"), ".2f"),
            _f(e["decode_tokens_per_s"], ".1f"), _f(e["e2e_tokens_per_s"], ".1f"), _f(e["roofline_tokens_per_s"], ".0f"),
            f"{e['roofline_share'] * 100:.0f}%", _f(e.get("peak_rss_mb"), ".0f"),
        )
    skipped = [f"{x['backend']}/{x['precision']} ({x['reason']})" for x in result.get("skipped", [])]
    if skipped:
        speed.caption = "not run: " + "; ".join(skipped)
    return [parity, speed]
