"""The chat playground (`GET /playground`, openai/playground.html): served without the API key, self-contained (no
other origin, a Content-Security-Policy that allows none), and driven in a real headless Chromium (Debian's, through
Playwright, as the web backend's tests drive it) against a real uvicorn server: what the page shows, streamed, is
gpt2x's own generation of the prompt the chat template renders (the conversation, its system prompt and the page's
sampling controls included), in chat and in completion mode; Stop ends a stream; errors are the server's messages;
structured output is gpt2x's constrained generation (a schema that is not JSON is the page's own error, nothing sent);
token probabilities are the server's logprobs, one span per token."""

from __future__ import annotations

import ast
import fnmatch
import json
import math
import re
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gpt2x.generation.constraints import ConstraintSpec
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.interop import DEFAULT_CHAT_TEMPLATE
from gpt2x.serve.openai.chat_completion.template import ChatTemplate
from gpt2x.serve.openai.routes import local_app
from gpt2x.tokenizer import decode

from ..helpers import local_service, uvicorn_server

ROOT = Path(__file__).resolve().parents[2]
KEY = "playground-key"
TOKENS = 12
TEMPLATE = ChatTemplate(DEFAULT_CHAT_TEMPLATE, "test")  # gpt2x's default: the system prompt is a turn of its own
WAIT_MS = 20_000
MOOD = {"type": "object", "properties": {"king": {"type": "boolean"}, "mood": {"enum": ["merry", "sad", "wroth"]}},
        "required": ["king", "mood"], "additionalProperties": False}
NAMED = r"(ROMEO|JULIET|TYBALT) is [a-z]+\."  # a regex the answer ends at: then end of text, listed last


@pytest.fixture(scope="module")
def service(export_dir):
    s = local_service(export_dir, chat_template=TEMPLATE)
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


def test_completion_mode_stop_and_errors_in_the_browser(browser, base, reference, service, monkeypatch):
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
    aborted = aborts(base)
    # Each step 5 ms longer for this answer: its 240 tokens then take over a second, so the click lands while the server
    # still generates (on a loaded machine the whole answer was out before the page showed its first text: no abort).
    for name in ("step", "step_greedy"):
        method = getattr(service.backend, name)
        monkeypatch.setattr(service.backend, name, lambda *a, method=method, **k: (time.sleep(0.005), method(*a, **k))[1])
    # Stop clicked in the page as soon as this answer's first text shows: from here, a click could come after the whole
    # answer (240 tokens of the bundled model stream in well under a second).
    page.evaluate("""() => {
        const stop = document.querySelector("#stop");
        const seen = new MutationObserver(() => {
            const text = document.querySelector("#conversation .msg:last-child .text");
            if (!stop.disabled && text && text.textContent) { seen.disconnect(); stop.click(); }
        });
        seen.observe(document.querySelector("#conversation"), {subtree: true, childList: true, characterData: true});
    }""")
    page.click("#send")
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


def test_structured_output_in_the_browser_is_gpt2xs_constrained_generation(browser, base, reference):
    page, errors = open_page(browser, base)
    sent: list = []
    page.on("request", lambda r: sent.append(r) if "/v1/" in r.url and r.method == "POST" else None)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "32")
    page.click("#structured_box summary")
    page.select_option("#structured", "json_schema")
    assert page.is_visible("#schema") and page.is_hidden("#regex") and page.is_hidden("#choices")

    # A schema that is not JSON: the page says so beside it and sends nothing; the message stays to send again.
    question = "Is the king merry?"
    page.fill("#schema", json.dumps(MOOD)[:-1])
    page.fill("#message", question)
    page.click("#send")
    page.wait_for_selector("#structured_error:not([hidden])", timeout=WAIT_MS)
    assert page.text_content("#structured_error").startswith("the JSON schema is not JSON: ")
    assert page.input_value("#message") == question and page.locator("#conversation .msg").count() == 0
    assert page.is_hidden("#error") and page.get_attribute("body", "data-answers") == "0"
    page.fill("#schema", "[1]")  # JSON, but no schema
    page.click("#send")
    page.wait_for_selector("#structured_error:text('a JSON schema is an object (or true or false)')", timeout=WAIT_MS)
    assert sent == []

    # The schema fixed: the answer is gpt2x's greedy generation under that schema, and JSON valid against it.
    page.fill("#schema", json.dumps(MOOD, indent=2))
    page.click("#send")
    shown = answer(page, 1)
    assert page.is_hidden("#structured_error")
    want = generate(reference, [TEMPLATE.render([{"role": "user", "content": question}], True, {})],
                    SamplingSettings(greedy=True, max_new_tokens=32, constraint=ConstraintSpec.json_schema(MOOD)))[0]
    assert shown == decode(want.tokens) and len(want.tokens) < 32
    jsonschema.validate(json.loads(shown), MOOD)
    assert page.get_attribute("body", "data-finish") == "stop"
    assert sent[-1].post_data_json["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": MOOD}}

    # A list of choices, as vLLM's structured_outputs: the answer is one of them.
    page.select_option("#structured", "choice")
    page.fill("#choices", "ROMEO\nJULIET\n")
    page.fill("#message", "Who loves?")
    page.click("#send")
    assert answer(page, 2) in ("ROMEO", "JULIET")
    assert sent[-1].post_data_json["structured_outputs"] == {"choice": ["ROMEO", "JULIET"]}
    assert "response_format" not in sent[-1].post_data_json and len(sent) == 2 and errors == []
    page.close()


