"""Training the bundled `shakespeare` model: a small GPT-2 with the full GPT-2 vocabulary.

Re-runnable by anyone: `gpt2x train --corpus tinyshakespeare.txt --out DIR` (fixed seed, logged loss).
The corpus is tokenized with GPT-2's BPE; the first 90% of the tokens train, the last 10% are held out.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..fileio import write_atomic
from ..tokenizer import encode
from ..version import __version__
from .config import GPT2Config
from .gpt2 import GPT2
from .hf_format import gpt2x_to_hf
from .weights import build_model, save_hf


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 800  # optimizer steps
    batch_size: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence (= the model's context)
    lr: float = 3e-3  # peak learning rate (AdamW), after linear warm-up
    warmup: int = 60  # warm-up steps
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW weight decay on matrices (not on biases, LayerNorms)
    seed: int = 1337  # seeds initialisation and batch sampling
    eval_every: int = 200  # steps between held-out evaluations
    train_fraction: float = 0.9  # leading share of the tokens used for training


SHAKESPEARE_CONFIG = GPT2Config(vocab_size=50257, n_positions=256, n_embd=128, n_layer=4, n_head=4)


def split_tokens(text: str, train_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(encode(text), dtype=torch.long)
    cut = int(len(ids) * train_fraction)
    return ids[:cut], ids[cut:]


@torch.no_grad()
def heldout_loss(model: GPT2, tokens: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    """Mean cross-entropy (nats/token) over non-overlapping windows covering the held-out tokens."""
    model.eval()
    n = (len(tokens) - 1) // seq_len
    x = tokens[: n * seq_len].view(n, seq_len)  # (n, T)
    y = tokens[1 : n * seq_len + 1].view(n, seq_len)  # (n, T)
    total = 0.0
    for i in range(0, n, batch_size):
        logits, _ = model(x[i : i + batch_size])
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + batch_size].flatten(), reduction="sum").item()
    return total / (n * seq_len)


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    corpus: Path,
    out: Path,
    settings: TrainSettings = TrainSettings(),
    cfg: GPT2Config = SHAKESPEARE_CONFIG,
    log: Callable[[str], None] = lambda line: None,
) -> dict:
    """Train, save fp16 weights in Hugging Face layout under `out`, return the training record."""
    try:
        text = corpus.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read corpus {corpus}: {e}") from None
    if settings.seq_len > cfg.n_positions:
        raise UsageError(f"seq_len {settings.seq_len} exceeds the model context {cfg.n_positions}")
    train_ids, held_ids = split_tokens(text, settings.train_fraction)
    if len(train_ids) <= settings.seq_len + 1 or len(held_ids) <= settings.seq_len + 1:
        raise UsageError(f"corpus {corpus} is too small for seq_len {settings.seq_len}")
    torch.manual_seed(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    model = GPT2(cfg).init_weights(seed=settings.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.95),
    )
    history = []
    t0 = time.perf_counter()
    for step in range(settings.steps):
        model.train()
        starts = torch.randint(0, len(train_ids) - settings.seq_len - 1, (settings.batch_size,), generator=gen)
        x = torch.stack([train_ids[s : s + settings.seq_len] for s in starts])  # (B, T)
        y = torch.stack([train_ids[s + 1 : s + settings.seq_len + 1] for s in starts])  # (B, T)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, settings)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        record = {"step": step + 1, "train_loss": round(loss.item(), 4), "lr": round(lr_at(step, settings), 6),
                  "seconds": round(time.perf_counter() - t0, 1)}
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            record["heldout_loss"] = round(heldout_loss(model, held_ids, settings.seq_len), 4)
        if (step + 1) % 25 == 0 or "heldout_loss" in record:
            history.append(record)
            log(" ".join(f"{k}={v}" for k, v in record.items()))

    # What ships is fp16: report the held-out loss of exactly those weights.
    sd16 = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    shipped = build_model(cfg, gpt2x_to_hf(sd16), torch.float32)
    result = {
        "gpt2x_version": __version__,
        "config": cfg.to_dict(),
        "settings": asdict(settings),
        "parameters": model.num_parameters(),
        "train_tokens": len(train_ids),
        "heldout_tokens": len(held_ids),
        "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "heldout_loss_fp32": round(heldout_loss(model, held_ids, settings.seq_len), 4),
        "heldout_loss_fp16": round(heldout_loss(shipped, held_ids, settings.seq_len), 4),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "torch_version": torch.__version__,
        "history": history,
    }
    save_hf(shipped, out, dtype=torch.float16, metadata={"gpt2x_version": __version__})
    return result


def write_card(out: Path, record: dict, command: str) -> None:
    """MODEL_CARD.md and training.json (the full record, loss history included) beside the weights."""
    write_atomic(out / "training.json", json.dumps({**record, "command": command}, indent=1) + "\n")
    cfg, s = record["config"], record["settings"]
    card = f"""# shakespeare: a small GPT-2 trained on Tiny Shakespeare

Bundled with gpt2x so that everything works offline. Same architecture and full 50,257-token GPT-2
vocabulary as GPT-2 itself, so it exercises the same code paths; weights stored as fp16 safetensors
in Hugging Face layout (transformers' `GPT2LMHeadModel.from_pretrained` loads this folder too).

| | |
| --- | --- |
| config | n_layer={cfg['n_layer']}, n_head={cfg['n_head']}, n_embd={cfg['n_embd']}, n_positions={cfg['n_positions']}, vocab_size={cfg['vocab_size']} |
| parameters | {record['parameters']:,} (wte tied to the unembedding) |
| data | tinyshakespeare.txt (public domain), GPT-2 BPE: first 90% of tokens train ({record['train_tokens']:,}), last 10% held out ({record['heldout_tokens']:,}) |
| steps | {s['steps']} x batch {s['batch_size']} x {s['seq_len']} tokens = {record['tokens_seen']:,} tokens seen |
| optimizer | AdamW (0.9, 0.95), lr {s['lr']} with {s['warmup']} warm-up steps and cosine decay to {s['lr'] * s['min_lr_ratio']:g}, weight decay {s['weight_decay']}, grad clip 1.0 |
| seed | {s['seed']} |
| held-out loss | {record['heldout_loss_fp16']} nats/token with the shipped fp16 weights ({record['heldout_loss_fp32']} in fp32 before rounding); a unigram model scores 6.70 |
| training time | {record['train_seconds']} s on the CPU, torch {record['torch_version']}, gpt2x {record['gpt2x_version']} |

Made with:

```
{command}
```

The loss every 25 steps is in `training.json`.
"""
    write_atomic(out / "MODEL_CARD.md", card)
