"""Greedy decoding (batch 1 by default) on one provider, every way gpt2x runs it beside its peers, in one process:

    python benchmarks/cuda_decode.py --out RESULTS/cuda-decode [--provider cuda] [--model random:gpt2]
        [--precisions fp32,fp16] [--batch 1] [--prompt-len 32] [--new-tokens 128] [--repeat 3] [--exports ROOT]
        [--contenders sampled]

Contenders (each skipped with its reason where it cannot run here):
- `ort growing`: OrtBackend, IO binding, presents left on the device as the next past, the argmax taken on the
  device (step_greedy), as `gpt2x generate` runs it;
- `ort fixed cache`: runtime.static_decode.StaticDecoder: one fixed-capacity cache bound as past and present,
  the fixed-shape decode graph whose ArgMax leaves only the token to copy back;
- `ort fixed cache + CUDA graph`: the same step captured once and replayed (CUDA only);
- `onnxruntime-genai`: the same export folder, its own greedy loop (append_tokens, generate_next_token);
- `transformers eager`: GPT2LMHeadModel of the same config and weights in torch, `generate` greedy, fp16 on CUDA;
- sampled at temperature 0.8 (seed 1): `ort growing, sampled` (the host sampler on each step's logits, as `gpt2x
  generate` samples) and `ort fixed cache (+ CUDA graph), sampled on the device` (generation.static_decoding: the
  draw in the decode graph from the host sampler's uniforms), their tokens compared with each other.

Each contender decodes the same random prompts (--batch rows of --prompt-len token ids) into --new-tokens tokens, --repeat times
after one warm-up. TTFT: the prompt's run and first token; decode tok/s: the other new tokens of every row over their time.
Every gpt2x path's tokens are compared with `ort growing`'s (and transformers' with torch fp32's where fp16 flips a
near tie, counted, not hidden). Writes OUT.json (every figure, the environment: GPU, driver, versions, the
providers each session really used) and OUT.md. GPT2X_GPU_PROVIDER=cpu in benchmarks/gpu_run.sh rehearses this
on the CPU: its figures are CPU figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from gpt2x.bench.system import system_info
from gpt2x.choices import Precision, ProviderKind
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.static_decoding import decode_static
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.static_decode import StaticDecoder
from gpt2x.workflows.exports import ensure_export


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(run, repeat: int) -> tuple[list[float], list[float], np.ndarray]:
    """run() -> (ttft_s, total_s, tokens), once to warm up, then `repeat` times."""
    run()
    ttft, decode, tokens = [], [], None
    for _ in range(repeat):
        first, total, tokens = run()
        ttft.append(first)
        decode.append(total - first)
    return ttft, decode, tokens


def ort_growing(info, provider, prompt, n):
    backend = OrtBackend(info, provider, in_place_kv=False)
    B, T = prompt.shape

    def run():
        start = time.perf_counter()
        tok, past = backend.step_greedy(prompt, np.ones_like(prompt), np.arange(T, dtype=np.int64)[None].repeat(B, 0), None)
        first = time.perf_counter() - start
        out = [tok]
        for i in range(n - 1):
            length = T + i
            tok, past = backend.step_greedy(tok.reshape(B, 1), np.ones((B, length + 1), np.int64),
                                            np.full((B, 1), length, np.int64), past)
            out.append(tok)
        return first, time.perf_counter() - start, np.stack(out, 1)

    return run, backend.session.get_providers()[0]


def ort_fixed(info, provider, prompt, n, cuda_graph: bool):
    decoder = StaticDecoder(info, provider, rows=prompt.shape[0], capacity=prompt.shape[1] + n, cuda_graph=cuda_graph)

    def run():
        start = time.perf_counter()
        out = np.empty((prompt.shape[0], n), np.int64)
        out[:, 0] = decoder.prefill(prompt)
        first = time.perf_counter() - start
        for i in range(1, n):
            out[:, i] = decoder.step()  # the last step's tokens, already on the device
        return first, time.perf_counter() - start, out

    return run, decoder.providers[0]


SAMPLED = SamplingSettings(temperature=0.8, seed=1, ignore_eos=True)  # the sampled contenders' settings (+ new tokens)


def ort_growing_sampled(info, provider, prompt, n):
    """The host sampler on every step's logits (what `gpt2x generate` does when it samples)."""
    backend = OrtBackend(info, provider, in_place_kv=False)
    B, T = prompt.shape

    def run():
        sampler = Sampler(replace(SAMPLED, max_new_tokens=n))
        start = time.perf_counter()
        logits, past = backend.step(prompt, np.ones_like(prompt), np.arange(T, dtype=np.int64)[None].repeat(B, 0), None)
        out = [sampler(logits)]
        first = time.perf_counter() - start
        for i in range(n - 1):
            length = T + i
            logits, past = backend.step(out[-1].reshape(B, 1), np.ones((B, length + 1), np.int64),
                                        np.full((B, 1), length, np.int64), past)
            out.append(sampler(logits))
        return first, time.perf_counter() - start, np.stack(out, 1)

    return run, backend.session.get_providers()[0]


