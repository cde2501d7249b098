"""The chat playground (`GET /playground`, openai/playground.html): served without the API key, self-contained (no
other origin, a Content-Security-Policy that allows none), and driven in a real headless Chromium (Debian's, through
Playwright, as the web backend's tests drive it) against a real uvicorn server: what the page shows, streamed, is
gpt2x's own generation of the prompt the chat template renders (the conversation, its system prompt and the page's
sampling controls included), in chat and in completion mode; Stop ends a stream; errors are the server's messages."""

from __future__ import annotations

import ast
import fnmatch
import re
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.onnx.interop import DEFAULT_CHAT_TEMPLATE
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import EngineSettings
from gpt2x.serve.openai.chat import ChatTemplate
from gpt2x.serve.openai.routes import local_app
from gpt2x.serve.openai.service import CompletionService
from gpt2x.tokenizer import decode

from ..helpers import uvicorn_server

ROOT = Path(__file__).resolve().parents[2]
KEY = "playground-key"
TOKENS = 12
TEMPLATE = ChatTemplate(DEFAULT_CHAT_TEMPLATE, "test")  # gpt2x's default: the system prompt is a turn of its own
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def service(export_dir):
    s = CompletionService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=4),
                          "shakespeare", chat_template=TEMPLATE)
    yield s
    s.close()


@pytest.fixture(scope="module")
def base(service):
    with uvicorn_server(local_app(service, api_key=KEY)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    from gpt2x.runtime.web import CHROMIUM_ARGS, chromium_path

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def test_the_page_is_served_without_the_key_and_left_out_of_the_api_description(service):
    with TestClient(local_app(service, api_key=KEY)) as c:
        assert c.get("/v1/models").status_code == 401  # the API needs the key; its page does not
        r = c.get("/playground")
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        assert "<title>gpt2x playground</title>" in r.text
        policy = r.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "'unsafe-inline'" not in policy
        assert r.headers["x-content-type-options"] == "nosniff"
        home = c.get("/", follow_redirects=False)
        assert home.status_code == 307 and home.headers["location"] == "/playground"
        paths = c.get("/openapi.json").json()["paths"]
        assert "/playground" not in paths and "/" not in paths  # a web page, as /metrics' text: not the API
    with TestClient(local_app(service), root_path="/main") as c:  # under a prefix (Ray Serve's route prefix)
        assert c.get("/", follow_redirects=False).headers["location"] == "/main/playground"


def test_the_page_reaches_no_other_origin_and_writes_no_html(service):
    with TestClient(local_app(service)) as c:
        html = c.get("/playground").text
    # No URL with a scheme or a protocol-relative one anywhere: every request goes to the server that sent the page.
    assert "://" not in html and not re.search(r"""(src|href|action)\s*=\s*["']?//""", html)
    assert re.findall(r"""\b(?:src|href)\s*=\s*["']([^"']*)""", html) == ["data:,"]  # the empty favicon
    assert not re.search(r"@import|url\(", html)
    script = html.split("<script>", 1)[1]
    requested = [u for arg in re.findall(r"fetch\(([^,]*),", script) for u in re.findall(r'"([^"]*)"', arg)]
    # relative: under any mount prefix
    assert sorted(requested) == ["v1/chat/completions", "v1/completions", "v1/models"], requested
    for other in ("XMLHttpRequest", "WebSocket", "EventSource", "sendBeacon", "import("):
        assert other not in script, other
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "localStorage"):
        assert sink not in html, sink  # model text goes in as textContent; the key stays in sessionStorage


def test_the_page_ships_as_package_data():
    # Read as a Python literal (tomllib is 3.11's): the TOML array is a list of double-quoted strings.
    table = re.search(r"\[tool\.setuptools\.package-data\]\s*gpt2x = (\[.*?\])", (ROOT / "pyproject.toml").read_text(), re.S)
    patterns = ast.literal_eval(table.group(1))
    assert any(fnmatch.fnmatch("serve/openai/playground.html", p) for p in patterns), patterns


def open_page(browser, base: str):
    """The page, reached through `/`, its key typed in: the model it names is the served one. Also the list its script
    errors and Content-Security-Policy violations go to (a script refused by the policy would be one)."""
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(f"{base}/")
    assert page.url == f"{base}/playground"
    # Without the key the page says what the server said (its 401 message), and then works once it is given.
    page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
    assert page.text_content("#error") == "missing or wrong API key: send Authorization: Bearer KEY"
    page.fill("#api_key", KEY)
    page.press("#api_key", "Tab")  # the field's change event: the models asked for again, with the key
    page.wait_for_selector("body[data-model='shakespeare']", state="attached", timeout=WAIT_MS)
    assert page.is_hidden("#error")
    return page, errors


