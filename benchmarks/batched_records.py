"""The batched decode graph's record of an int8 export (gpt2x.json's `batched_decode`): its gate, one decode step of
both graphs timed at export (rows x one new token, median of 5) and the batched_from the export chose from them, with
both graphs' sizes, as `gpt2x export` measured them on this machine.

    python benchmarks/batched_records.py --exports EXPORTS --out benchmarks/results/batched-records-cpu-2core-gpt2-124m

EXPORTS holds the exports (MODEL-PRECISION, as batch_peers.py's --exports); the record is read, not remade.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.onnx.artifact import BATCHED_FILE, BATCHED_KEY, MODEL_FILE, default_export_dir, read_export


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--exports", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = ap.parse_args()
    info = read_export(default_export_dir(args.model, Precision.int8, args.exports))
    r = info.meta.get(BATCHED_KEY) or {}
    sizes = {name: info.meta["sizes"].get(name) for name in (MODEL_FILE, BATCHED_FILE)}
    record = {"created": info.meta["created"], "versions": info.meta["versions"], "sizes": sizes, BATCHED_KEY: r}
    env = system_info()
    head = (f"The batched decode graph's record of {args.model}'s int8 export in {args.exports}.\n"
            f"Machine: {env.get('cpu', 'n/a')}, {env.get('platform', '')}; git {env.get('git')}.\n\n")
    if not r.get("kept"):
        md = head + f"Not kept: {r.get('reason', 'no record')}\n"
    else:
        t, lg = r["timing"], r["parity"]["logits"]
        rows = "\n".join(f"| {m} | {b:.2f} | {a:.2f} | {a / b:.2f}x |" for m, b, a in zip(t["rows"], t["batched_ms"], t["model_ms"]))
        md = head + (f"Gate: {r['parity']['status']}, max |Δlogit| {lg['max_rel']:.3g} of scale, mean KL {lg['mean_kl']:.2g}, "
                     f"greedy agreement {r['parity']['greedy']['share']:.2f}. Sizes: {MODEL_FILE} {sizes[MODEL_FILE]} bytes, "
                     f"{BATCHED_FILE} {sizes[BATCHED_FILE]} bytes.\n\nOne decode step ({t['new_tokens']} new token a row, "
                     f"{t['past']}-position cache, median of {t['repeat']}), ms:\n\n"
                     "| rows | batched graph | model.onnx | batched graph faster |\n| ---: | ---: | ---: | ---: |\n"
                     f"{rows}\n\nbatched_from: {r['batched_from']} (faster by {t['faster_by']:.0%} from there on)\n")
    save_results(args.out, {"environment": env, "model": args.model, "record": record}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
