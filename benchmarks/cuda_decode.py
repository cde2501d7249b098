"""Greedy decoding (batch 1 by default) on one provider, every way gpt2x runs it beside its peers, in one process:

    python benchmarks/cuda_decode.py --out RESULTS/cuda-decode [--provider cuda] [--model random:gpt2]
        [--precisions fp32,fp16] [--batch 1] [--prompt-len 32] [--new-tokens 128] [--repeat 3] [--exports ROOT]
        [--contenders sampled] [--cpu-compile]

Contenders (each skipped with its reason where it cannot run here):
- `ort growing`: OrtBackend, IO binding, presents left on the device as the next past, the argmax taken on the
  device (step_greedy), as `gpt2x generate` runs it;
- `ort fixed cache`: runtime.static_decode.StaticDecoder: one fixed-capacity cache bound as past and present,
  the fixed-shape decode graph whose ArgMax leaves only the token to copy back;
- `ort fixed cache + CUDA graph`: the same step captured once and replayed (CUDA only);
- `onnxruntime-genai`: the same export folder, its own greedy loop (append_tokens, generate_next_token);
- `onnxruntime-genai + CUDA graph`: the same loop with genai's CUDA graph (`enable_cuda_graph`), which needs its shared
  past/present buffer: a temporary copy of the export with GroupQueryAttention (fp16 on CUDA; skipped elsewhere);
- `transformers eager`: GPT2LMHeadModel of the same config and weights in torch, `generate` greedy, fp16 on CUDA;
- `transformers static + compile`: the same model, `generate(cache_implementation="static")` with the forward compiled
  (fullgraph, mode="reduce-overhead": CUDA graphs), transformers' own recipe;
- `torch compiled loop (gpt2x model)`: gpt2x's PyTorch model decoding into a fixed KV cache, its one-token step compiled
  with mode="reduce-overhead" (CUDA graphs), the argmax on the device: the ceiling PyTorch reaches. On the CPU the two
  compiled peers run uncompiled unless --cpu-compile (minutes of compiling on a small CPU);
- `torch CUDA graph loop (gpt2x model)`: the same step uncompiled, captured by hand in a CUDA graph (CUDA only; needs
  neither Triton nor a C compiler);
- sampled at temperature 0.8 (seed 1): `ort growing, sampled` (the host sampler on each step's logits, as `gpt2x
  generate` samples) and `ort fixed cache (+ CUDA graph), sampled on the device` (generation.static_decoding: the
  draw in the decode graph from the host sampler's uniforms), their tokens compared with each other.

Each contender decodes the same random prompts (--batch rows of --prompt-len token ids) into --new-tokens tokens,
--repeat times after one warm-up (two for the compiled peers; the JSON's setup_s and warmup_s hold loading and
compiling). TTFT: the prompt's run and first token; decode tok/s: the other new tokens of every row over their time.
Every path's tokens are compared with `ort growing`'s and, where a torch contender runs, with gpt2x's PyTorch model's
in fp32 (where fp16 flips a near tie: counted, not hidden). Writes OUT.json (every figure, the environment: GPU,
driver, versions, the providers each session really used) and OUT.md (decode tok/s also as a multiple of `ort fixed
cache + CUDA graph`'s). GPT2X_GPU_PROVIDER=cpu in benchmarks/gpu_run.sh rehearses this
on the CPU: its figures are CPU figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import replace
from functools import cache, partial
from pathlib import Path

import numpy as np

from gpt2x.bench.system import system_info
from gpt2x.choices import Precision, ProviderKind
from gpt2x.errors import ProviderError
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.static_decoding import decode_static
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.static_decode import StaticDecoder
from gpt2x.workflows.exports import ensure_export


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(run, repeat: int, warmups: int = 1) -> tuple[list[float], list[float], np.ndarray, list[float]]:
    """run() -> (ttft_s, total_s, tokens), `warmups` times (their seconds returned: compiling), then `repeat` times."""
    warm = []
    for _ in range(warmups):
        start = time.perf_counter()
        run()
        warm.append(time.perf_counter() - start)
    ttft, decode, tokens = [], [], None
    for _ in range(repeat):
        first, total, tokens = run()
        ttft.append(first)
        decode.append(total - first)
    return ttft, decode, tokens, warm


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


def genai(info, provider, prompt, n, cuda_graph: bool = False, shared_buffer: bool | None = None):
    """`shared_buffer` (default: with `cuda_graph`, which requires it): genai's past_present_share_buffer, on a
    temporary copy of the export made for it (genai_shared_copy)."""
    import onnxruntime_genai as og

    shared_buffer = cuda_graph if shared_buffer is None else shared_buffer
    if cuda_graph and provider is not ProviderKind.cuda:
        raise ProviderError("a CUDA graph needs the cuda provider")
    B, T = prompt.shape
    if cuda_graph and B > 1:  # genai's mask is then [B, max_length] from the prompt on: GroupQueryAttention reads a
        # prompt on it as a continuation, which it runs for one row only (and genai's graph is sized for one row)
        raise ProviderError("onnxruntime-genai's CUDA graph decodes one row (batch 1)")
    copy = genai_shared_copy(info, provider, T + n) if shared_buffer else None
    config = og.Config(str(info.folder if copy is None else copy.name))
    config.clear_providers()
    if provider is ProviderKind.cuda:
        config.append_provider("cuda")
        if cuda_graph:
            config.set_provider_option("cuda", "enable_cuda_graph", "1")
    model = og.Model(config)
    if model.device_type.lower() != ("cuda" if provider is ProviderKind.cuda else "cpu"):
        raise RuntimeError(f"onnxruntime-genai opened the model on {model.device_type}")

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

    run.keep = copy  # the temporary copy lives as long as the contender
    how = (" + CUDA graph" if cuda_graph else "") + (", shared past/present buffer (GroupQueryAttention copy)" if shared_buffer else "")
    return run, f"onnxruntime-genai {og.__version__} on {model.device_type}{how}"


GQA = "GroupQueryAttention"


def genai_shared_copy(info, provider, max_length: int):
    """A temporary folder (TemporaryDirectory) with the export made fit for genai's shared past/present buffer, which
    hands the graph one buffer of max_length positions as past and present: the graph with GroupQueryAttention
    (onnx.optimize.mha_to_gqa; MultiHeadAttention rejects that past), its seqlens_k the count of the mask's ones (under
    a CUDA graph genai's mask is [batch, max_length], zeros after the current length: its width is no length), no
    additive mask (the prompts hold no padding: GroupQueryAttention's own causal mask), and genai_config.json with
    past_present_share_buffer and max_length."""
    import tempfile

    import onnx
    from onnx import TensorProto, helper

    from gpt2x.onnx import names as io
    from gpt2x.onnx.interop import GENAI_CONFIG_FILE
    from gpt2x.onnx.optimize import mha_to_gqa
    from gpt2x.runtime.static_decode import fixed_cache_refusal

    why = fixed_cache_refusal(provider, info.precision)  # the same rule: where ONNX Runtime runs GroupQueryAttention
    if why:
        raise ProviderError(f"genai's shared buffer: {why}")
    proto = onnx.load(str(info.model_path))
    if not mha_to_gqa(proto):
        raise ProviderError(f"{info.model_path} has no MultiHeadAttention to rewrite for genai's shared buffer")
    graph = proto.graph
    attention = [n for n in graph.node if n.op_type == GQA]
    seqlens = {n.input[5] for n in attention}
    if len(seqlens) != 1:
        raise ValueError(f"the GroupQueryAttention nodes read {len(seqlens)} seqlens_k tensors, not one")
    seqlens = seqlens.pop()
    nodes = [helper.make_node("ReduceSum", [io.ATTENTION_MASK, "bench_axis_1"], ["bench_mask_ones"], keepdims=0),
             helper.make_node("Sub", ["bench_mask_ones", "bench_one"], ["bench_last"]),
             helper.make_node("Cast", ["bench_last"], [seqlens], to=TensorProto.INT32)]
    nodes += [n for n in graph.node if seqlens not in n.output]
    for n in attention:  # input 10: the additive mask, whose width genai's fixed mask makes wrong
        inputs = list(n.input)[:10]
        while inputs and not inputs[-1]:
            inputs.pop()
        del n.input[:]
        n.input.extend(inputs)
    # The optional logits_to_keep's Slice goes too (genai does not feed it: every position's logits, as before), and
    # with it host-side index arithmetic a CUDA graph need not meet.
    for cut in [n for n in nodes if n.op_type == "Slice" and any(i.startswith(io.LOGITS_TO_KEEP) for i in n.input[1:])]:
        for n in nodes:
            n.input[:] = [cut.input[0] if i == cut.output[0] else i for i in n.input]
    graph.initializer.extend([helper.make_tensor("bench_axis_1", TensorProto.INT64, [1], [1]),
                              helper.make_tensor("bench_one", TensorProto.INT64, [], [1])])
    # Only what an output needs: the width-based lengths, the mask's bias and logits_to_keep go.
    needed, kept = {o.name for o in graph.output}, []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    for field in (graph.initializer, graph.input):
        kept = [t for t in field if t.name in needed]
        del field[:]
        field.extend(kept)

    folder = tempfile.TemporaryDirectory(prefix="gpt2x-genai-shared-")
    path = Path(folder.name)
    large = proto.ByteSize() > 1_800_000_000  # protobuf's 2 GB: the weights beside the graph
    onnx.save(proto, str(path / "model.onnx"), save_as_external_data=large, location="model.onnx.data")
    config = json.loads((info.folder / GENAI_CONFIG_FILE).read_text())
    config["model"]["decoder"]["filename"] = "model.onnx"
    config["search"].update(past_present_share_buffer=True, max_length=max_length)
    (path / GENAI_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return folder


@cache
def gpt2x_weights(model_name):
    """gpt2x's PyTorch model of `model_name` (fp32, CPU), loaded once per process: each torch contender copies it."""
    from gpt2x.workflows.models import load_model

    return load_model(model_name)[0]


def torch_setting(precision, provider):
    import torch

    return ("cuda" if provider is ProviderKind.cuda else "cpu"), (torch.float16 if precision is Precision.fp16 else torch.float32)


def hf_model(model_name, precision, provider):
    """transformers' GPT2LMHeadModel of the same config and weights (Hugging Face's layout), on the device; the keys
    it did not load."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2x.model.hf_format import config_to_hf, gpt2x_to_hf

    ours = gpt2x_weights(model_name)
    hf = GPT2LMHeadModel(GPT2Config(**config_to_hf(ours.config)))
    missing = hf.transformer.load_state_dict(gpt2x_to_hf(ours.state_dict()), strict=False)
    hf.tie_weights()
    device, dtype = torch_setting(precision, provider)
    return hf.to(device=device, dtype=dtype).eval(), missing.missing_keys


def torch_sync(device):
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def transformers_eager(model_name, precision, provider, prompt, n):
    import torch

    hf, missing = hf_model(model_name, precision, provider)
    device, dtype = torch_setting(precision, provider)
    ids = torch.as_tensor(prompt, device=device)
    sync = torch_sync(device)

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

    return run, f"torch {torch.__version__} {device} {dtype} ({len(missing)} keys not loaded)"


CUDAGRAPH_SKIPS: list[str] = []  # why Inductor ran a compiled graph without a CUDA graph, since the last fresh_compile


class _CudagraphSkips(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        CUDAGRAPH_SKIPS.append(record.getMessage()[:400])


def fresh_compile() -> None:
    """Forget earlier contenders' compiled code, CUDA graphs and counters: each compiled peer compiles, and is timed,
    alone. Inductor's reasons for skipping a CUDA graph (its `cudagraphs` log) are collected for the row."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    CUDAGRAPH_SKIPS.clear()
    skips = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
    if not any(isinstance(h, _CudagraphSkips) for h in skips.handlers):
        skips.addHandler(_CudagraphSkips(logging.WARNING))


def compile_counters() -> dict:
    """Dynamo's and Inductor's counters (graphs, graph breaks, cudagraph_skips) and the skips' reasons: whether the CUDA
    graphs really ran."""
    from torch._dynamo.utils import counters

    out = {kind: dict(counters[kind]) for kind in ("stats", "graph_break", "inductor") if counters.get(kind)}
    return out | ({"cudagraph_skip_reasons": list(CUDAGRAPH_SKIPS)} if CUDAGRAPH_SKIPS else {})


def transformers_static_compile(model_name, precision, provider, prompt, n, cpu_compile: bool = False):
    """generate with transformers' static cache and its forward compiled (fullgraph, mode="reduce-overhead"): by
    generate's own compile (CompileConfig, transformers >= 4.48: decode steps only, the prompt's forward uncompiled), else
    by hand on model.forward, the recipe of older versions. On the CPU uncompiled unless `cpu_compile`."""
    import torch
    import transformers

    fresh_compile()
    hf, missing = hf_model(model_name, precision, provider)
    device, dtype = torch_setting(precision, provider)
    ids = torch.as_tensor(prompt, device=device)
    sync = torch_sync(device)
    kwargs = {"do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    compiling = device == "cuda" or cpu_compile
    compile_config = getattr(transformers, "CompileConfig", None)
    generate_compiles = compile_config is not None and hasattr(hf, "get_compiled_call")
    if not compiling:
        how = "not compiled on the cpu (--cpu-compile)"
    elif generate_compiles:
        config = compile_config(fullgraph=True, mode="reduce-overhead")
        if device != "cuda":
            config._compile_all_devices = True  # generate compiles on CUDA only, unless told (its testing flag)
        kwargs["compile_config"] = config
        how = "compiled by generate (fullgraph, reduce-overhead)"
    else:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        how = "forward compiled (fullgraph, reduce-overhead)"
    details = {"transformers": transformers.__version__, "compile": how}

    def run():
        with torch.no_grad():  # not inference_mode: tensors made under it cannot enter a CUDA graph tree's next run
            sync()
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, **kwargs)
            sync()
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
            sync()
            total = time.perf_counter() - start
        if compiling and generate_compiles and not hasattr(hf, "_compiled_call"):
            raise RuntimeError("generate did not compile the forward (its auto-compile criteria were not met)")
        if compiling:
            details["counters"] = compile_counters()
        return first, max(total, first), out[:, prompt.shape[1]:].cpu().numpy()

    return run, f"torch {torch.__version__} {device} {dtype}, static cache, {how} ({len(missing)} keys not loaded)", details


def static_loop(model, rows: int, capacity: int):
    """gpt2x's GPT2 `model` greedy into a fixed KV cache: one buffer [layers, 2, rows, heads, capacity, head_dim], each
    step's key and value written at its position (index_copy_ by a position tensor on the device), attention over the
    whole capacity under a mask, the next token chosen and written on the device. The step takes no arguments (tokens
    and position are buffers it updates), so a CUDA graph of it replays with nothing copied in or out. The step mirrors
    model.gpt2's forward for one token (the same modules and weights, the same arithmetic)."""
    import math

    import torch
    import torch.nn.functional as F
    from torch import nn

    from gpt2x.model.gpt2 import MASK_VALUE

    cfg = model.config
    weight = model.wte.weight
    B, C, H, D = rows, cfg.n_embd, cfg.n_head, cfg.head_dim

    class StaticLoop(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.register_buffer("kv", torch.zeros(cfg.n_layer, 2, B, H, capacity, D, dtype=weight.dtype, device=weight.device))
            self.register_buffer("tokens", torch.zeros(B, capacity + 1, dtype=torch.long, device=weight.device))
            self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=weight.device))
            self.register_buffer("slots", torch.arange(capacity, device=weight.device))

        def prefill(self, ids):
            """The prompt by the model's own forward (eager), its keys and values copied into the buffers."""
            T = ids.shape[1]
            logits, presents = self.model(ids, logits_to_keep=1)
            for i, (k, v) in enumerate(presents):
                self.kv[i, 0, :, :, :T] = k
                self.kv[i, 1, :, :, :T] = v
            self.tokens[:, :T] = ids
            self.tokens[:, T] = logits[:, -1].argmax(-1)
            self.pos.fill_(T)

        def forward(self):
            """One token per row at position `pos`: the next written at pos + 1, pos advanced."""
            m = self.model
            x = m.wte(self.tokens.index_select(1, self.pos)) + m.wpe(self.pos)  # (B, 1, C)
            bias = torch.where(self.slots <= self.pos, 0.0, MASK_VALUE).to(x.dtype)  # (capacity,): this and earlier
            for i, block in enumerate(m.h):
                q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
                keys, values = self.kv[i, 0], self.kv[i, 1]  # (B, H, capacity, D)
                keys.index_copy_(2, self.pos, k.view(B, 1, H, D).transpose(1, 2))
                values.index_copy_(2, self.pos, v.view(B, 1, H, D).transpose(1, 2))
                att = (q.view(B, 1, H, D).transpose(1, 2) @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(D))  # (B, H, 1, capacity)
                y = torch.softmax(att + bias, dim=-1) @ values  # (B, H, 1, D)
                x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, 1, C))
                x = x + block.mlp(block.ln_2(x))
            logits = F.linear(m.ln_f(x), m.wte.weight)  # (B, 1, V)
            self.tokens.index_copy_(1, self.pos + 1, logits.argmax(-1))
            self.pos.add_(1)

    return StaticLoop()


