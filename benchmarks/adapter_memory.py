"""Resident memory per LoRA adapter served beside its base (`gpt2x serve --model BASE --adapter NAME=FOLDER`).

    python benchmarks/adapter_memory.py --model random:gpt2 --adapters 2 --out benchmarks/results/adapter-memory-cpu-2core

Random PEFT LoRA adapters (r 8 on c_attn, LoRA's usual target; seeded) are made for the base's config and exported
merged, as the command does (workflows.exports.resolve_export with the adapter: cached in a temporary EXPORTS folder).
Then one process serves the base and every adapter as the command's one-process server does (serve.single_process's
model slots behind openai.many's Models, on uvicorn), each loaded on its first request: the process's RSS
(gpt2x.memory.rss_mb, VmRSS, after gc) is read before each model's first request and after it (one greedy completion of
--tokens tokens, so that its sessions have run): the difference is what serving that model added. Writes OUT.json and
OUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def uvicorn_server(app):
    """`app` on uvicorn in a thread of this process, on a free port of 127.0.0.1; yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def make_adapters(model: str, count: int, root: Path) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2x.model.checkpoints import resolve_config
    from gpt2x.model.hf_format import config_to_hf

    folders = []
    for i in range(count):
        torch.manual_seed(i)
        hf = GPT2LMHeadModel(GPT2Config.from_dict(config_to_hf(resolve_config(model))))
        peft_model = get_peft_model(hf, LoraConfig(target_modules=["c_attn"], r=8, lora_alpha=16, init_lora_weights=False))
        folder = root / f"lora-{i}"
        peft_model.save_pretrained(folder)
        folders.append(folder)
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from gpt2x.bench.system import cpu_model
    from gpt2x.choices import Precision
    from gpt2x.memory import rss_mb
    from gpt2x.onnx.artifact import EXPORTS_ENV
    from gpt2x.serve.core.engine import EngineSettings
    from gpt2x.serve.openai.many import Models, models_app
    from gpt2x.serve.replica import ReplicaConfig
    from gpt2x.serve.single_process import model_slot
    from gpt2x.workflows.exports import resolve_export

    with tempfile.TemporaryDirectory() as tmp:
        os.environ[EXPORTS_ENV] = str(Path(tmp) / "exports")
        precision = Precision(args.precision)
        log(f"exporting {args.model} and {args.adapters} adapter(s) merged ({args.precision})")
        folders = make_adapters(args.model, args.adapters, Path(tmp))
        infos = [resolve_export(args.model, precision=precision)]
        infos += [resolve_export(args.model, precision=precision, adapter=f) for f in folders]
        engine = EngineSettings()  # the command's defaults (batches of up to 16 rows)
        configs = [ReplicaConfig(export=str(info.folder), model_id=name, threads=args.threads, engine=engine,
                                 parent=None if i == 0 else "base")
                   for i, (info, name) in enumerate(zip(infos, ["base", *(f.name for f in folders)]))]
        del infos
        # the base export's files, all graphs included: what a full copy of its weights would take at most
        export_mb = round(sum(p.stat().st_size for p in Path(configs[0].export).rglob("*") if p.is_file()) / 2**20, 1)
        models = Models([model_slot(c) for c in configs])
        rows = []
        try:
            with uvicorn_server(models_app(models)) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
                for config in configs:
                    gc.collect()
                    before = rss_mb()
                    began = time.perf_counter()
                    r = c.post("/v1/completions", json={"model": config.model_id, "prompt": "ROMEO:",
                                                        "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True})
                    r.raise_for_status()
                    gc.collect()
                    after = rss_mb()
                    rows.append({"model": config.model_id, "adapter": config.parent is not None,
                                 "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
                                 "added_mb": round(after - before, 1),
                                 "first_request_s": round(time.perf_counter() - began, 2)})
                    log(f"{config.model_id}: +{after - before:.1f} MiB (RSS {after:.1f} MiB)")
        finally:
            models.close_all()
    extra = [row["added_mb"] for row in rows if row["adapter"]]
    result = {"model": args.model, "precision": args.precision, "adapters": args.adapters, "threads": args.threads,
              "tokens": args.tokens, "machine": f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()})",
              "rows": rows, "base_added_mb": rows[0]["added_mb"],
              "per_adapter_mb": round(statistics.median(extra), 1) if extra else None, "export_mb": export_mb}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Resident memory per LoRA adapter served beside {args.model} ({args.precision})", "",
             f"Machine: {result['machine']}; {args.threads} threads; each model's first request: {args.tokens} "
             "greedy tokens. `python benchmarks/adapter_memory.py` (its docstring says how).", "",
             "| model | RSS before (MiB) | RSS after (MiB) | added (MiB) | first request (s) |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['rss_before_mb']} | {r['rss_after_mb']} | {r['added_mb']} | {r['first_request_s']} |"
              for r in rows]
    lines += ["", f"Base: +{result['base_added_mb']} MiB; each extra adapter (median): +{result['per_adapter_mb']} MiB."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
