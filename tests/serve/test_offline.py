"""The offline Python API (serve/offline.py): `from gpt2x import LLM, SamplingParams`, the serving engine in this
process, checked against gpt2x's own generate() on a second backend (greedy and seeded, n choices), chat against the
completion of the text the template renders, bad parameters refused before anything runs, and the docs page's
example run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpt2x import LLM, SamplingParams
from gpt2x.errors import UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.tokenizer import decode, encode

PROMPTS = ["ROMEO:", "JULIET: O Romeo,", "First Citizen:\nBefore we proceed"]


@pytest.fixture(scope="module")
def llm(export_dir):
    with LLM(str(export_dir), threads=1, max_batch_size=4) as model:
        yield model


def test_generate_gives_what_generate_gives_greedy_and_seeded_with_n(llm, reference):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, greedy):
        want = generate(reference, [prompt], SamplingSettings(max_new_tokens=8, greedy=True, ignore_eos=True))[0]
        assert out.prompt == prompt and out.prompt_token_ids == encode(prompt)
        assert out.outputs[0].token_ids == want.tokens and out.outputs[0].text == decode(want.tokens)
        assert out.outputs[0].finish_reason == "length"
    [sampled] = llm.generate("ROMEO:", SamplingParams(max_tokens=6, n=2, seed=7, ignore_eos=True, logprobs=2))
    for i, choice in enumerate(sampled.outputs):  # choice i seeded seed + i (vLLM's rule)
        want = generate(reference, ["ROMEO:"], SamplingSettings(max_new_tokens=6, seed=7 + i, ignore_eos=True))[0]
        assert choice.index == i and choice.token_ids == want.tokens
        assert len(choice.logprobs) == 6 and all(len(top) >= 2 for top in choice.logprobs)


def test_chat_completes_the_text_the_template_renders(llm, reference):
    messages = [{"role": "user", "content": "Good morrow, my lord."}]
    [out] = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    rendered = "USER:\nGood morrow, my lord.\n\nASSISTANT:\n"  # the bundled export's template, by hand
    want = generate(reference, [rendered], SamplingSettings(max_new_tokens=6, greedy=True, ignore_eos=True))[0]
    assert out.prompt == rendered and out.outputs[0].token_ids == want.tokens


def test_bad_parameters_are_one_usage_error_before_anything_runs(llm):
    before = llm.service.engine.stats()["rows"]
    with pytest.raises(UsageError, match="temperature"):
        llm.generate(["a", "b"], SamplingParams(temperature=-1))
    with pytest.raises(UsageError, match="top_p"):
        llm.generate(["a"], SamplingParams(top_p=0))
    assert llm.service.engine.stats()["rows"] == before  # nothing ran


def test_a_long_list_shows_a_progress_bar_on_stderr(llm, capfd):
    outs = llm.generate(["ROMEO:"] * 16, SamplingParams(max_tokens=2, temperature=0))
    assert len(outs) == 16 and len({o.outputs[0].text for o in outs}) == 1
    err = capfd.readouterr().err
    assert "16/16" in err and "Traceback" not in err


def test_a_rows_end_told_after_its_answer_is_delivered_quietly(llm, caplog, monkeypatch):
    """The engine tells a row's Finished after the token that completed its answer; held back here until the call
    has returned, it still reaches an open event loop (the LLM's own): a loop closed per call (asyncio.run) refused
    it, and the engine logged "a row's callback failed" with a traceback for every such row."""
    import threading
    import time

    from gpt2x.serve.core import engine as engine_module
    from gpt2x.serve.core.outputs import Finished

    real, told = engine_module.Engine._tell, threading.Event()

    def late(self, row, out):
        if isinstance(out, Finished):
            time.sleep(0.3)  # the call has returned by now
        real(self, row, out)
        if isinstance(out, Finished):
            told.set()

    monkeypatch.setattr(engine_module.Engine, "_tell", late)
    llm.generate("ROMEO:", SamplingParams(max_tokens=3, temperature=0))
    assert told.wait(5)
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]


def test_the_docs_example_runs_as_written(export_dir, monkeypatch):
    """docs/python.md's example, executed: it prints what it says."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    monkeypatch.setenv("GPT2X_EXPORTS", str(export_dir.parent))
    namespace: dict = {}
    exec(compile(code, "docs/python.md", "exec"), namespace)  # noqa: S102  (the page's own example)
    assert namespace["outputs"][0].outputs[0].text


def test_chat_hands_the_tools_to_the_template_and_a_named_call_is_its_arguments(llm):
    import jsonschema

    weather = {"type": "object", "properties": {"city": {"enum": ["Verona", "Mantua"]}}, "required": ["city"],
               "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "locate", "parameters": weather}}]
    messages = [{"role": "user", "content": "Where art thou?"}]
    [plain] = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0), tools=tools)  # tool_choice none: text
    [alone] = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0))
    assert plain.outputs[0].token_ids == alone.outputs[0].token_ids  # the bundled template writes no tools
    [called] = llm.chat(messages, SamplingParams(max_tokens=40, seed=2), tools=tools,
                        tool_choice={"type": "function", "function": {"name": "locate"}})
    jsonschema.validate(json.loads(called.outputs[0].text), weather)
    with pytest.raises(UsageError, match="tool_choice"):
        llm.chat(messages, tools=tools, tool_choice="auto")