def torch_compiled_loop(model_name, precision, provider, prompt, n, cpu_compile: bool = False):
    """gpt2x's PyTorch model, static_loop's step compiled with mode="reduce-overhead" (Inductor, CUDA graph trees);
    the prompt by the model's eager forward. On the CPU uncompiled unless `cpu_compile`."""
    import copy

    import torch

    fresh_compile()
    device, dtype = torch_setting(precision, provider)
    model = copy.deepcopy(gpt2x_weights(model_name)).to(device=device, dtype=dtype).eval()
    B, T = prompt.shape
    loop = static_loop(model, B, T + n)
    for buffer in loop.buffers():  # the buffers' addresses never change: a CUDA graph reads and writes them in place
        torch._dynamo.mark_static_address(buffer)
    compiling = device == "cuda" or cpu_compile
    step = torch.compile(loop, mode="reduce-overhead", fullgraph=True, dynamic=False) if compiling else loop
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    ids = torch.as_tensor(prompt, device=device)
    sync = torch_sync(device)
    details = {}

    def run():
        with torch.no_grad():
            sync()
            start = time.perf_counter()
            loop.prefill(ids)
            loop.tokens[:, T].cpu()  # the first token on the host, as every contender's TTFT
            first = time.perf_counter() - start
            for _ in range(n - 1):
                mark()
                step()
            out = loop.tokens[:, T : T + n].cpu().numpy()
            total = time.perf_counter() - start
        if compiling:
            details["counters"] = compile_counters()
        return first, total, out

    how = "step compiled (fullgraph, reduce-overhead)" if compiling else "not compiled on the cpu (--cpu-compile)"
    return run, f"torch {torch.__version__} {device} {dtype}, fixed cache, {how}", details


