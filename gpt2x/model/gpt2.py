"""GPT-2 in one file (Radford et al. 2019), as Hugging Face's checkpoints hold it:

    x = wte[input_ids] + wpe[position_ids]
    for each of n_layer blocks (pre-LayerNorm):
        x = x + c_proj(causal_self_attention(c_attn(ln_1(x))))   # c_attn: fused QKV, C -> 3C
        x = x + mlp.c_proj(gelu_tanh(mlp.c_fc(ln_2(x))))          # C -> 4C -> C
    logits = ln_f(x) @ wte.T                                       # unembedding tied to wte

The KV cache is a list of (key, value) tensors per layer, (B, H, P, D), so the same forward exports with P = 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPT2Config

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2's 'gelu_new')."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # fused Q, K, V
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None, keep: int = 0
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """keep > 0: the output at the last `keep` positions only (B, k, C); key and value at every one."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        if keep:
            q, bias, T = q[:, -keep:], bias[:, :, -keep:], min(keep, T)  # (B, k, C), (B, 1, k, P+T)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, -1, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D), every position
        v = v.view(B, -1, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # (B, H, P+T, D)
            v = torch.cat([past[1], v], dim=2)  # (B, H, P+T, D)
        # The scale on the query, not the scores: exact alike where it is a power of two (head_dim 64), and OpenVINO's
        # converter then folds the key's transpose into its attention kernel (16 rows' decode step 22 against 28 ms).
        q = q * (1.0 / math.sqrt(self.head_dim))
        att = torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1)  # (B, H, T, P+T); bias 0 or a large negative
        y = att @ v  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.c_proj(y), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, bias, past, keep: int = 0):
        """keep > 0: the last `keep` positions' output only (what the last block's logits read)."""
        a, present = self.attn(self.ln_1(x), bias, past, keep)
        if keep:
            x = x[:, -keep:]  # (B, k, C)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, present


def position_ids_from_mask(attention_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions of the last `seq_len` tokens: count of real tokens before each, so left padding
    does not shift a row's positions. Padded slots get position 0 (their output is ignored)."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P+T)
    return pos[:, pos.shape[1] - seq_len :]  # (B, T)


# Added to masked attention scores: exp(score - 1e4) is exactly 0 in fp32 and fp16, yet the sum stays
# finite in fp16 (unlike the dtype's minimum), so fully masked rows of padded query slots stay NaN-free.
MASK_VALUE = -1.0e4


def attention_bias(attention_mask: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias (B, 1, T, P+T): 0 where query t may attend to key s (causal and not
    padding), MASK_VALUE elsewhere."""
    total = attention_mask.shape[1]
    past_len = total - seq_len
    q_pos = torch.arange(seq_len, device=attention_mask.device) + past_len  # (T,)
    k_pos = torch.arange(total, device=attention_mask.device)  # (P+T,)
    causal = k_pos[None, :] <= q_pos[:, None]  # (T, P+T)
    allowed = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()  # (B, 1, T, P+T)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    neg = torch.full((), MASK_VALUE, dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, neg)


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        # No lm_head parameter: the unembedding is wte itself (weight tying).

    def init_weights(self, seed: int | None = None) -> GPT2:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias") or ".ln_" in name or name.startswith("ln_f"):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, KVCache]:
        """input_ids (B, T); attention_mask (B, P+T) with 1 for real tokens, 0 for padding;
        position_ids (B, T); past_key_values: n_layer x (key, value), each (B, H, P, D);
        logits_to_keep: 0 for every position's logits, k > 0 for the last k only (a prefill needs 1).
        Returns logits (B, T or min(k, T), V) and the new cache, each (B, H, P+T, D)."""
        B, T = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past_len + T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask, T)
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        bias = attention_bias(attention_mask, T, x.dtype)  # (B, 1, T, P+T)
        presents: KVCache = []
        for i, block in enumerate(self.h):
            # The last block's attention output and MLP only where logits are kept (its key and value everywhere):
            # 6% of a 512-token prefill's matmuls.
            keep = logits_to_keep if i == len(self.h) - 1 else 0
            x, present = block(x, bias, past_key_values[i] if past_key_values else None, keep)
            presents.append(present)
        x = self.ln_f(x)  # (B, T, C), or (B, k, C) where logits_to_keep = k
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]  # (B, k, C): the unembedding is the largest matmul of a prefill
        logits = F.linear(x, self.wte.weight)  # (B, T or k, V)
        return logits, presents
