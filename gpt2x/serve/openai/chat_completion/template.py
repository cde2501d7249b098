"""The chat template: a conversation rendered to one prompt by the model's Jinja2 chat template, as transformers'
`apply_chat_template` and vLLM render it (a sandboxed environment; `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`).

The template: `--chat-template FILE`, else the `chat_template` of the export folder's tokenizer_config.json (where
transformers and vLLM read a model's), else gpt2x's default (a play's script: onnx.interop.DEFAULT_CHAT_TEMPLATE),
unless the server was started with `--no-default-chat-template`: then one 400 that names the flags."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from ....onnx.interop import DEFAULT_CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE, chat_template_of
from ..errors import APIError, bad
from .protocol import Message

CHAT_TEMPLATE_FLAG = "--chat-template"
EOS_TOKEN = "<|endoftext|>"


class ChatTemplate:
    """A Jinja2 chat template, compiled once in a sandbox (templates come from model folders)."""

    def __init__(self, source: str, origin: str):
        self.source = source
        self.origin = origin  # where it came from, for messages

    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: the serve extra's

        def raise_exception(message: str) -> None:
            raise bad(f"the chat template refused the messages: {message}", "messages")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, **extra)
        except TemplateError as e:
            raise bad(f"the chat template ({self.origin}) failed on these messages: {e}", "messages") from None


DEFAULT_ORIGIN = "gpt2x's default chat template"


def find_template(export_folder: Path, given: str | None, default: bool = True) -> ChatTemplate | None:
    """`given` (the text of --chat-template's file), else the export folder's own (export_template), else with
    `default` gpt2x's default template (llama-server's behaviour: chat works out of the box), else None."""
    if given is not None:
        return ChatTemplate(given, CHAT_TEMPLATE_FLAG)
    own = export_template(export_folder)
    if own is None and default:
        return ChatTemplate(DEFAULT_CHAT_TEMPLATE, DEFAULT_ORIGIN)
    return own


def export_template(export_folder: Path) -> ChatTemplate | None:
    """The export folder's tokenizer_config.json chat_template (a string, or transformers' list of named templates:
    "default"), else None."""
    found = chat_template_of(export_folder)
    if isinstance(found, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    path = export_folder / TOKENIZER_CONFIG_FILE
    return ChatTemplate(found, str(path)) if isinstance(found, str) and found else None


def render_messages(messages: list[Message], template: ChatTemplate, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, extra: dict[str, Any] | None = None) -> str:
    """The conversation as the prompt the template makes of it (vLLM's `continue_final_message`: the last message
    left open, the text ending where its content does)."""
    rendered = [{**m.model_dump(exclude_none=True, exclude={"content"}), "content": m.text()} for m in messages]
    prompt = template.render(rendered, add_generation_prompt and not continue_final_message, extra or {})
    if continue_final_message:
        last = rendered[-1]["content"]
        cut = prompt.rfind(last)
        prompt = prompt[: cut + len(last)] if last and cut >= 0 else prompt
    return prompt


def no_template() -> APIError:
    return bad("this model has no chat template and the server was started with --no-default-chat-template: "
               f"start it with {CHAT_TEMPLATE_FLAG} FILE (a Jinja2 chat template, as transformers' "
               "tokenizer_config.json chat_template), or export with one (gpt2x export --chat-template FILE)",
               "messages", "chat_template_missing")
