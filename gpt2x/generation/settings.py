"""What to generate (SamplingSettings) and what came out (Generation).

SamplingSettings' defaults are the sampling defaults of every entry point (`gpt2x generate`'s options,
the completions API's request fields): OpenAI's and vLLM's, temperature 1, top-p 1 and top-k off, so
that the same prompt, seed and settings give the same tokens whichever way they are asked for. A
temperature of 0 means greedy decoding (as in OpenAI's API and vLLM), wherever the settings come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..errors import UsageError


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 64  # tokens to generate per prompt (fewer if EOS or the context ends first)
    greedy: bool = False  # argmax decoding; ignores temperature/top-k/top-p (temperature 0 sets it)
    temperature: float = 1.0  # logits are divided by this before sampling; >= 0, 0 = greedy
    top_k: int = 0  # keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus: keep the smallest set whose probability reaches top_p; in (0, 1]
    seed: int = 0  # seeds the sampler; same seed, same logits -> same tokens
    num_beams: int = 1  # beam search when > 1 (deterministic)
    length_penalty: float = 1.0  # beam score = sum logprob / length ** length_penalty (transformers' definition)
    early_stopping: bool = False  # beam search stops as soon as num_beams hypotheses are finished
    ignore_eos: bool = False  # <|endoftext|> does not end a row and is kept as a token (vLLM's field)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}", option="max_new_tokens")
        if not self.temperature >= 0:  # NaN too
            raise UsageError(f"temperature must be >= 0 (0: greedy), got {self.temperature}", option="temperature")
        if self.temperature == 0:  # the one rule for every entry point: temperature 0 is greedy decoding
            object.__setattr__(self, "greedy", True)
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {self.top_k}", option="top_k")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}", option="top_p")
        if self.num_beams < 1:
            raise UsageError(f"num_beams must be at least 1, got {self.num_beams}", option="num_beams")


class Finish(str, Enum):
    """Why a row stopped: the one list every decoding path uses (generate, beam search, speculative
    decoding, the serving engine, the evaluation harness). The API maps it to OpenAI's `finish_reason`
    at its edge (serve.protocol.finish_reason): eos and stop -> "stop", length and context -> "length"."""

    eos = "eos"  # the model wrote <|endoftext|>
    stop = "stop"  # a stop string ended the row
    length = "length"  # the row's token budget (max_new_tokens, the API's max_tokens)
    context = "context"  # the model's context is full
    cancelled = "cancelled"  # the caller left (a client that went away)

    def __str__(self) -> str:
        return self.value


@dataclass
class Generation:
    prompt: str
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids, without the final EOS (kept with ignore_eos)
    finish_reason: Finish = Finish.length
    speculation: dict | None = None  # with a draft: SpecStats.to_dict() (drafted, accepted, acceptance rate, ...)