def shown_percent(title: str) -> float:
    """The probability a token's title shows first (its own), in percent."""
    return float(re.fullmatch(r'".*" (\S+)%', title.split("\n")[0], re.S).group(1))


def check_tokens(page, tokens: list[str], logprobs: list[float], shown: str) -> None:
    """The last answer's spans: one per token, their texts the answer, each titled with exp(its logprob) in percent
    (to 0.1 percentage point) and shaded when unlikely."""
    spans = page.locator("#conversation .msg").last.locator(".tok")
    assert spans.count() == len(tokens) == int(page.get_attribute("body", "data-tokens"))
    assert "".join(spans.all_text_contents()) == shown
    for i, lp in enumerate(logprobs):
        span = spans.nth(i)
        assert shown_percent(span.get_attribute("title")) == pytest.approx(100 * math.exp(lp), abs=0.1), i
        assert ("low" in span.get_attribute("class").split()) == (math.exp(lp) < 0.1), i


def test_token_probabilities_in_the_browser_are_the_servers(browser, base):
    page, errors = open_page(browser, base)
    auth = {"Authorization": f"Bearer {KEY}"}
    page.check("#logprobs")
    page.fill("#temperature", "0")

    # Completion mode, a regex: each token of the answer a span with the server's probability for it, and last the
    # end of text (no text of its own, its probability shown all the same).
    page.select_option("#mode", "completion")
    page.fill("#max_tokens", "16")
    page.click("#structured_box summary")
    page.select_option("#structured", "regex")
    page.fill("#regex", NAMED)
    page.fill("#message", "ROMEO:")
    page.click("#send")
    shown = answer(page, 1)
    whole = httpx.post(f"{base}/v1/completions", headers=auth, timeout=30, json={
        "prompt": "ROMEO:", "max_tokens": 16, "temperature": 0, "logprobs": 5, "structured_outputs": {"regex": NAMED}}).json()
    got = whole["choices"][0]
    assert shown == got["text"] and re.fullmatch(NAMED, shown) and got["finish_reason"] == "stop"
    check_tokens(page, got["logprobs"]["tokens"], got["logprobs"]["token_logprobs"], shown)
    assert page.locator("#conversation .msg").last.locator(".tok.end").count() == 1
    assert page.locator("#conversation .msg").last.locator(".tok").last.text_content() == ""

    # Chat: the same, in chat's shape; a click shows a token's alternatives, most likely first.
    page.select_option("#mode", "chat")
    page.select_option("#structured", "none")
    page.fill("#max_tokens", str(TOKENS))
    page.fill("#message", "Good morrow.")
    page.click("#send")
    shown = answer(page, 2)
    whole = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=30, json={
        "messages": [{"role": "user", "content": "Good morrow."}], "max_tokens": TOKENS, "temperature": 0,
        "logprobs": True, "top_logprobs": 5}).json()
    got = whole["choices"][0]
    content = got["logprobs"]["content"]
    assert shown == got["message"]["content"] and len(content) == TOKENS
    check_tokens(page, [t["token"] for t in content], [t["logprob"] for t in content], shown)
    assert int(page.get_attribute("body", "data-chunks")) > 1  # still streamed
    page.locator("#conversation .msg").last.locator(".tok").nth(1).click()
    assert page.is_visible("#token_info")
    rows = page.locator("#token_top tr")
    assert rows.count() == len(content[1]["top_logprobs"]) == 5
    for row, top in zip(rows.all(), content[1]["top_logprobs"]):
        name, p = row.locator("td").all_text_contents()
        assert json.loads(name) == top["token"]
        assert float(p.rstrip("%")) == pytest.approx(100 * math.exp(top["logprob"]), abs=0.1)
    page.click("#token_close")
    assert page.is_hidden("#token_info") and errors == []
    page.close()
