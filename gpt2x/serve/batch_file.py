"""OpenAI batch files run offline (`gpt2x run-batch`, vLLM's `run-batch`): one request a line (`custom_id`, `method`
POST, `url` /v1/completions or /v1/chat/completions, `body`), each answered by the offline API's engine as the server
answers it, one output line per input line, in order: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. A line that is not a request gets its own error record and the others go on; a request the API
refuses is answered with its 4xx body, as the server would. Docs: docs/batch.md."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import OutputError
from .offline import LLM
from .openai.chat_completion import serving as chat
from .openai.completion import serving as completion
from .openai.errors import APIError
from .openai.render import to_json
from .openai.service import CompletionService

COMPLETIONS_URL, CHAT_URL = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_URL)


@dataclass
class Line:
    """One input line: its custom_id, and either the request (url, body) or why it is not one."""

    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: str | None = None


def parse_line(text: str, seen: set[str]) -> Line:
    """An input line read (`seen`: the custom_ids before it: a repeat is an error)."""
    try:
        item = json.loads(text)
    except ValueError as e:
        return Line(None, error=f"the line is not JSON: {e}")
    if not isinstance(item, dict):
        return Line(None, error="the line is not a JSON object")
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Line(None, error="custom_id must be a non-empty string")
    if cid in seen:
        return Line(cid, error=f"custom_id {cid!r} is repeated")
    url, body = item.get("url"), item.get("body")
    if item.get("method", "POST") != "POST":
        return Line(cid, error="method must be POST")
    if url not in URLS:
        return Line(cid, error=f"url must be one of {', '.join(URLS)}, got {str(url)[:80]!r}")
    if not isinstance(body, dict):
        return Line(cid, error="body must be a JSON object")
    return Line(cid, url, body)


def record(custom_id: str | None, status: int | None = None, body: Any = None, error: str | None = None) -> str:
    """One output line: a response (status and body) or an error that kept the line from being a request."""
    response = None if status is None else {"status_code": status, "request_id": "req-" + uuid.uuid4().hex, "body": body}
    return json.dumps({"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id, "response": response,
                       "error": None if error is None else {"code": "invalid_request", "message": error}},
                      ensure_ascii=False)


def done_ids(output: Path) -> set[str]:
    """The custom_ids an earlier run wrote to `output`, its last line cut first where a stopped run left it half
    written (so that it is run again)."""
    data = output.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(whole))
    ids = set()
    for line in whole.decode("utf-8", errors="replace").splitlines():
        try:
            cid = json.loads(line).get("custom_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(cid, str):
            ids.add(cid)
    return ids


def run_batch(llm: LLM, lines: Iterable[str], out: IO[str], skip: set[str] = frozenset(),
              progress: Callable[[int], None] = lambda n: None) -> dict[str, int]:
    """Every line of `lines` answered into `out`, in order, a line each (those whose custom_id is in `skip` left
    out: a resumed run's), a wave of the engine's queue in flight at once, each wave's lines written (and flushed)
    once it is answered. Counts: answered (`ok`), refused by the API (`refused`), not a request (`invalid`)."""
    service = llm.service
    seen: set[str] = set()
    todo: list[Line] = []
    for text in lines:
        if not text.strip():
            continue
        line = parse_line(text, seen)
        if line.custom_id in skip:  # answered by an earlier run
            continue
        if line.custom_id is not None:
            seen.add(line.custom_id)
        todo.append(line)
    counts = {"ok": 0, "refused": 0, "invalid": 0}
    wave = service.engine.settings.rows_held
    for start in range(0, len(todo), wave):
        part = todo[start : start + wave]
        for line, (status, text) in zip(part, llm.run(_answer_all(service, part))):
            out.write(text + "\n")
            counts["invalid" if line.error is not None else "ok" if status == 200 else "refused"] += 1
        out.flush()
        progress(len(part))
    return counts


async def _answer_all(service: CompletionService, lines: list[Line]) -> list[tuple[int | None, str]]:
    return list(await asyncio.gather(*(_answer(service, line) for line in lines)))


async def _answer(service: CompletionService, line: Line) -> tuple[int | None, str]:
    """(status, output line): the API's answer to the request, its 4xx error included; None for a line that is not one."""
    if line.error is not None:
        return None, record(line.custom_id, error=line.error)
    try:
        if line.url == CHAT_URL:
            body = await chat.complete(service.submit(service.chat_request(line.body)))
        else:
            body = await completion.complete(service.submit(service.request(line.body)))
    except APIError as e:
        return e.status, record(line.custom_id, e.status, json.loads(to_json(e.body())))
    return 200, record(line.custom_id, 200, json.loads(to_json(body)))


def open_output(path: Path, resume: bool) -> tuple[IO[str], set[str]]:
    """The output file to append to and the custom_ids it holds: a new file, or with `resume` an earlier run's
    (its half-written last line cut); an existing file without `resume` is refused (one OutputError line)."""
    if path.exists() and not resume:
        raise OutputError(f"{path} exists; pass --resume to go on with it, or choose another output")
    try:
        done = done_ids(path) if path.exists() else set()
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8"), done
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None

