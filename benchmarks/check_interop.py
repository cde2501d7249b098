"""Do other tools' own loaders run a gpt2x export folder, and do they generate gpt2x's tokens?

    # the environment of benchmarks/setup_peers.sh (Optimum needs transformers < 4.58); on the
    # development machine it is /work/peers-venv
    bash benchmarks/setup_peers.sh .venv-peers
    # once: onnxruntime-genai on top of the onnxruntime-gpu already there (its wheel asks for the
    # `onnxruntime` distribution; the Python module and libonnxruntime.so of onnxruntime-gpu serve it)
    .venv-peers/bin/pip install --no-deps onnxruntime-genai==0.18.0
    .venv-peers/bin/python benchmarks/check_interop.py --out benchmarks/results/interop-cpu-2core
    # an existing export instead of fresh fp32 and int8 exports of the bundled model:
    .venv-peers/bin/python benchmarks/check_interop.py --onnx exported/shakespeare-fp32 --out /tmp/interop
    # gpt2x's dev environment runs it too, with the loaders it cannot import recorded as skipped

    # transformers.js (@huggingface/transformers in Node, on onnxruntime-node), once:
    npm ci --prefix benchmarks/interop
    python benchmarks/check_interop.py --transformers-js   # the bundled model, fp32, int8 and int4
    python benchmarks/check_interop.py --transformers-js --model random:gpt2 --precisions fp32,int4 --out /tmp/tjs

Exports the bundled `shakespeare` model at fp32 and int8 with gpt2x (or takes --onnx folders), writes
gpt2x.onnx.interop's files into each folder, then for every loader that imports in this environment:

- Optimum's `ORTModelForCausalLM.from_pretrained(folder)`: no re-export; checked to have opened the
  folder's own model.onnx (same path and sha256 as its metadata records); greedy `generate`, 64 new tokens,
  one prompt at a time and once as one left-padded batch; the prompts encoded with
  `AutoTokenizer.from_pretrained(folder)`.
- onnxruntime-genai's `Model(folder)`: greedy generation from gpt2x's token ids; its `Tokenizer`.

Each is compared with gpt2x's own greedy generation on ONNX Runtime (`OrtBackend` on the same
folder). A loader that does not import is skipped with the reason. Writes OUT.json (environment,
per export and loader: loaded, error, tokens equal, first differing position) and OUT.md (a table).

With --transformers-js: writes the folder `gpt2x export --layout transformers.js` writes (through
workflows.export_transformers_js: exported/MODEL-PRECISION reused or exported first; or from the
--onnx folders given) into a temporary folder, runs benchmarks/interop/check.mjs on it in Node
(env.allowRemoteModels = false, AutoTokenizer and AutoModelForCausalLM.from_pretrained with dtype
fp32, q8, q4; greedy `generate`, do_sample false, one prompt at a time and once as one left-padded
batch) and compares the token ids with gpt2x's greedy generation on ONNX Runtime (the ort backend) of
the same exports, and transformers.js's encoding of the prompts with gpt2x.tokenizer's. Writes
OUT.json and OUT.md (default benchmarks/results/interop-transformers-js-cpu-2core); exits 1 on any
difference or failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

from gpt2x import tokenizer as tk
from gpt2x.bench.system import installed_versions, system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.fileio import sha256
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx import names as io
from gpt2x.onnx.artifact import read_export
from gpt2x.onnx.interop import GENAI_CONFIG_FILE, INTEROP_FILES, TOKENIZER_FILE, write_interop_files
from gpt2x.onnx.transformers_js import write_transformers_js
from gpt2x.workflows.backends import export_backend
from gpt2x.workflows.exports import export_model
from gpt2x.workflows.models import load_model
from gpt2x.workflows.transformers_js import export_transformers_js

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.", "To be, or not to be",
           "KING HENRY:\nOnce more unto the breach"]

GENAI_PROBES = {
    # genai's "gpt2" type reads the legacy combined cache (past_%d: [2, batch, heads, past, head_size]).
    'model.type "gpt2"': {"model": {"type": "gpt2"}},
}


def share_buffer_probe(folder: Path) -> dict:
    """The other setting of past_present_share_buffer than the one gpt2x wrote (true for the
    int8 GroupQueryAttention graph, false for MultiHeadAttention graphs)."""
    wrote = json.loads((folder / GENAI_CONFIG_FILE).read_text())["search"]["past_present_share_buffer"]
    return {f"past_present_share_buffer {str(not wrote).lower()}": {"search": {"past_present_share_buffer": not wrote}}}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def uncommitted(path: str = "gpt2x") -> list[str]:
    """Files under `path` that differ from the git revision system_info() names (the code measured)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", path], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent.parent, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(line[3:] for line in out.stdout.splitlines() if line.strip())


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first generated token where a and b differ (or where the shorter one ends)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def until_eos(tokens: list[int]) -> list[int]:
    """Generated tokens without the end-of-text token and anything after it (gpt2x's convention)."""
    return tokens[: tokens.index(tk.EOT_ID)] if tk.EOT_ID in tokens else tokens


