"""`gpt2x loadtest --report`: a load test's result as one self-contained HTML file (nothing fetched: no script,
stylesheet, font or image from elsewhere, so it opens offline and attaches to a ticket whole): the table, the SLO
summary, inline SVG charts against what the levels vary, and the JSON result itself."""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from ..fileio import write_atomic
from .loadtest import (
    TABLE_CAPTION,
    goals_text,
    goodput_cells,
    goodput_title,
    is_sweep,
    slo_fraction_of,
    slo_summary,
    table_cells,
    table_title,
    x_axis,
)

# matplotlib's default cycle, so that the report's lines read as --plot's
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 480, 320, 64, 16, 30, 66

STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}td{white-space:nowrap}
th{background:#f3f3f3}td.bad{color:#c00;font-weight:600}.caption{font-size:12px;color:#555;max-width:70em}
.summary{font-size:16px;font-weight:600;margin:1em 0}.charts svg{margin:0 1em 1em 0;border:1px solid #eee}
pre{font-size:11px;background:#f8f8f8;padding:1em;overflow:auto}"""


def _nice_step(span: float, ticks: int = 5) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten) that cuts `span` into about `ticks` intervals."""
    raw = span / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)


def svg_chart(title: str, xlabel: str, ylabel: str, xs: list[float], series: list[tuple[str, list[float | None]]],
              threshold: tuple[str, float] | None = None, ymax: float | None = None) -> str:
    """A line chart as inline SVG: each series (label, one y per x; None: no point) in its own colour, a dotted
    horizontal `threshold` line (label, y), linear axes from 0. Each point's value shows on hover (its <title>)."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    values = [y for _, ys in series for y in ys if y is not None] + ([threshold[1]] if threshold else [])
    top = ymax or max(values, default=0) * 1.1 or 1.0
    step = _nice_step(top)
    top = math.ceil(top / step - 1e-9) * step

    def px(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - y / top * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
           f'font-size="11" font-family="sans-serif" role="img" aria-label="{escape(title)}">',
           f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="13">{escape(title)}</text>']
    for i in range(round(top / step) + 1):
        y = py(i * step)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{i * step:g}</text>')
    for x in sorted(set(xs)) if len(set(xs)) <= 12 else [x_lo + i * (x_hi - x_lo) / 6 for i in range(7)]:
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 14}" text-anchor="middle">{x:.3g}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>'
               f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h + 30}" text-anchor="middle">{escape(xlabel)}</text>'
               f'<text transform="translate(14 {TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">{escape(ylabel)}</text>')
    if threshold:
        y = py(threshold[1])
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d62728" stroke-dasharray="2 3"/>'
                   f'<text x="{LEFT + plot_w - 4}" y="{y - 4:.1f}" text-anchor="end" fill="#d62728">{escape(threshold[0])}</text>')
    for i, (label, ys) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        points = [(px(x), py(y), x, y) for x, y in zip(xs, ys) if y is not None]
        if len(points) > 1:
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b, _, _ in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        for a, b, x, y in points:
            out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"><title>{escape(label)} at {x:g}: {y:.4g}</title></circle>')
        # the legend in a row under the axis, where it hides no point
        x = LEFT + i * plot_w / len(series)
        out.append(f'<rect x="{x:.1f}" y="{HEIGHT - 14}" width="10" height="3" fill="{color}"/>'
                   f'<text x="{x + 14:.1f}" y="{HEIGHT - 10}">{escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def report_charts(result: dict) -> list[str]:
    """Throughput (and goodput, and a sweep's offered rate), the share of good requests against the SLO (with goals),
    and TTFT and e2e latency, each against the rate of a sweep, else the concurrency."""
    xlabel, xs = x_axis(result)
    levels, settings = result["levels"], result["settings"]
    goals = settings.get("goodput")
    throughput = [("completed req/s", [lv["request_throughput"] for lv in levels])]
    if goals:
        throughput.append(("goodput req/s", [lv.get("goodput_rps") for lv in levels]))
    if is_sweep(result):
        throughput.append(("offered req/s", list(xs)))
    charts = [svg_chart("throughput" + (" and goodput" if goals else ""), xlabel, "requests/s", xs, throughput)]
    if goals:
        good = [None if lv.get("good_fraction") is None else 100 * lv["good_fraction"] for lv in levels]
        charts.append(svg_chart(f"good requests ({goals_text(goals)})", xlabel, "% of requests", xs, [("good %", good)],
                                threshold=(f"SLO {100 * slo_fraction_of(settings):g}%", 100 * slo_fraction_of(settings)), ymax=100))
    latency = [(f"{metric} {key[:3]}", [lv[metric][key] if lv[metric] else None for lv in levels])
               for metric in ("ttft", "e2e") for key in ("p50_ms", "p99_ms")]
    charts.append(svg_chart("latency", xlabel, "ms", xs, latency))
    return charts


def html_table(cells: tuple[list[str], list[list[tuple[str, bool]]]], caption: str | None = None) -> str:
    cols, rows = cells
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f'<td{" class=bad" if bad else ""}>{escape(text)}</td>' for text, bad in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>\n" + (f'<p class="caption">{escape(caption)}</p>\n' if caption else "")


def report_html(result: dict) -> str:
    summary = slo_summary(result)
    title = table_title(result)
    goodput = (f"<h3>{escape(goodput_title(result))}</h3>\n" + html_table(goodput_cells(result))
               if result["settings"].get("goodput") else "")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>\n"
            f"<h2>{escape(title)}</h2>\n"
            + (f'<p class="summary">{escape(summary)}</p>\n' if summary else "")
            + html_table(table_cells(result), TABLE_CAPTION) + goodput
            + '<div class="charts">' + "\n".join(report_charts(result)) + "</div>\n"
            + f"<details><summary>JSON result</summary><pre>{escape(json.dumps(result, indent=1))}</pre></details>\n"
            + "</body></html>\n")


def write_report(result: dict, path: Path) -> None:
    write_atomic(path, report_html(result))
