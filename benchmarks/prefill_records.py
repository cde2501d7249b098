"""The OpenVINO prefill records of exports (gpt2x.json's `openvino_prefill`): each graph's gate, the compute
precision the export chose (f32, or bf16 where it passed the same gate and measured faster) and the timings it took
to choose, at batch 1, as `gpt2x export` measured them on this machine.

    python benchmarks/prefill_records.py --exports EXPORTS --out benchmarks/results/prefill-records-cpu-2core-gpt2-124m

EXPORTS holds the exports (MODEL-PRECISION, as compare_peers.py's --exports); the records are read, not remade.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.onnx.artifact import PREFILL_KEY, default_export_dir, read_export


def _ms(values: list[float] | None) -> str:
    return " / ".join(f"{v:.1f}" for v in values or []) or "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,int8")
    ap.add_argument("--exports", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = ap.parse_args()
    records, rows = {}, []
    for name in args.precisions.split(","):
        info = read_export(default_export_dir(args.model, Precision(name), args.exports))
        record = records[name] = {"created": info.meta["created"], "versions": info.meta["versions"],
                                  PREFILL_KEY: info.meta.get(PREFILL_KEY)}
        r = record[PREFILL_KEY] or {}
        if not r.get("kept"):
            rows.append(f"| {name} | not kept: {r.get('reason', 'no record').replace('|', '/')} | | | |")
            continue
        timing, lg = r["timing"], r["parity"]["logits"]
        rows.append(f"| {name} | {r['inference_precision']} | {lg['max_rel']:.2g} / {lg['present_max_rel']:.2g} "
                    f"| {_ms(timing['openvino_ms'])} against {_ms(timing['onnxruntime_ms'])} | {timing['openvino_from']} |")
    env = system_info()
    lengths = " and ".join(str(n) for n in next((r[PREFILL_KEY]["timing"]["lengths"] for r in records.values()
                                                  if (r[PREFILL_KEY] or {}).get("kept")), []))
    md = (f"OpenVINO prefill records of {args.model}'s exports in {args.exports} (batch 1, prompts of {lengths} tokens, "
          f"median of 5 at export).\nMachine: {env.get('cpu', 'n/a')}, {env.get('platform', '')}; git {env.get('git')}.\n\n"
          "| export | compute | gate: max rel. logits / presents | OpenVINO against ONNX Runtime prefill (ms) "
          "| openvino_from |\n| --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    save_results(args.out, {"environment": env, "model": args.model, "records": records}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
