"""What to generate (SamplingSettings) and what came out (Generation, Finish). The defaults are every entry
point's (OpenAI's and vLLM's), and the processors' fields are off at theirs, so the same prompt, seed and
settings give the same tokens however they are asked for; temperature 0 is greedy everywhere."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..errors import UsageError
from .constraints import ConstraintSpec
from .processors import DRY_BREAKERS, beam_refused_fields, checked_fields, token_ids


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
    # llama.cpp's DRY (processors.Dry), off at multiplier 0: a token extending a repeat of n >= allowed_length tokens loses
    # multiplier * base ** (n - allowed_length); the last penalty_last_n tokens scanned (-1: all, 0: off)
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS  # a match never reaches back past one (llama-server's default)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}", option="max_new_tokens")
        if not self.temperature >= 0:  # NaN too
            raise UsageError(f"temperature must be >= 0 (0: greedy), got {self.temperature}", option="temperature")
        if self.temperature == 0:  # the one rule for every entry point: temperature 0 is greedy decoding
            object.__setattr__(self, "greedy", True)
        if self.num_beams < 1:
            raise UsageError(f"num_beams must be at least 1, got {self.num_beams}", option="num_beams")
        if self.n < 1:
            raise UsageError(f"n must be at least 1, got {self.n}", option="n")
        # The logits processors' fields: each processor checks its own (processors.LogitsProcessor.checked)
        for name, value in checked_fields(self).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "stop_token_ids", token_ids(self.stop_token_ids, "stop_token_ids"))
        if self.num_beams > 1:
            changed = beam_refused_fields(self) + ["stop_token_ids"] * bool(self.stop_token_ids) + ["n"] * (self.n > 1)
            if changed:
                raise UsageError(f"num_beams is {self.num_beams}: beam search takes none of {', '.join(changed)} "
                                 "(it follows transformers' beam search without logits processors)", option="num_beams")


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
    decoder: str | None = None  # on the fixed-capacity cache: which (runtime.static_decode.StaticDecoder.name)


OnToken = Callable[[int, int], None]  # (row, token id), called as each token is produced