def torch_graph_loop(model_name, precision, provider, prompt, n):
    """static_loop's step uncompiled, captured by hand in one CUDA graph (torch.cuda.graph) and replayed: PyTorch's
    own kernels without a launch each, nothing compiled (no Triton, no C compiler: where Inductor cannot run, this
    still gives PyTorch's figure with CUDA graphs)."""
    import copy

    import torch

    if provider is not ProviderKind.cuda:
        raise ProviderError("a CUDA graph needs the cuda provider")
    device, dtype = torch_setting(precision, provider)
    model = copy.deepcopy(gpt2x_weights(model_name)).to(device=device, dtype=dtype).eval()
    B, T = prompt.shape
    loop = static_loop(model, B, T + max(n, 4))  # room for the 3 warm-up steps (an index past the buffers is a device assert)
    ids = torch.as_tensor(prompt, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        loop.prefill(ids)
        side = torch.cuda.Stream()  # warm-up steps on a side stream, as torch.cuda.graphs asks (cuBLAS's handles)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                loop()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            loop()
    torch.cuda.synchronize()

    def run():
        with torch.no_grad():
            torch.cuda.synchronize()
            start = time.perf_counter()
            loop.prefill(ids)  # resets the position and tokens; a step writes a key and value before any step reads it
            loop.tokens[:, T].cpu()
            first = time.perf_counter() - start
            for _ in range(n - 1):
                graph.replay()
            out = loop.tokens[:, T : T + n].cpu().numpy()
            return first, time.perf_counter() - start, out

    return run, f"torch {torch.__version__} {device} {dtype}, fixed cache, step captured in a CUDA graph (uncompiled)"


def torch_reference(model_name, provider, prompt, n) -> np.ndarray:
    """gpt2x's PyTorch model in fp32 on the provider's device, greedy on its growing cache (gpt2x's generate on the
    torch backend, EOS not stopping): the tokens an fp16 path's near ties are counted against."""
    import copy

    from gpt2x.generation.generate import generate
    from gpt2x.runtime.pytorch import TorchBackend

    device, _ = torch_setting(Precision.fp32, provider)
    model = gpt2x_weights(model_name)
    backend = TorchBackend(model if device == "cpu" else copy.deepcopy(model), device)  # it moves the model it gets
    settings = SamplingSettings(max_new_tokens=n, greedy=True, ignore_eos=True)
    return np.array([r.tokens for r in generate(backend, [""] * len(prompt), settings, prompt_ids=prompt.tolist())])


def agreement(tokens: np.ndarray, reference: np.ndarray) -> str:
    """'yes', or the share of equal tokens and the first step at which any row differs."""
    if tokens.shape != reference.shape:
        return f"0.00 (shape {tokens.shape}, not {reference.shape})"
    differ = tokens != reference
    if not differ.any():
        return "yes"
    return f"{1 - differ.mean():.2f} (first differs at token {int(np.argmax(differ.any(0)))})"


GRAPH_ROW = "ort fixed cache + CUDA graph"  # the row every decode tok/s is divided by (the MD's x column)
TORCH_CONTENDERS = ("transformers eager", "transformers static + compile", "torch compiled loop (gpt2x model)",
                    "torch CUDA graph loop (gpt2x model)")
COMPILED = ("transformers static + compile", "torch compiled loop (gpt2x model)")  # warmed up twice: compiling, then recording


def error_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}"