def aborts(base: str) -> float:
    """The server's count of choices whose client left (vLLM's finished_reason "abort")."""
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "gpt2x:request_success"
               for s in f.samples if s.name.endswith("_total") and s.labels["finished_reason"] == "abort")


def answer(page, n: int) -> str:
    """The text of the page's `n`-th answer, once it has ended. (Waited for by selectors, which Playwright evaluates in
    its own world: a wait_for_function predicate is an eval, which the page's Content-Security-Policy refuses.)"""
    page.wait_for_selector(f"body[data-answers='{n}']", state="attached", timeout=WAIT_MS)
    return page.locator("#conversation .msg .text").last.text_content()


def test_chat_in_the_browser_streams_gpt2xs_own_tokens(browser, base, reference):
    page, errors = open_page(browser, base)
    system, first, second = "Speak as a king.", "Good morrow, <b>my lord</b>.", "What news from France?"
    page.fill("#system", system)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(TOKENS))
    page.fill("#message", first)
    page.press("#message", "Enter")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    want = generate(reference, [TEMPLATE.render(messages, True, {})], SamplingSettings(greedy=True, max_new_tokens=TOKENS))[0]
    shown = answer(page, 1)
    assert shown == decode(want.tokens) and len(want.tokens) == TOKENS
    assert int(page.get_attribute("body", "data-chunks")) > 1  # streamed: shown piece by piece
    assert page.get_attribute("body", "data-finish") == "length"
    assert page.text_content("#status").startswith(f"length, {TOKENS} tokens")
    # The user's text shown as typed, not parsed as HTML.
    assert page.locator("#conversation b").count() == 0
    assert page.locator("#conversation .msg.user .text").first.text_content() == first

    # The second message continues the conversation (the first answer sent back), sampled at the page's default
    # temperature with a seed: the same tokens as gpt2x's with that seed.
    page.fill("#temperature", "0.8")
    page.fill("#seed", "5")
    page.fill("#message", second)
    page.click("#send")
    messages += [{"role": "assistant", "content": shown}, {"role": "user", "content": second}]
    want = generate(reference, [TEMPLATE.render(messages, True, {})],
                    SamplingSettings(temperature=0.8, seed=5, max_new_tokens=TOKENS))[0]
    assert answer(page, 2) == decode(want.tokens)
    assert page.locator("#conversation .msg").count() == 4 and errors == []
    page.close()


def test_completion_mode_stop_and_errors_in_the_browser(browser, base, reference):
    page, errors = open_page(browser, base)
    page.select_option("#mode", "completion")
    assert page.is_hidden("#system")  # a raw prompt: no system prompt, no template
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(TOKENS))
    page.fill("#no_repeat_ngram_size", "2")
    page.fill("#repetition_penalty", "1.3")
    page.fill("#message", "ROMEO:")
    page.click("#send")
    want = generate(reference, ["ROMEO:"], SamplingSettings(greedy=True, max_new_tokens=TOKENS, no_repeat_ngram_size=2,
                                                            repetition_penalty=1.3))[0]
    assert answer(page, 1) == decode(want.tokens)
    assert page.locator("#conversation .msg.completion .prompt").last.text_content() == "ROMEO:"

    # Stop, once the answer has begun: the stream ends there, the text so far kept (the start of the whole answer).
    page.fill("#max_tokens", "240")
    page.fill("#no_repeat_ngram_size", "")
    page.fill("#repetition_penalty", "")
    whole = decode(generate(reference, ["ROMEO:"], SamplingSettings(greedy=True, max_new_tokens=240))[0].tokens)
    page.fill("#message", "ROMEO:")
    page.click("#send")
    page.wait_for_selector("#conversation .msg:last-child .text:not(:empty)", timeout=WAIT_MS)
    aborted = aborts(base)
    page.click("#stop")
    stopped = answer(page, 2)
    assert page.get_attribute("body", "data-finish") == "stopped"
    assert stopped and whole.startswith(stopped) and len(stopped) < len(whole)
    deadline = time.monotonic() + 10  # the server saw the client leave: the request counted as aborted
    while aborts(base) == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts(base) == aborted + 1
    assert page.is_enabled("#send") and page.is_disabled("#stop")

    # A bad field is the server's 400, its message shown, and the prompt put back to try again.
    page.fill("#temperature", "5")
    page.fill("#message", "JULIET:")
    page.click("#send")
    page.wait_for_selector("body[data-answers='3']", state="attached", timeout=WAIT_MS)
    assert "temperature" in page.text_content("#error")
    assert page.input_value("#message") == "JULIET:" and page.locator("#conversation .msg").count() == 2
    assert errors == []
    page.close()
