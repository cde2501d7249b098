"""Writes the two JSONL files of gpt2x's offline lm-eval tasks from the held-out Shakespeare text that
gpt2x ships (gpt2x.evaluate.metrics.heldout_text; never trained on). Deterministic: run it again and
the files come out byte-identical (the committed ones are its output).

    python tests/data/lm_eval_tasks/make_shakespeare_tasks.py

- shakespeare_mc.jsonl (gpt2x_shakespeare_mc): 32 items. The context is a speech up to one of its
  lines (the speaker's name and at most 3 lines before the one asked for); the choices are the true
  next line and 3 lines of other speeches, in a seeded random order; `gold` is the true line's index.
- shakespeare_ppl.jsonl (gpt2x_shakespeare_ppl): the text cut at blank lines into documents, each closed
  once it holds PPL_DOC_CHARS characters (the remainder joins the last): 5 documents of 370 to 570
  tokens, each longer than the bundled model's 256-token context, so rolling windows roll.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gpt2x.evaluate.metrics import heldout_text

HERE = Path(__file__).resolve().parent
MC_ITEMS = 32
PPL_DOC_CHARS = 1100
SEED = 20


def speeches(text: str) -> list[list[str]]:
    """The text's speeches: blocks between blank lines, each [speaker line, line, ...]."""
    return [block.splitlines() for block in text.strip().split("\n\n") if len(block.splitlines()) >= 2]


def mc_items(text: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    blocks = speeches(text)
    candidates = [(b, i) for b in range(len(blocks)) for i in range(1, len(blocks[b]))]
    picked = sorted(rng.sample(candidates, n))
    items = []
    for b, i in picked:
        lines = blocks[b]
        context = "\n".join([lines[0], *lines[max(1, i - 3) : i]])
        answer = lines[i]
        others = sorted({line for c, other in enumerate(blocks) if c != b for line in other[1:] if line != answer})
        choices = [answer, *rng.sample(others, 3)]
        rng.shuffle(choices)
        items.append({"id": len(items), "context": context, "choices": choices, "gold": choices.index(answer)})
    return items


def ppl_docs(text: str, min_chars: int) -> list[dict]:
    docs, current = [], []
    for block in text.strip().split("\n\n"):
        current.append(block)
        if len("\n\n".join(current)) >= min_chars:
            docs.append("\n\n".join(current))
            current = []
    if current:  # a short remainder joins the last document
        docs[-1] = "\n\n".join([docs[-1], *current])
    return [{"id": i, "text": d} for i, d in enumerate(docs)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    text = heldout_text()
    write_jsonl(HERE / "shakespeare_mc.jsonl", mc_items(text, MC_ITEMS, SEED))
    write_jsonl(HERE / "shakespeare_ppl.jsonl", ppl_docs(text, PPL_DOC_CHARS))


if __name__ == "__main__":
    main()
