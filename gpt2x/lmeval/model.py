"""`Gpt2xLM`: lm-evaluation-harness's model interface on any gpt2x Backend, registered as "gpt2x" (its model
arguments: docs/commands/eval.md). Scoring and generation are gpt2x.evaluate.harness's.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..choices import BackendKind, Precision, Progress, ProviderKind
from ..errors import UsageError
from ..evaluate import harness
from ..generation.settings import SamplingSettings
from ..runtime.base import Backend
from ..tokenizer import EOT_ID, decode, encode
from ..workflows.backends import open_backend

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's Hugging Face model's default
DEFAULT_SEED = 1234
# gen_kwargs that generate_until honours; any other is ignored, with a warning.
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "seed")


def _choice(kind, value: Any, name: str):
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind(str(value).lower())
    except ValueError:
        raise UsageError(f"{name} {value!r} is not one of {', '.join(e.value for e in kind)}", option=name) from None


def _batch_size(value: Any, max_batch_size: Any = None) -> int:
    """lm-eval's "auto" is the default (or max_batch_size): gpt2x bounds a batch by its token slots, not memory."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return int(max_batch_size) if max_batch_size else harness.DEFAULT_BATCH_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"batch_size must be an integer or auto, got {value!r}", option="batch_size") from None
    if size < 1:
        raise UsageError(f"batch_size must be at least 1, got {size}", option="batch_size")
    return size


def _provider_from_device(device: Any) -> ProviderKind | None:
    """lm-eval's `device` ("cuda", "cuda:0", "cpu") as a provider, or None when it names none gpt2x has."""
    if not device:
        return None
    name = str(device).split(":")[0].lower()
    return ProviderKind(name) if name in {p.value for p in ProviderKind} else None


def sampling_from(gen_kwargs: dict, max_gen_toks: int, seed: int) -> tuple[SamplingSettings, tuple[str, ...]]:
    """gen_kwargs as sampling settings and stop strings; greedy unless do_sample with a temperature above 0."""
    kwargs = dict(gen_kwargs or {})
    unknown = sorted(k for k in kwargs if k not in GEN_KWARGS)
    if unknown:
        log.warning("gpt2x ignores these generation arguments: %s", ", ".join(unknown))
    until = kwargs.get("until") or ()
    if isinstance(until, str):
        until = (until,)
    if not all(isinstance(s, str) for s in until):
        raise UsageError(f"until must be a string or a list of strings, got {until!r}", option="until")
    temperature = kwargs.get("temperature")
    do_sample = bool(kwargs.get("do_sample", False))
    greedy = not do_sample or (temperature is not None and float(temperature) <= 0)
    settings = SamplingSettings(
        max_new_tokens=int(kwargs.get("max_gen_toks", max_gen_toks)),
        greedy=greedy,
        temperature=1.0 if greedy or temperature is None else float(temperature),
        top_k=int(kwargs.get("top_k") or 0),
        top_p=float(kwargs.get("top_p") or 1.0),
        seed=int(kwargs.get("seed", seed)),
    )
    return settings, tuple(until)


