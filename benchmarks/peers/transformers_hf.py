"""transformers' `GPT2LMHeadModel.generate` (PyTorch eager): the reference every ratio divides by
and every contender's first tokens are compared with. It always runs."""

from __future__ import annotations

import time

import numpy as np
import torch

from gpt2x.choices import Precision

from .core import Context

KEY = "transformers"
ORDER = 0
LABEL = "transformers generate"
NAME = "transformers generate (PyTorch eager)"


class HFGenerate:
    """`generate` of transformers' GPT2LMHeadModel or Optimum's ORTModelForCausalLM. A logits
    processor stamps the clock each time logits arrive, which splits the first token from decoding."""

    batches = None

    def __init__(self, name: str, engine: str, model):
        self.name, self.engine, self.precision, self.model = name, engine, Precision.fp32, model
        self.runtime = name

    def _generate(self, prompt: np.ndarray, n: int, processors=()):
        from transformers import LogitsProcessorList

        ids = torch.from_numpy(prompt)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, num_beams=1, pad_token_id=50256,
                                      logits_processor=LogitsProcessorList(processors))
        assert out.shape[1] == prompt.shape[1] + n
        return out[:, prompt.shape[1]:].numpy()

    def check(self, prompt: np.ndarray, k: int) -> np.ndarray:
        return self._generate(prompt, k)

    def run(self, prompt: np.ndarray, n: int) -> dict:
        from transformers import LogitsProcessor

        stamps: list[float] = []

        class Clock(LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        t0 = time.perf_counter()
        self._generate(prompt, n, [Clock()])
        total = time.perf_counter() - t0
        return {"total_s": total, "ttft_s": stamps[0] - t0, "steps_s": [float(x) for x in np.diff(stamps)]}


def load(ctx: Context) -> list:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(ctx.hf_dir, dtype=torch.float32).eval()
    return [HFGenerate(NAME, "torch", hf)]
