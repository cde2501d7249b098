"""The offline Python API, vLLM's shape (`LLM(model).generate(prompts, SamplingParams(...))`): the serving engine
run in this process, without HTTP. Each prompt is a completions request of the OpenAI layer (openai/service.py), so
its fields mean what they mean there (stop strings, n, seeds, logprobs, structured output, the repetition controls),
and every prompt of a call is in flight at once: the engine batches them continuously, as it batches a server's
requests. Chat (`LLM.chat`) renders each conversation with the export's chat template, as /v1/chat/completions does.
Docs: docs/python.md."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, field, make_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from ..choices import BackendKind, Precision, ProviderKind
from ..errors import UsageError
from ..workflows.backends import choose_backend
from ..workflows.exports import resolve_export
from .core.scheduler import EngineSettings
from .openai.completion.protocol import CompletionRequest
from .openai.errors import APIError
from .openai.pending import ServedRequest
from .openai.render import ChoiceLogprobs
from .openai.sampling import PROCESSOR_FIELDS
from .openai.service import CompletionService
from .replica import ReplicaConfig, close_service, open_service

PROGRESS_FROM = 16  # prompts from which a call shows a progress bar on stderr
T = TypeVar("T")


# vLLM's SamplingParams: the request fields gpt2x serves under vLLM's names, with their completions-request meanings
# (None: the default). Every logits processor's field the request names (sampling.PROCESSOR_FIELDS, derived from the
# processors: a new one is here with no line of this module's), and these, whose Python shape is vLLM's own.
_OWN_FIELDS: dict[str, tuple[Any, Any]] = {
    "n": (int, 1), "max_tokens": (int | None, 16), "seed": (int | None, None), "stop": (list[str] | None, None),
    "stop_token_ids": (list[int] | None, None), "ignore_eos": (bool, False), "logprobs": (int | None, None),
    "logit_bias": (dict[int, float] | None, None),
    "structured_outputs": (dict[str, Any] | None, None),  # {"json": schema}, {"regex": ...}, {"choice": [...]}, ...
}


def _body(self: Any) -> dict:
    """The fields set, as a completions body holds them."""
    out = {k: v for k, v in asdict(self).items() if v is not None and v is not False}
    if self.logit_bias is not None:
        out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
    return out


SamplingParams = make_dataclass(
    "SamplingParams",
    [(name, kind, field(default=default)) for name, (kind, default) in _OWN_FIELDS.items()]
    + [(name, CompletionRequest.model_fields[name].annotation, field(default=None))
       for name in PROCESSOR_FIELDS if name not in _OWN_FIELDS],
    frozen=True, namespace={"body": _body, "__module__": __name__,
                            "__doc__": "vLLM's SamplingParams, the fields gpt2x serves, with their completions-request "
                                       "meanings (None: the default)."})


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of a prompt (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[str, float]] | None = None  # per token, its logprob and the most likely ones (the API's)


@dataclass(frozen=True)
class RequestOutput:
    """A prompt and its choices (vLLM's RequestOutput)."""

    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    """An export served in this process: `model` a model name (exported first where missing, as `gpt2x generate`
    does) or an export folder. Close it (`close`, or `with LLM(...) as llm`) to stop its engine."""

    def __init__(self, model: str = "shakespeare", precision: str | Precision | None = None, backend: str | None = None,
                 provider: str = "cpu", threads: int | None = None, max_batch_size: int = 16,
                 chat_template: str | None = None):
        """`backend` None: the one that runs the export's precision by default (as the commands choose it: ort, or
        openvino for bf16)."""
        folder = Path(model)
        asked = None if precision is None else Precision(precision)
        kind = choose_backend(None if backend is None else BackendKind(backend), asked, ProviderKind(provider), folder,
                              asked_as="precision='bf16'")
        info = resolve_export(onnx_dir=folder) if (folder / "gpt2x.json").is_file() else \
            resolve_export(model, precision=asked)
        if asked is not None and info.precision is not asked:
            raise UsageError(f"{info.folder} is a {info.precision.value} export, not {asked.value}")
        self.model_id = info.meta["model"]["name"]
        config = ReplicaConfig(export=str(info.folder.resolve()), model_id=self.model_id, backend=kind.value,
                               provider=ProviderKind(provider).value, threads=threads,
                               engine=EngineSettings(max_batch_size=max_batch_size, max_waiting=1 << 16),
                               chat_template=chat_template)
        self._service: CompletionService | None = open_service(config)
        # One event loop for the LLM's life: the engine tells a row's last outputs after its answer is complete, and
        # a loop closed by then (asyncio.run's, per call) would refuse them.
        self._loop = asyncio.new_event_loop()

    @property
    def service(self) -> CompletionService:
        if self._service is None:
            raise UsageError("this LLM is closed")
        return self._service

    def close(self) -> None:
        if self._service is not None:
            close_service(self._service)
            self._service = None
            self._loop.close()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` run to its end on the LLM's event loop (the engine's answers arrive there)."""
        return self._loop.run_until_complete(work)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]], params: SamplingParams | None = None,
                 progress: bool | None = None) -> list[RequestOutput]:
        """Each prompt (a text, or token ids) completed with `params`, in the order given."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        bodies = [{**(params or SamplingParams()).body(), "prompt": p} for p in prompts]
        return self._run(bodies, chat_bodies=False, progress=progress)

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None,
             progress: bool | None = None, tools: Sequence[dict] | None = None,
             tool_choice: str | dict | None = None) -> list[RequestOutput]:
        """Each conversation (a list of {"role", "content"} messages; or one conversation) rendered by the export's
        chat template and completed, as /v1/chat/completions does. `tools` (OpenAI's) reach the template, as vLLM's
        LLM.chat hands them; with `tool_choice` required or a named function, each output's text is the calls' JSON,
        as the API generates them (docs/serving/api.md, tool calls)."""
        conversations = list(conversations)
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        base = (params or SamplingParams()).body()
        if "max_tokens" in base:  # chat's name; its default is what the context leaves
            base["max_completion_tokens"] = base.pop("max_tokens")
        if tools is not None:  # vLLM's LLM.chat: the template's, never called unless tool_choice asks
            base |= {"tools": list(tools), "tool_choice": "none" if tool_choice is None else tool_choice}
        elif tool_choice is not None:
            base["tool_choice"] = tool_choice
        bodies = [{**base, "messages": list(c)} for c in conversations]
        return self._run(bodies, chat_bodies=True, progress=progress)

    def _run(self, bodies: list[dict], chat_bodies: bool, progress: bool | None) -> list[RequestOutput]:
        reqs = []
        for body in bodies:  # every request checked before any runs: a bad one is one error, nothing half done
            try:
                reqs.append(self._prepare({**body, "return_token_ids": True}, chat_bodies))
            except APIError as e:
                raise UsageError(f"{e.param or 'request'}: {e.message}", option=e.param) from None
        show = len(reqs) >= PROGRESS_FROM if progress is None else progress
        return self.run(self._complete(reqs, show))

    def _prepare(self, body: dict, chat_body: bool) -> ServedRequest:
        """A body as the request it is served as: a completions request's, or a conversation's rendered by the chat
        template, its logprobs in the completions shape (the API's chat shape is chat's own)."""
        service = self.service
        if not chat_body:
            return service.request(body)
        k = body.pop("logprobs", None)
        req = service.chat_request(body)
        return req if k is None else replace(req, logprobs=k, logprobs_shape=ChoiceLogprobs)

    async def _complete(self, reqs: list, show: bool) -> list[RequestOutput]:
        service = self.service
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="gpt2x", unit="prompt", file=sys.stderr)

        async def one(req) -> RequestOutput:
            try:
                response = await service.complete(service.submit(req))
            except APIError as e:
                raise UsageError(e.message) from None
            if bar is not None:
                bar.update(1)
            return _output(req, response)

        try:
            # Submitted in waves the engine's queue holds; every wave in flight at once, batched by the engine
            limit = service.engine.settings.rows_held
            out: list[RequestOutput] = []
            for start in range(0, len(reqs), limit):
                out += await asyncio.gather(*(one(r) for r in reqs[start : start + limit]))
            return out
        finally:
            if bar is not None:
                bar.close()


def _output(req, response) -> RequestOutput:
    choices = []
    prompt_ids: list[int] = list(req.prompt_ids[0])
    for c in response.choices:
        lp = None
        if c.logprobs is not None:
            lp = [dict(top or {}, **{tok: logprob}) if logprob is not None else dict(top or {})
                  for tok, logprob, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)]
        choices.append(CompletionOutput(c.index, c.text, list(c.token_ids or []), c.finish_reason, lp))
    return RequestOutput(req.prompts[0], prompt_ids, choices)
