"""GPT-2's hyper-parameters and the published family, free of torch (an export's metadata is read with them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257  # number of BPE tokens; rows of wte and columns of the logits
    n_positions: int = 1024  # longest context (prompt + generated tokens); rows of wpe
    n_embd: int = 768  # residual stream width C
    n_layer: int = 12  # number of transformer blocks
    n_head: int = 12  # attention heads per block; head_dim = n_embd // n_head
    layer_norm_epsilon: float = 1e-5  # epsilon inside every LayerNorm

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPT2Config.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPT2Config:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# The published GPT-2 family: hub repository and architecture of each size.
PRESETS: dict[str, tuple[str, GPT2Config]] = {
    "gpt2": ("openai-community/gpt2", GPT2Config(n_layer=12, n_head=12, n_embd=768)),
    "gpt2-medium": ("openai-community/gpt2-medium", GPT2Config(n_layer=24, n_head=16, n_embd=1024)),
    "gpt2-large": ("openai-community/gpt2-large", GPT2Config(n_layer=36, n_head=20, n_embd=1280)),
    "gpt2-xl": ("openai-community/gpt2-xl", GPT2Config(n_layer=48, n_head=25, n_embd=1600)),
    "distilgpt2": ("distilbert/distilgpt2", GPT2Config(n_layer=6, n_head=12, n_embd=768)),
}