def selected(name: str, words: list[str] | None) -> bool:
    """Whether --contenders picks `name`: a word it holds (any case), or "=NAME" for that name alone."""
    if words is None:
        return True
    return any(name == w[1:] if w.startswith("=") else w.lower() in name.lower() for w in words)


def markdown(rows: list[dict], skipped: list[dict]) -> str:
    graph = {r["precision"]: r["decode_tok_s"] for r in rows if r["contender"] == GRAPH_ROW}
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    rows = sorted(rows, key=lambda r: (precisions.index(r["precision"]), ORDER.index(r["contender"])))
    lines = [f"| precision | contender | TTFT ms | decode tok/s | x {GRAPH_ROW} | same tokens | same as torch fp32 | "
             "warm-up s | ran on |",
             "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- |"]
    for r in rows:
        if r["precision"] in graph:
            ratio = f"{r['decode_tok_s'] / graph[r['precision']]:.2f}"
        elif graph:  # fp32 on CUDA has no fixed cache: its rows against the precision that has one
            other, tok_s = next(iter(graph.items()))
            ratio = f"{r['decode_tok_s'] / tok_s:.2f} (vs {other})"
        else:
            ratio = ""
        lines.append(f"| {r['precision']} | {r['contender']} | {r['ttft_ms']:.2f} | {r['decode_tok_s']:.0f} | {ratio} | "
                     f"{r['agreement']} | {r.get('agreement_torch_fp32', '')} | {sum(r['warmup_s']):.1f} | {r['ran_on']} |")
    lines += [f"- skipped: {s['precision']} {s['contender']}: {s['why']}" for s in skipped]
    return "\n".join(lines) + "\n"


