"""What to generate (SamplingSettings) and what came out (Generation, Finish). The defaults are every entry
point's (OpenAI's and vLLM's), and the processors' fields are off at theirs, so the same prompt, seed and
settings give the same tokens however they are asked for; temperature 0 is greedy everywhere."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from numbers import Integral

from ..errors import UsageError
from ..tokenizer import VOCAB_SIZE
from .constraints import ConstraintSpec

PENALTY_RANGE = 2.0  # presence and frequency penalties: [-2, 2] (OpenAI's and vLLM's)
BIAS_RANGE = 100.0  # logit_bias values: [-100, 100] (OpenAI's)


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
    # OpenAI's, on the generated tokens: logit -= frequency_penalty * count + presence_penalty * (count > 0)
    presence_penalty: float = 0.0  # in [-2, 2]; > 0 discourages any token already generated
    frequency_penalty: float = 0.0  # in [-2, 2]; > 0 discourages tokens by how often they were generated
    repetition_penalty: float = 1.0  # > 0, 1 = off: the CTRL rule on prompt and generated tokens (transformers', vLLM's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit; a dict is taken
    min_p: float = 0.0  # in [0, 1], 0 = off: drop tokens less likely than min_p times the most likely (vLLM, transformers)
    min_tokens: int = 0  # <|endoftext|> and stop_token_ids cannot be sampled before this many tokens (vLLM's)
    stop_token_ids: tuple[int, ...] = ()  # a row ends (Finish.stop) when it samples one; the token is not kept (vLLM's)
    constraint: ConstraintSpec | None = None  # structured output: a JSON schema, regex, choice or grammar (constraints.py)
    n: int = 1  # samples per prompt (generate(): sample i seeded seed + i, vLLM's rule; the API: n choices)
    allowed_token_ids: tuple[int, ...] = ()  # only these tokens can be sampled; () = every token (vLLM's field)
    # Repetition controls (transformers' definitions): no n-gram of this size occurs twice in prompt and output, 0 = off;
    # typical sampling keeps the tokens whose surprise is nearest the entropy, up to this mass, 1 = off (sampling only)
    no_repeat_ngram_size: int = 0
    typical_p: float = 1.0
    bad_words: tuple[str, ...] = ()  # vLLM's: these words are never generated (processors.BadWords)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}", option="max_new_tokens")
        if self.constraint is not None:
            self.constraint.validate()  # an invalid schema, regex or grammar: one UsageError, before any work
            if self.ignore_eos:
                raise UsageError("ignore_eos cannot be combined with structured output: a constrained row ends "
                                 "where its constraint is satisfied", option="ignore_eos")
            if self.min_tokens:
                raise UsageError("min_tokens cannot be combined with structured output: the constraint decides "
                                 "where a row may end", option="min_tokens")
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise UsageError(f"{name} must be in [-2, 2], got {getattr(self, name)}", option=name)
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise UsageError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}",
                             option="repetition_penalty")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"min_p must be in [0, 1] (0: off), got {self.min_p}", option="min_p")
        if self.min_tokens < 0:
            raise UsageError(f"min_tokens must be >= 0, got {self.min_tokens}", option="min_tokens")
        if self.min_tokens > self.max_new_tokens:
            raise UsageError(f"min_tokens must be at most max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}",
                             option="min_tokens")
        if self.n < 1:
            raise UsageError(f"n must be at least 1, got {self.n}", option="n")
        if self.no_repeat_ngram_size < 0:
            raise UsageError(f"no_repeat_ngram_size must be >= 0 (0: off), got {self.no_repeat_ngram_size}",
                             option="no_repeat_ngram_size")
        if not 0 < self.typical_p <= 1:
            raise UsageError(f"typical_p must be in (0, 1] (1: off), got {self.typical_p}", option="typical_p")
        if isinstance(self.bad_words, str) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise UsageError(f"bad_words must be a list of words (non-blank strings), got {self.bad_words!r}",
                             option="bad_words")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids", _token_ids(self.allowed_token_ids, "allowed_token_ids"))
        if self.num_beams > 1:
            changed = [name for name in ("presence_penalty", "frequency_penalty", "logit_bias", "min_tokens",
                                         "stop_token_ids", "constraint", "allowed_token_ids") if getattr(self, name)]
            changed += ["repetition_penalty"] if self.repetition_penalty != 1.0 else []
            changed += ["n"] if self.n > 1 else []
            changed += ["no_repeat_ngram_size"] if self.no_repeat_ngram_size else []
            changed += ["bad_words"] if self.bad_words else []
            if changed:
                raise UsageError(f"num_beams is {self.num_beams}: beam search takes none of {', '.join(changed)} "
                                 "(it follows transformers' beam search without logits processors)", option="num_beams")


def _token_id(value: object, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < VOCAB_SIZE:
        raise UsageError(f"{option} must hold token ids in [0, {VOCAB_SIZE}), got {value!r}", option=option)
    return int(value)


def _token_ids(ids: object, option: str = "stop_token_ids") -> tuple[int, ...]:
    """Token ids as a tuple, in order, each once (vLLM drops repeats the same way)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise UsageError(f"{option} must be a list of token ids, got {ids!r}", option=option)
    return tuple(dict.fromkeys(_token_id(t, option) for t in ids))  # type: ignore[union-attr]


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs sorted by id (a dict, or pairs: the last bias of an id wins)."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        merged = {_token_id(t, "logit_bias"): float(b) for t, b in items}  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise UsageError(f"logit_bias must map token ids to biases, got {bias!r}", option="logit_bias") from None
    for token, b in merged.items():
        if not -BIAS_RANGE <= b <= BIAS_RANGE:
            raise UsageError(f"logit_bias must hold biases in [-100, 100], got {b} for token {token}", option="logit_bias")
    return tuple(sorted(merged.items()))


class Finish(str, Enum):
    """Why a row stopped, on every decoding path; mapped to OpenAI's `finish_reason` only at the API's edge."""

    eos = "eos"  # the model wrote <|endoftext|>
    stop = "stop"  # a stop string ended the row, or a stop token id (settings.stop_token_ids, not kept)
    length = "length"  # the row's token budget (max_new_tokens, the API's max_tokens)
    context = "context"  # the model's context is full
    cancelled = "cancelled"  # the caller left (a client that went away)
    failed = "failed"  # the row alone could not go on (its constraint failed: Sequence.error says why)

    def __str__(self) -> str:
        return self.value


@dataclass
class Generation:
    prompt: str
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids, without the final EOS (kept with ignore_eos)
    finish_reason: Finish = Finish.length
    speculation: dict | None = None  # with a draft: SpecStats.to_dict() (drafted, accepted, acceptance rate, ...)
