"""A GPT-2 config's anatomy from the config alone: parameter shapes and counts per component, activation shapes
(checked in the tests against a model built on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass

from .config import GPT2Config


@dataclass(frozen=True)
class Component:
    name: str  # e.g. "block.attn.c_attn"
    shapes: tuple[tuple[int, ...], ...]  # weight (and bias) shapes, in our [out, in] layout
    repeat: int = 1  # how many times it occurs (n_layer for per-block parts)

    @property
    def params(self) -> int:
        n = 0
        for s in self.shapes:
            size = 1
            for d in s:
                size *= d
            n += size
        return n

    @property
    def total(self) -> int:
        return self.params * self.repeat


def components(cfg: GPT2Config) -> list[Component]:
    C, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.n_positions, cfg.n_layer
    return [
        Component("wte (token embedding)", ((V, C),)),
        Component("wpe (position embedding)", ((T, C),)),
        Component("block.ln_1", ((C,), (C,)), L),
        Component("block.attn.c_attn (fused QKV)", ((3 * C, C), (3 * C,)), L),
        Component("block.attn.c_proj", ((C, C), (C,)), L),
        Component("block.ln_2", ((C,), (C,)), L),
        Component("block.mlp.c_fc (up)", ((4 * C, C), (4 * C,)), L),
        Component("block.mlp.c_proj (down)", ((C, 4 * C), (C,)), L),
        Component("ln_f", ((C,), (C,))),
        Component("unembedding (tied to wte)", ()),
    ]


def total_params(cfg: GPT2Config) -> int:
    return sum(c.total for c in components(cfg))


def activations(cfg: GPT2Config, seq_len: int) -> list[tuple[str, tuple[int, ...]]]:
    """Shape after each step of the forward pass for one sequence of seq_len tokens (no batch)."""
    T, C, H, D, V = seq_len, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.vocab_size
    return [
        ("input_ids", (T,)),
        ("wte[ids] + wpe[pos]", (T, C)),
        ("block.ln_1", (T, C)),
        ("block.attn.c_attn -> q, k, v", (T, 3 * C)),
        ("split heads (q, k, v each)", (H, T, D)),
        ("attention scores q @ kT, causal softmax", (H, T, T)),
        ("scores @ v, merge heads", (T, C)),
        ("block.attn.c_proj + residual", (T, C)),
        ("block.ln_2", (T, C)),
        ("block.mlp.c_fc", (T, 4 * C)),
        ("gelu (tanh)", (T, 4 * C)),
        ("block.mlp.c_proj + residual", (T, C)),
        ("ln_f", (T, C)),
        ("logits = x @ wteT", (T, V)),
    ]


def describe(cfg: GPT2Config, seq_len: int | None = None) -> dict:
    """A JSON-ready description: config, components, total, and activations when seq_len is given."""
    out = {
        "config": cfg.to_dict(),
        "components": [
            {"name": c.name, "shapes": [list(s) for s in c.shapes], "params": c.params, "repeat": c.repeat, "total": c.total}
            for c in components(cfg)
        ],
        "total_params": total_params(cfg),
    }
    if seq_len is not None:
        out["activations"] = [{"step": n, "shape": list(s)} for n, s in activations(cfg, seq_len)]
    return out