@register_model("gpt2x")
class Gpt2xLM(TemplateLM):
    """lm-eval's LM on a gpt2x Backend. See the module docstring for the arguments lm-eval passes."""

    def __init__(self, backend: Backend, batch_size: int | str | None = harness.DEFAULT_BATCH_SIZE,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = DEFAULT_SEED,
                 max_batch_tokens: int = harness.MAX_BATCH_TOKENS, show_progress: bool = True,
                 max_batch_size: int | None = None):
        super().__init__()
        if isinstance(backend, str):
            raise UsageError("Gpt2xLM takes an open gpt2x Backend; to open one by name use Gpt2xLM.open(model=..., "
                             "backend=...) or lm-eval's model_args")
        self.gpt2x_backend = backend
        self.batch_size = _batch_size(batch_size, max_batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        self.max_batch_tokens = int(max_batch_tokens)
        self.show_progress = show_progress

    # -- construction from lm-eval's strings

    @classmethod
    def open(cls, model: str | None = None, backend: str | BackendKind = BackendKind.ort, provider: str | None = None,
             precision: str | None = None, onnx: str | Path | None = None, revision: str | None = None,
             threads: int | None = None, device: str | None = None, progress: Progress | None = None,
             notice: Progress | None = None, **options) -> Gpt2xLM:
        """Open the backend the arguments name and wrap it; `options` are the constructor's."""
        kind = _choice(BackendKind, backend, "backend")
        chosen = _choice(ProviderKind, provider, "provider")
        from_device = _provider_from_device(device)
        if chosen is not None and from_device is not None and chosen is not from_device:
            raise UsageError(f"provider {chosen.value} and device {device} disagree")
        runner = open_backend(
            kind, chosen or from_device or ProviderKind.cpu, None if model is None else str(model), revision,
            _choice(Precision, precision, "precision"), None if onnx is None else Path(str(onnx)),
            None if threads is None else int(threads),
            progress=progress or log.info, notice=notice or log.warning,
        )
        return cls(runner, **options)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> Gpt2xLM:
        args = {**arg_dict, **{k: v for k, v in (additional_config or {}).items() if v is not None}}
        if not isinstance(args.get("backend", BackendKind.ort), (str, BackendKind)):
            args.pop("device", None)  # an open Backend runs where it was opened
            return cls(**args)
        return cls.open(**args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> Gpt2xLM:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # -- what lm-eval asks of a model

    @property
    def eot_token_id(self) -> int:
        return EOT_ID

    @property
    def prefix_token_id(self) -> int:
        return EOT_ID

    @property
    def max_length(self) -> int:
        return self.gpt2x_backend.n_positions

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return encode(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return decode(tokens)

    def get_model_info(self) -> dict:
        b = self.gpt2x_backend
        return {"gpt2x_model": b.model_name, "gpt2x_backend": b.name, "gpt2x_provider": b.provider.value,
                "gpt2x_n_positions": b.n_positions, "gpt2x_batch_size": self.batch_size}

    def _bar(self, total: int, desc: str, disable_tqdm: bool):
        return tqdm(total=total, desc=desc, file=sys.stderr, disable=disable_tqdm or not self.show_progress)

    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str, disable_tqdm: bool) -> list[tuple[float, bool]]:
        with self._bar(len(pairs), desc, disable_tqdm) as bar:
            return harness.score_continuations(self.gpt2x_backend, pairs, self.batch_size, bar.update, self.max_batch_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids), as TemplateLM tokenizes them."""
        results = self._score([(ctx, cont) for _, ctx, cont in requests], "gpt2x loglikelihood", disable_tqdm)
        for (strings, _, _), answer in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Over lm-eval's disjoint rolling windows: every token predicted once, with as much context as fits."""
        windows: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (string,) = req.args
            for window in lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                             max_seq_len=self.max_length, context_len=1):
                windows.append(lm_utils.make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(windows, "gpt2x loglikelihood_rolling", disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation arguments run as left-padded batches."""
        n = self.max_length
        groups: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            settings, until = sampling_from(gen_kwargs, self.max_gen_toks, self.seed)
            prompt = harness.prompt_for_generation(self.tok_encode(context), n, settings.max_new_tokens)
            groups[(settings, until)].append((i, prompt))
        out: list[str | None] = [None] * len(requests)
        with self._bar(len(requests), "gpt2x generate_until", disable_tqdm) as bar:
            for (settings, until), items in groups.items():
                items.sort(key=lambda item: -len(item[1]))
                for start in range(0, len(items), self.batch_size):
                    batch = items[start : start + self.batch_size]
                    texts = harness.generate_until(self.gpt2x_backend, [p for _, p in batch], settings, until)
                    for (i, _), text in zip(batch, texts):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(batch))
        return out  # type: ignore[return-value]  # every slot is filled