def compare(reference: list[list[int]], got: list[list[int]]) -> list[dict]:
    return [{"prompt": p, "tokens_equal": r == g, "first_difference": first_difference(r, g),
             "n_tokens_gpt2x": len(r), "n_tokens_loader": len(g)} for p, r, g in zip(PROMPTS, reference, got)]


def gpt2x_tokens(folder: Path, new_tokens: int, batched: bool = False) -> list[list[int]]:
    backend = export_backend(BackendKind.ort, read_export(folder))
    settings = SamplingSettings(max_new_tokens=new_tokens, greedy=True)
    if batched:
        return [g.tokens for g in generate(backend, PROMPTS, settings)]
    return [generate(backend, [p], settings)[0].tokens for p in PROMPTS]


def check_optimum(folder: Path, new_tokens: int, reference: list[list[int]]) -> dict:
    try:
        import torch
        from optimum.onnxruntime import ORTModelForCausalLM
        from transformers import AutoTokenizer
    except ImportError as e:
        return {"skipped": f"not importable here: {e}"}
    result: dict = {"versions": installed_versions("optimum", "optimum-onnx", "transformers", "tokenizers"), "loaded": False}
    try:
        model = ORTModelForCausalLM.from_pretrained(folder, provider="CPUExecutionProvider")
    except Exception as e:  # whatever the loader raises is the finding
        return result | {"error": f"{type(e).__name__}: {e}"}
    info = read_export(folder)
    path = Path(model.path).resolve()
    result |= {
        "loaded": True,
        "session_model": str(path),
        "used_our_model": path == info.model_path.resolve() and sha256(path) == info.meta["files"][path.name]
        and [i.name for i in model.session.get_inputs()] == io.input_names(info.config.n_layer),
        "uses_cache": bool(model.can_use_cache),
    }
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        result["tokenizer"] = {"class": type(tok).__name__, "ids_equal": ids == [tk.encode(p) for p in PROMPTS],
                               "decode_equal": all(tok.decode(r) == tk.decode(r) for r in reference)}
    except Exception as e:  # a tokenizer failure is recorded; generation below uses gpt2x's ids
        result["tokenizer"] = {"error": f"{type(e).__name__}: {e}"}
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=tk.EOT_ID)
    try:
        got = []
        for p in PROMPTS:
            ids = torch.tensor([tk.encode(p)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            got.append(until_eos(out[0, ids.shape[1]:].tolist()))
        result["prompts"] = compare(reference, got)
        result["tokens_equal"] = all(r["tokens_equal"] for r in result["prompts"])
        # One left-padded batch, as gpt2x's own batched generation pads it.
        batch_ref = gpt2x_tokens(folder, new_tokens, batched=True)
        rows = [tk.encode(p) for p in PROMPTS]
        width = max(map(len, rows))
        ids = torch.tensor([[tk.EOT_ID] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = model.generate(ids, attention_mask=mask, **kwargs)
        batch = compare(batch_ref, [until_eos(row[width:].tolist()) for row in out])
        result["batch"] = {"size": len(PROMPTS), "tokens_equal": all(r["tokens_equal"] for r in batch),
                           "first_difference": [r["first_difference"] for r in batch]}
    except Exception as e:  # as above: recorded, not fatal
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def check_genai(folder: Path, new_tokens: int, reference: list[list[int]], overrides: dict | None = None) -> dict:
    """onnxruntime-genai on the folder; with `overrides` ({section: {key: value}}), on a copy of
    genai_config.json changed so (beside a link to the same model.onnx), to record what it does."""
    try:
        import onnxruntime_genai as og
    except ImportError as e:
        return {"skipped": f"not importable here: {e}"}
    info = read_export(folder)
    with tempfile.TemporaryDirectory(prefix="gpt2x-genai-") as tmp:
        if overrides:
            cfg = json.loads((folder / GENAI_CONFIG_FILE).read_text())
            for section, values in overrides.items():
                cfg[section].update(values)
            (Path(tmp) / GENAI_CONFIG_FILE).write_text(json.dumps(cfg))
            (Path(tmp) / cfg["model"]["decoder"]["filename"]).symlink_to(info.model_path.resolve())
            folder = Path(tmp)
        return _run_genai(og, folder, info, new_tokens, reference)


def _run_genai(og, folder: Path, info, new_tokens: int, reference: list[list[int]]) -> dict:
    result: dict = {"versions": installed_versions("onnxruntime-genai", "onnxruntime", "onnxruntime-gpu"), "loaded": False}
    try:
        model = og.Model(str(folder))
    except Exception as e:  # whatever the loader raises is the finding
        return result | {"error": f"{type(e).__name__}: {e}"}
    genai_cfg = json.loads((folder / GENAI_CONFIG_FILE).read_text())
    decoder = folder / genai_cfg["model"]["decoder"]["filename"]
    result |= {"loaded": True, "model_type": genai_cfg["model"]["type"], "session_model": str(decoder),
               "used_our_model": decoder.resolve() == info.model_path.resolve()
               and sha256(decoder) == info.meta["files"][decoder.name]}
    try:
        got = []
        for p in PROMPTS:
            ids = tk.encode(p)
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
            gen = og.Generator(model, params)
            gen.append_tokens(np.array([ids], dtype=np.int32))
            tokens = []
            while not gen.is_done():
                gen.generate_next_token()
                tokens.append(int(gen.get_next_tokens()[0]))
            got.append(until_eos(tokens))
        result["prompts"] = compare(reference, got)
        result["tokens_equal"] = all(r["tokens_equal"] for r in result["prompts"])
    except Exception as e:  # recorded, not fatal
        result["error"] = f"{type(e).__name__}: {e}"
    if not (folder / TOKENIZER_FILE).is_file():
        return result
    try:
        tok = og.Tokenizer(model)
        result["tokenizer"] = {
            "ids_equal": all(tok.encode(p).tolist() == tk.encode(p) for p in PROMPTS),
            "decode_equal": all(tok.decode(np.array(r, dtype=np.int32)) == tk.decode(r) for r in reference),
        }
    except Exception as e:  # recorded, not fatal
        result["tokenizer"] = {"error": f"{type(e).__name__}: {e}"}
    return result


def check_folder(folder: Path, new_tokens: int) -> dict:
    info = read_export(folder)
    present = [n for n in INTEROP_FILES if (folder / n).is_file()]
    written = write_interop_files(folder, info.config, share_buffer=io.in_place_kv(info.attention)) if len(present) < len(INTEROP_FILES) else []
    log(f"{folder}: {info.precision.value}; interop files {'written' if written else 'already present'}")
    log("  gpt2x greedy generation (OrtBackend)")
    reference = gpt2x_tokens(folder, new_tokens)
    entry = {"folder": str(folder), "precision": info.precision.value, "model": info.meta["model"]["name"],
             "fused_operators": info.meta.get("fused_operators"), "interop_files_written": written,
             "gpt2x_tokens": reference, "loaders": {}}
    loaders = {
        "Optimum ORTModelForCausalLM": check_optimum,
        "onnxruntime-genai": check_genai,
        # Variants of genai_config.json, recorded to show why it says what it says.
        **{f"onnxruntime-genai, {label} (probe)": partial(check_genai, overrides=o)
           for label, o in (GENAI_PROBES | share_buffer_probe(folder)).items()},
    }
    for name, check in loaders.items():
        log(f"  {name}")
        entry["loaders"][name] = r = check(folder, new_tokens, reference)
        log(f"    {r.get('skipped') or r.get('error') or ('tokens equal' if r.get('tokens_equal') else 'tokens differ')}")
    return entry


def markdown(results: dict) -> str:
    env = results["environment"]
    s = results["settings"]
    lines = [
        f"Model {s['model']}, {len(PROMPTS)} prompts, {s['new_tokens']} greedy tokens each; reference: gpt2x's "
        "greedy generation on ONNX Runtime (OrtBackend) from the same folder.",
        f"Machine: {env['cpu']}, {env['cores']} cores; {env['date']}, gpt2x git {env['git']}"
        + (f" with uncommitted changes to {', '.join(env['uncommitted'])}" if env.get("uncommitted") else "") + "; "
        + ", ".join(f"{k} {v}" for k, v in (env["packages"] | env["loader packages"]).items()) + ".",
        "Graphs: " + "; ".join(f"{e['precision']}: " + ", ".join(
            f"{op} {n}" for op, n in (e["fused_operators"] or {}).items() if op != "total_nodes") for e in results["exports"]) + ".",
        "",
        "| export | loader | loaded | our model.onnx | tokens equal (1 prompt at a time) | first difference "
        "| batch of 4, left-padded | tokenizer ids / decode equal | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    yes = {True: "yes", False: "no", None: ""}
    for e in results["exports"]:
        for name, r in e["loaders"].items():
            if "skipped" in r:
                lines.append(f"| {e['precision']} | {name} | skipped | | | | | | {r['skipped']} |")
                continue
            diffs = [p["first_difference"] for p in r.get("prompts", [])]
            diff = ("none" if all(d is None for d in diffs) else ", ".join(str(d) for d in diffs)) if diffs else ""
            tok = r.get("tokenizer")
            tok_s = "" if tok is None else f"error: {tok['error']}" if "error" in tok else \
                f"{yes[tok.get('ids_equal')]} / {yes[tok.get('decode_equal')]}"
            batch = r.get("batch")
            batch_s = yes[batch["tokens_equal"]] if batch else ""
            lines.append(f"| {e['precision']} | {name} | {yes[r['loaded']]} | {yes[r.get('used_our_model')]} | "
                         f"{yes[r.get('tokens_equal')]} | {diff} | {batch_s} | {tok_s} | {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- transformers.js (Node)

INTEROP_DIR = Path(__file__).resolve().parent / "interop"
NODE_SCRIPT = INTEROP_DIR / "check.mjs"
TJS_PACKAGE = INTEROP_DIR / "node_modules" / "@huggingface" / "transformers"
TJS_OUT = Path("benchmarks/results/interop-transformers-js-cpu-2core")


def left_padded(rows: list[list[int]]) -> dict:
    """One batch, left-padded with <|endoftext|> under a zero mask (as gpt2x pads a batch)."""
    width = max(map(len, rows))
    return {"input_ids": [[tk.EOT_ID] * (width - len(r)) + r for r in rows],
            "attention_mask": [[0] * (width - len(r)) + [1] * len(r) for r in rows]}


def run_node(folder: Path, dtypes: list[str], new_tokens: int) -> dict:
    """check.mjs on the transformers.js folder; its JSON result."""
    node = shutil.which("node")
    if node is None:
        raise SystemExit("node is not on PATH (transformers.js runs in Node 18+)")
    if not TJS_PACKAGE.is_dir():
        raise SystemExit(f"{TJS_PACKAGE} is missing: run `npm ci --prefix {INTEROP_DIR}`")
    request = {"root": str(folder.resolve().parent), "name": folder.name, "dtypes": dtypes, "prompts": PROMPTS,
               "max_new_tokens": new_tokens, "batch": left_padded([tk.encode(p) for p in PROMPTS])}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        out = subprocess.run([node, str(NODE_SCRIPT), f.name], capture_output=True, text=True, timeout=1800)
    finally:
        Path(f.name).unlink(missing_ok=True)
    if out.returncode != 0:
        raise SystemExit(f"{NODE_SCRIPT} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def check_transformers_js(folder: Path, meta: dict, new_tokens: int) -> dict:
    """transformers.js against gpt2x's ort backend on each source export of the folder."""
    by_dtype = {g["dtype"]: (name, g) for name, g in meta["onnx"].items()}
    log(f"transformers.js in Node on {folder}: {', '.join(by_dtype)}")
    node = run_node(folder, list(by_dtype), new_tokens)
    ids = node["tokenizer"]["ids"]
    result: dict = {"versions": node["versions"], "tokenizer": {
        "class": node["tokenizer"]["class"],
        "ids_equal": ids == [tk.encode(p) for p in PROMPTS],
        "decode_equal": node["tokenizer"]["decoded"] == [tk.decode(tk.encode(p)) for p in PROMPTS],
        "ids": ids}, "dtypes": {}}
    for dtype, (name, graph) in by_dtype.items():
        got = node["dtypes"][dtype]
        entry: dict = {"file": name, "precision": graph["precision"], "source": graph["source"],
                       "fused_operators": graph["fused_operators"], "loaded_files": got.get("loaded_files", [])}
        entry["loaded_our_file"] = name in entry["loaded_files"]
        if "error" in got:
            result["dtypes"][dtype] = entry | {"loaded": False, "error": got["error"]}
            log(f"  {dtype}: {got['error']}")
            continue
        log(f"  {dtype}: gpt2x greedy generation on the ort backend of {graph['source']}")
        backend = export_backend(BackendKind.ort, read_export(Path(graph["source"])))
        settings = SamplingSettings(max_new_tokens=new_tokens, greedy=True)
        reference = [generate(backend, [p], settings)[0].tokens for p in PROMPTS]
        batch_reference = [g.tokens for g in generate(backend, PROMPTS, settings)]
        tjs = [until_eos(p["tokens"]) for p in got["prompts"]]
        batch = compare(batch_reference, [until_eos(r) for r in got["batch"]])
        entry |= {
            "loaded": True,
            "input_names": got["input_names"],
            "prompts": compare(reference, tjs),
            "batch": {"size": len(PROMPTS), "tokens_equal": all(r["tokens_equal"] for r in batch),
                      "first_difference": [r["first_difference"] for r in batch]},
            "decode_equal": all(p["text"] == tk.decode(p["tokens"]) for p in got["prompts"]),
            "gpt2x_tokens": reference,
            "transformers_js_tokens": tjs,
        }
        entry["tokens_equal"] = all(r["tokens_equal"] for r in entry["prompts"])
        result["dtypes"][dtype] = entry
        log(f"    tokens {'equal' if entry['tokens_equal'] else 'differ'}; batch {'equal' if entry['batch']['tokens_equal'] else 'differs'}")
    return result


def tjs_passed(result: dict) -> bool:
    tok = result["tokenizer"]
    return tok["ids_equal"] and tok["decode_equal"] and all(
        d.get("loaded") and d["loaded_our_file"] and d["tokens_equal"] and d["batch"]["tokens_equal"] and d["decode_equal"]
        for d in result["dtypes"].values())


def markdown_transformers_js(results: dict) -> str:
    env, s, r = results["environment"], results["settings"], results["transformers.js"]
    yes = {True: "yes", False: "no", None: ""}
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
    lines = [
        f"Model {s['model']}, {len(PROMPTS)} prompts, {s['new_tokens']} greedy tokens each: transformers.js "
        "(`AutoModelForCausalLM.from_pretrained` on the folder `gpt2x export --layout transformers.js` writes, "
        "`generate` with do_sample false) against gpt2x's greedy generation on ONNX Runtime (the ort backend) "
        "of the export each graph was copied from.",
        f"Machine: {env['cpu']}, {env['cores']} cores; {env['date']}, gpt2x git {env['git']}"
        + (f" with uncommitted changes to {', '.join(env['uncommitted'])}" if env.get("uncommitted") else "") + "; "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items()) + f"; {versions}.",
        f"Tokenizer ({r['tokenizer']['class']}): prompt ids equal to gpt2x.tokenizer's: {yes[r['tokenizer']['ids_equal']]}; "
        f"decode equal: {yes[r['tokenizer']['decode_equal']]}.",
        "",
        "| dtype | file (precision) | graph | loaded that file | tokens equal (1 prompt at a time) | first difference "
        "| batch of 4, left-padded | decode equal | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dtype, d in r["dtypes"].items():
        ops = ", ".join(f"{op} {n}" for op, n in (d["fused_operators"] or {}).items() if op != "total_nodes")
        diffs = [p["first_difference"] for p in d.get("prompts", [])]
        diff = ("none" if all(x is None for x in diffs) else ", ".join(str(x) for x in diffs)) if diffs else ""
        batch = d.get("batch")
        lines.append(f"| {dtype} | {d['file']} ({d['precision']}) | {ops} | {yes[d['loaded_our_file']]} | "
                     f"{yes[d.get('tokens_equal')]} | {diff} | {yes[batch['tokens_equal']] if batch else ''} | "
                     f"{yes[d.get('decode_equal')]} | {d.get('error', '')} |")
    lines += ["", f"Result: {'all equal' if results['passed'] else 'MISMATCH'}."]
    return "\n".join(lines) + "\n"


def main_transformers_js(args) -> int:
    out = args.out or TJS_OUT
    precisions = [Precision(p.strip()) for p in args.precisions.split(",") if p.strip()]
    results: dict = {"environment": system_info() | {"uncommitted": uncommitted()},
                     "settings": {"model": args.model, "new_tokens": args.new_tokens, "prompts": PROMPTS,
                                  "onnx": [str(p) for p in args.onnx or []]}}
    with tempfile.TemporaryDirectory(prefix="gpt2x-tjs-") as tmp:
        folder = Path(tmp) / f"{args.model.replace('/', '--').replace(':', '-')}-transformers.js"
        if args.onnx:
            written = write_transformers_js([read_export(p) for p in args.onnx], folder, progress=log)
            results["settings"]["model"] = written.meta["model"]["name"]
        else:
            written = export_transformers_js(args.model, folder, precisions, progress=log, notice=log)
        results["layout"] = {"files": written.files, "onnx": {n: {k: g[k] for k in ("dtype", "precision", "source", "sha256")}
                                                              for n, g in written.meta["onnx"].items()}}
        results["transformers.js"] = check_transformers_js(folder, written.meta, args.new_tokens)
    results["passed"] = tjs_passed(results["transformers.js"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    out.with_suffix(".md").write_text(markdown_transformers_js(results))
    print(markdown_transformers_js(results))
    return 0 if results["passed"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="output path without extension (writes OUT.json, OUT.md); required "
                    f"except with --transformers-js (default {TJS_OUT})")
    ap.add_argument("--onnx", type=Path, action="append", help="an existing gpt2x export folder (repeatable); "
                    "default: fresh fp32 and int8 exports of --model (with --transformers-js: exported/MODEL-PRECISION)")
    ap.add_argument("--model", default="shakespeare", help="model to export when no --onnx is given")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--transformers-js", action="store_true", help="check transformers.js in Node instead (see above)")
    ap.add_argument("--precisions", default="fp32,int8,int4", help="with --transformers-js and no --onnx: the exports' precisions")
    args = ap.parse_args()
    if args.transformers_js:
        return main_transformers_js(args)
    if args.out is None:
        ap.error("--out is required")
    results: dict = {"environment": system_info() | {"loader packages": installed_versions(
        "optimum", "optimum-onnx", "onnxruntime-genai", "tokenizers"), "uncommitted": uncommitted()},
        "settings": {"model": args.model, "new_tokens": args.new_tokens, "prompts": PROMPTS,
                     "onnx": [str(p) for p in args.onnx or []]}, "exports": []}
    with tempfile.TemporaryDirectory(prefix="gpt2x-interop-") as tmp:
        folders = args.onnx
        if not folders:
            model, source = load_model(args.model)
            folders = []
            for precision in (Precision.fp32, Precision.int8):
                log(f"exporting {args.model} at {precision.value}")
                folders.append(export_model(model, source, Path(tmp) / f"{args.model}-{precision.value}",
                                                      precision=precision).folder)
        for folder in folders:
            entry = check_folder(Path(folder), args.new_tokens)
            if not args.onnx:
                entry["folder"] = f"(temporary) {Path(folder).name}"
            else:
                results["settings"]["model"] = entry["model"]
            results["exports"].append(entry)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