def ort_fixed_sampled(info, provider, prompt, n, cuda_graph: bool):
    """StaticDecoder drawing on the device from the sampler's uniforms (generation.static_decoding)."""
    decoder = StaticDecoder(info, provider, rows=prompt.shape[0], capacity=prompt.shape[1] + n, cuda_graph=cuda_graph,
                            sampling=True)

    def run():  # the first token timed alone (a generation of one), as transformers_eager does
        start = time.perf_counter()
        decode_static(decoder, prompt, replace(SAMPLED, max_new_tokens=1))
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = decode_static(decoder, prompt, replace(SAMPLED, max_new_tokens=n))
        return first, max(time.perf_counter() - start, first), out

    return run, decoder.providers[0]


def genai(info, provider, prompt, n):
    import onnxruntime_genai as og

    config = og.Config(str(info.folder))
    config.clear_providers()
    if provider is ProviderKind.cuda:
        config.append_provider("cuda")
    model = og.Model(config)
    if model.device_type.lower() != ("cuda" if provider is ProviderKind.cuda else "cpu"):
        raise RuntimeError(f"onnxruntime-genai opened the model on {model.device_type}")
    B, T = prompt.shape

    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=T + n, min_length=T + n, batch_size=B)
        start = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens(prompt)
        out = []
        for i in range(n):
            gen.generate_next_token()
            out.append(np.asarray(gen.get_next_tokens()).copy())
            if i == 0:
                first = time.perf_counter() - start
        return first, time.perf_counter() - start, np.stack(out, 1)

    return run, f"onnxruntime-genai {og.__version__} on {model.device_type}"