ORDER = ("ort growing", "ort fixed cache", GRAPH_ROW, "onnxruntime-genai", "onnxruntime-genai + CUDA graph", "transformers eager",
         "transformers static + compile", "torch compiled loop (gpt2x model)", "torch CUDA graph loop (gpt2x model)",
         "ort growing, sampled", "ort fixed cache + CUDA graph, sampled on the device", "ort fixed cache, sampled on the device")


def contenders(a, precision, info, prompt) -> list:
    """(name, make) of every contender, in ORDER (the tables'); make() -> (run, ran_on[, details])."""
    n, provider = a.new_tokens, a.provider
    makes = {
        "ort growing": partial(ort_growing, info, provider, prompt, n),
        "ort fixed cache": partial(ort_fixed, info, provider, prompt, n, cuda_graph=False),
        GRAPH_ROW: partial(ort_fixed, info, provider, prompt, n, cuda_graph=True),
        "onnxruntime-genai": partial(genai, info, provider, prompt, n),
        "onnxruntime-genai + CUDA graph": partial(genai, info, provider, prompt, n, cuda_graph=True),
        "transformers eager": partial(transformers_eager, a.model, precision, provider, prompt, n),
        "transformers static + compile": partial(transformers_static_compile, a.model, precision, provider, prompt, n, a.cpu_compile),
        "torch compiled loop (gpt2x model)": partial(torch_compiled_loop, a.model, precision, provider, prompt, n, a.cpu_compile),
        "torch CUDA graph loop (gpt2x model)": partial(torch_graph_loop, a.model, precision, provider, prompt, n),
        "ort growing, sampled": partial(ort_growing_sampled, info, provider, prompt, n),
        "ort fixed cache + CUDA graph, sampled on the device": partial(ort_fixed_sampled, info, provider, prompt, n, cuda_graph=True),
        "ort fixed cache, sampled on the device": partial(ort_fixed_sampled, info, provider, prompt, n, cuda_graph=False),
    }
    return [(name, makes[name]) for name in ORDER]


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
                    help="comma-separated words: only the contenders whose name holds one, any case (default: all), "
                         "e.g. 'sampled' or 'compile,genai'; '=NAME' for that contender alone, e.g. '=ort growing'")
    ap.add_argument("--cpu-compile", action="store_true",
                    help="compile the torch peers on the CPU provider too (else they run uncompiled there)")
    a = ap.parse_args()
    words = None if a.contenders is None else [w.strip() for w in a.contenders.split(",") if w.strip()]
    precisions = [Precision(p) for p in a.precisions.split(",")]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], []
    record = {"command": " ".join(sys.argv), "settings": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
              "skipped": skipped, "environment": system_info(), "torch_fp32_reference": {}}

    def save() -> None:  # after every contender: a lease cut off still leaves the figures so far
        a.out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
        a.out.with_suffix(".md").write_text(markdown(rows, skipped))

    torch_tokens = {}  # the fp32 PyTorch reference's tokens, by prompt (the same prompt at every precision)
    references = {}  # by precision, greedy and sampled contenders each compared with their group's first
    jobs = []
    for precision in precisions:
        log(f"== {a.model} {precision.value}: export")
        info = ensure_export(a.model, precision, folder=default_export_dir(a.model, precision, a.exports))
        prompt = np.random.default_rng(0).integers(0, info.config.vocab_size, (a.batch, a.prompt_len), dtype=np.int64)
        picked = [(name, make) for name, make in contenders(a, precision, info, prompt) if selected(name, words)]
        key = prompt.tobytes()
        if key not in torch_tokens and any(name in TORCH_CONTENDERS for name, _ in picked):
            log("-- torch fp32 reference (gpt2x's model, growing cache)")
            try:
                torch_tokens[key] = torch_reference(a.model, a.provider, prompt, a.new_tokens)
                record["torch_fp32_reference"][precision.value] = "made"
            except Exception as e:  # the rows then go without this comparison
                record["torch_fp32_reference"][precision.value] = error_line(e)
                log(f"   failed: {error_line(e)}")
                torch_tokens[key] = None
        jobs += [(precision, key, name, make) for name, make in picked]
    # The torch CUDA graph loops after every other contender of every precision, the compiled peers last: their minutes
    # of compiling, where a stage's time limit cuts the run short, cost only their own rows, and a capture gone wrong
    # in the CUDA context cannot take the ONNX Runtime rows with it.
    jobs.sort(key=lambda job: 2 if job[2] in COMPILED else 1 if job[2] == "torch CUDA graph loop (gpt2x model)" else 0)
    n = a.new_tokens
    for precision, key, name, make in jobs:
        log(f"-- {precision.value} {name}")
        try:
            start = time.perf_counter()
            run, ran_on, *more = make()
            setup = time.perf_counter() - start
            ttft, decode, tokens, warm = timed(run, a.repeat, warmups=2 if name in COMPILED else 1)
        except Exception as e:  # a contender that cannot run here is recorded with its reason, not fatal
            skipped.append({"precision": precision.value, "contender": name, "why": error_line(e)})
            log(f"   skipped: {error_line(e)}")
            save()
            continue
        finally:
            run = None  # a failed contender's buffers and sessions go before the next is made
        sampled = "sampled" in name
        reference, reference_name = references.setdefault((precision, sampled), (tokens, name))
        row = {"precision": precision.value, "contender": name, "ran_on": ran_on,
               "batch": a.batch, "ttft_ms": 1e3 * statistics.median(ttft),
               "decode_tok_s": a.batch * (n - 1) / statistics.median(decode),
               "ttft_ms_all": [1e3 * t for t in ttft], "decode_s_all": decode, "setup_s": setup, "warmup_s": warm,
               "agreement": agreement(tokens, reference) + ("" if name == reference_name else f" vs {reference_name}")}
        if not sampled and torch_tokens.get(key) is not None:
            row["agreement_torch_fp32"] = agreement(tokens, torch_tokens[key])
        if more:
            row["details"] = more[0]
            if a.provider is ProviderKind.cuda and more[0].get("counters", {}).get("inductor", {}).get("cudagraph_skips"):
                row["ran_on"] += " (Inductor skipped CUDA graphs: details.counters in the JSON)"
        rows.append(row)
        log(f"   ttft {row['ttft_ms']:.2f} ms, decode {row['decode_tok_s']:.0f} tok/s, on {ran_on}, "
            f"agreement {row['agreement']}, warm-up {sum(warm):.1f} s")
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
