"""`gpt2x run-batch`: an OpenAI batch file answered offline, in order, a line per request: a completion equal to
gpt2x's own generate() on a second backend, a chat answer in its shape, the API's 400 for a refused request, an
error record for a line that is not a request, and --resume going on after an earlier run's lines (a half-written
last line written again); an existing output without --resume, and an empty input, one line each."""

from __future__ import annotations

import json

from gpt2x.errors import OutputError, UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.tokenizer import decode

from ..helpers import assert_one_line_error, cli

COMPLETION = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "ROMEO:", "max_tokens": 6, "temperature": 0, "ignore_eos": True}}
CHAT = {"custom_id": "b", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Good morrow."}], "max_tokens": 4, "temperature": 0}}
REFUSED = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "temperature": -1}}
WRONG_URL = {"custom_id": "d", "url": "/v1/embeddings", "body": {}}


def write(path, items) -> None:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))


def test_each_line_answered_in_order_as_the_server_answers_it(capsys, tmp_path, export_dir, reference):
    write(tmp_path / "in.jsonl", [COMPLETION, "not json", CHAT, REFUSED, WRONG_URL, {**CHAT}])
    code, out, err = cli(capsys, "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                         "--model", str(export_dir), "--threads", "1")
    assert code == 0, err
    assert out.strip().startswith("2 answered, 1 refused by the API, 3 not requests")
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["a", None, "b", "c", "d", "b"]
    want = generate(reference, ["ROMEO:"], SamplingSettings(max_new_tokens=6, greedy=True, ignore_eos=True))[0]
    first = records[0]["response"]
    assert first["status_code"] == 200 and first["body"]["object"] == "text_completion"
    assert first["body"]["choices"][0]["text"] == decode(want.tokens) and records[0]["error"] is None
    assert records[1]["response"] is None and "not JSON" in records[1]["error"]["message"]
    assert records[2]["response"]["body"]["object"] == "chat.completion"
    refused = records[3]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    assert "url must be one of" in records[4]["error"]["message"]
    assert "repeated" in records[5]["error"]["message"]  # a custom_id twice: the second is not run
    assert len({r["id"] for r in records}) == 6


def test_resume_goes_on_after_an_earlier_runs_lines(capsys, tmp_path, export_dir):
    second = {**COMPLETION, "custom_id": "e", "body": {**COMPLETION["body"], "prompt": "JULIET:"}}
    write(tmp_path / "first.jsonl", [COMPLETION, CHAT])
    out = tmp_path / "out.jsonl"
    assert cli(capsys, "run-batch", "-i", str(tmp_path / "first.jsonl"), "-o", str(out), "--model", str(export_dir))[0] == 0
    kept = out.read_text()
    code, _, err = cli(capsys, "run-batch", "-i", str(tmp_path / "first.jsonl"), "-o", str(out), "--model", str(export_dir))
    assert_one_line_error(code, err, OutputError.exit_code, "pass --resume")
    with open(out, "a") as f:
        f.write('{"id": "batch_req_x", "custom_')  # a run stopped mid-line
    write(tmp_path / "all.jsonl", [COMPLETION, CHAT, second])
    code, stdout, err = cli(capsys, "run-batch", "-i", str(tmp_path / "all.jsonl"), "-o", str(out), "--model",
                            str(export_dir), "--resume")
    assert code == 0, err
    assert "1 answered" in stdout and "2 answered before (--resume)" in stdout
    text = out.read_text()
    assert text.startswith(kept)  # the earlier lines as they were, the half line gone
    assert [json.loads(line)["custom_id"] for line in text.splitlines()] == ["a", "b", "e"]


def test_an_empty_input_is_one_line(capsys, tmp_path):
    (tmp_path / "in.jsonl").write_text("\n\n")
    code, _, err = cli(capsys, "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert_one_line_error(code, err, UsageError.exit_code, "holds no request")
    assert not (tmp_path / "out.jsonl").exists()