def transformers_eager(model_name, precision, provider, prompt, n):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2x.model.hf_format import config_to_hf, gpt2x_to_hf
    from gpt2x.workflows.models import load_model

    ours, _ = load_model(model_name)  # the same weights, in Hugging Face's layout
    hf = GPT2LMHeadModel(GPT2Config(**config_to_hf(ours.config)))
    missing = hf.transformer.load_state_dict(gpt2x_to_hf(ours.state_dict()), strict=False)
    hf.tie_weights()
    device = "cuda" if provider is ProviderKind.cuda else "cpu"
    dtype = torch.float16 if precision is Precision.fp16 else torch.float32
    hf = hf.to(device=device, dtype=dtype).eval()
    ids = torch.as_tensor(prompt, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        with torch.inference_mode():
            sync()
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            sync()
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            sync()
            total = time.perf_counter() - start
        return first, max(total, first), out[:, prompt.shape[1]:].cpu().numpy()

    return run, f"torch {torch.__version__} {device} {dtype} ({len(missing.missing_keys)} keys not loaded)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--provider", type=ProviderKind, default=ProviderKind.cuda)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,fp16")
    ap.add_argument("--batch", type=int, default=1, help="rows, each its own random prompt of the same length")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--exports", type=Path, default=None, help="exports root (default: GPT2X_EXPORTS, as gpt2x's)")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated words: only the contenders whose name holds one (default: all), e.g. 'sampled'")
    a = ap.parse_args()
    words = None if a.contenders is None else [w.strip() for w in a.contenders.split(",") if w.strip()]
    precisions = [Precision(p) for p in a.precisions.split(",")]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], []
    record = {"command": " ".join(sys.argv), "settings": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
              "skipped": skipped, "environment": system_info()}

    def save() -> None:  # after every contender: a lease cut off still leaves the figures so far
        a.out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
        lines = ["| precision | contender | TTFT ms | decode tok/s | same tokens | ran on |",
                 "| --- | --- | ---: | ---: | --- | --- |"]
        for r in rows:
            lines.append(f"| {r['precision']} | {r['contender']} | {r['ttft_ms']:.2f} | {r['decode_tok_s']:.0f} | "
                         f"{r['agreement']} | {r['ran_on']} |")
        lines += [f"- skipped: {s['precision']} {s['contender']}: {s['why']}" for s in skipped]
        a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    vocab = None
    for precision in precisions:
        log(f"== {a.model} {precision.value}: export")
        info = ensure_export(a.model, precision, folder=default_export_dir(a.model, precision, a.exports))
        vocab = info.config.vocab_size
        prompt = np.random.default_rng(0).integers(0, vocab, (a.batch, a.prompt_len), dtype=np.int64)
        contenders = [
            ("ort growing", partial(ort_growing, info, a.provider, prompt, a.new_tokens)),
            ("ort fixed cache", partial(ort_fixed, info, a.provider, prompt, a.new_tokens, cuda_graph=False)),
            ("ort fixed cache + CUDA graph", partial(ort_fixed, info, a.provider, prompt, a.new_tokens, cuda_graph=True)),
            ("onnxruntime-genai", partial(genai, info, a.provider, prompt, a.new_tokens)),
            ("transformers eager", partial(transformers_eager, a.model, precision, a.provider, prompt, a.new_tokens)),
            ("ort growing, sampled", partial(ort_growing_sampled, info, a.provider, prompt, a.new_tokens)),
            ("ort fixed cache + CUDA graph, sampled on the device",
             partial(ort_fixed_sampled, info, a.provider, prompt, a.new_tokens, cuda_graph=True)),
            ("ort fixed cache, sampled on the device",
             partial(ort_fixed_sampled, info, a.provider, prompt, a.new_tokens, cuda_graph=False)),
        ]
        references = {}  # greedy and sampled contenders each compared with their group's first
        for name, make in contenders:
            if words is not None and not any(w in name for w in words):
                continue
            log(f"-- {precision.value} {name}")
            try:
                run, ran_on = make()
                ttft, decode, tokens = timed(run, a.repeat)
            except Exception as e:  # a contender that cannot run here is recorded with its reason, not fatal
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                skipped.append({"precision": precision.value, "contender": name, "why": f"{type(e).__name__}: {why}"})
                log(f"   skipped: {why}")
                save()
                continue
            reference, reference_name = references.setdefault("sampled" in name, (tokens, name))
            agree = float((tokens[:, : reference.shape[1]] == reference).mean()) if tokens.shape == reference.shape else 0.0
            first_diff = int(np.argmax(tokens[0] != reference[0])) if agree < 1 else None
            rows.append({"precision": precision.value, "contender": name, "ran_on": ran_on,
                         "batch": a.batch, "ttft_ms": 1e3 * statistics.median(ttft),
                         "decode_tok_s": a.batch * (a.new_tokens - 1) / statistics.median(decode),
                         "ttft_ms_all": [1e3 * t for t in ttft], "decode_s_all": decode,
                         "agreement": ("yes" if agree == 1 else f"{agree:.2f} (first differs at token {first_diff})")
                         + ("" if name == reference_name else f" vs {reference_name}")})
            log(f"   ttft {rows[-1]['ttft_ms']:.2f} ms, decode {rows[-1]['decode_tok_s']:.0f} tok/s, on {ran_on}, "
                f"agreement {rows[-1]['agreement']}")
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
