"""The command line agrees with itself and with the API: `--json` is a switch that prints JSON on stdout
on every command (`--output PATH` writes the file), one set of sampling defaults (OpenAI's and vLLM's)
for `generate` and the completions API, temperature 0 is greedy everywhere, the draft length is vLLM's
`num_speculative_tokens`, `bench` measures the precisions its provider runs, and the spellings of the
previous release (`--json PATH`, `--draft-tokens`) still work with a one-line deprecation notice."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpt2x.bench import run as bench
from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.cli.app import JSON_PATH_NOTICE, upgrade_args
from gpt2x.errors import UsageError
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.speculative import DraftSettings
from gpt2x.numerics import positions
from gpt2x.runtime.providers import default_precisions
from gpt2x.tokenizer import EOT_ID, encode

from ..helpers import assert_one_line_error, cli, local_service

DRAFT_NOTICE = "--draft-tokens is deprecated; use --num-speculative-tokens"


# ---------------------------------------------------------------- the deprecated spellings, rewritten


@pytest.mark.parametrize("args,expected,notices", [
    # bench, eval, loadtest: the word after --json that is not an option (nor loadtest's URL) was a path
    (["bench", "--json", "b.json"], ["bench", "--output", "b.json"], [JSON_PATH_NOTICE]),
    (["-q", "bench", "--json=b.json", "--repeat", "1"], ["-q", "bench", "--output=b.json", "--repeat", "1"], [JSON_PATH_NOTICE]),
    (["eval", "--tasks", "t", "--json", "r.json"], ["eval", "--tasks", "t", "--output", "r.json"], [JSON_PATH_NOTICE]),
    (["loadtest", "http://h:1", "--json", "lt.json"], ["loadtest", "http://h:1", "--output", "lt.json"], [JSON_PATH_NOTICE]),
    # the switch, as it is now: left alone
    (["bench", "--json"], ["bench", "--json"], []),
    (["bench", "--json", "--plot", "p.png"], ["bench", "--json", "--plot", "p.png"], []),
    (["loadtest", "--json", "http://h:1"], ["loadtest", "--json", "http://h:1"], []),
    (["loadtest", "--json", "localhost:8000/v1"], ["loadtest", "--json", "localhost:8000/v1"], []),
    (["generate", "--json", "hi"], ["generate", "--json", "hi"], []),  # generate's --json always was a switch
    (["bench", "--", "--json", "x"], ["bench", "--", "--json", "x"], []),
    # --draft-tokens, on every command that had it
    (["generate", "hi", "--draft", "ngram", "--draft-tokens", "3"], ["generate", "hi", "--draft", "ngram", "--num-speculative-tokens", "3"],
     [DRAFT_NOTICE]),
    (["serve", "--draft-tokens=6"], ["serve", "--num-speculative-tokens=6"], [DRAFT_NOTICE]),
    (["bench", "--draft-tokens", "2", "--json", "b.json"], ["bench", "--num-speculative-tokens", "2", "--output", "b.json"],
     [DRAFT_NOTICE, JSON_PATH_NOTICE]),
    # no command: nothing to rewrite
    (["--help"], ["--help"], []),
])
def test_old_spellings_are_rewritten_before_parsing(args, expected, notices):
    assert upgrade_args(args) == (expected, notices)


# ---------------------------------------------------------------- --json on stdout, --output to a file


BENCH_ARGS = ("bench", "--backends", "torch", "--precisions", "fp32", "--prompt-len", "4", "--new-tokens", "6", "--repeat", "1")


@pytest.fixture
def quick_bench(monkeypatch, tmp_path):
    """BENCH_ARGS, with perplexity scored on one short line (not what these tests check, nor the bandwidth)."""
    monkeypatch.setattr(bench, "cpu_read_bandwidth", lambda threads: 20e9)
    text = tmp_path / "short.txt"
    text.write_text("ROMEO: But soft, what light through yonder window breaks?")
    return (*BENCH_ARGS, "--text", str(text))


def test_bench_json_prints_json_and_output_writes_it(capsys, tmp_path, quick_bench):
    out_file = tmp_path / "b.json"
    code, out, err = cli(capsys, *quick_bench, "--json", "--output", str(out_file))
    assert code == 0, err
    result = json.loads(out)  # stdout is the JSON alone
    assert result == json.loads(out_file.read_text())
    assert result["settings"]["precisions"] == ["fp32"] and result["settings"]["prompt_len"] == 4
    assert [(p["backend"], p["precision"]) for p in result["parity"]] == [("torch", "fp32")]
    assert "parity vs torch" in err and "deprecated" not in err  # the tables went to stderr

    code, out, err = cli(capsys, "-q", *quick_bench, "--json")
    assert code == 0 and json.loads(out)["settings"]["new_tokens"] == 6 and err == ""  # --quiet: no tables either


def test_bench_old_json_path_still_writes_the_file_with_a_notice(capsys, tmp_path, quick_bench):
    out_file = tmp_path / "old.json"
    code, out, err = cli(capsys, *quick_bench, "--json", str(out_file))
    assert code == 0, err
    assert json.loads(out_file.read_text())["settings"]["repeat"] == 1
    assert "parity vs torch" in out  # without the switch, stdout has the tables, as before
    notices = [line for line in err.splitlines() if "deprecated" in line]
    assert notices == ["warning: --json PATH is deprecated; use --output PATH (--json now prints the JSON on stdout)"]


@pytest.mark.parametrize("command", ["bench", "eval", "loadtest"])
def test_json_and_output_have_one_wording(capsys, command):
    code, out, _ = cli(capsys, command, "--help")
    flat = " ".join(out.replace("│", " ").split())
    assert code == 0 and "--json" in flat and "Machine-readable JSON on stdout." in flat
    assert "Also write the JSON result to this file (atomically: whole or not at all)." in flat


# ---------------------------------------------------------------- one set of sampling defaults, temperature 0


def test_sampling_defaults_are_openais():
    """temperature 1, top-p 1, top-k off: the distribution is the softmax of the logits, unfiltered
    (hand-computed: logits log 1 .. log 60 give probabilities proportional to 1 .. 60)."""
    s = SamplingSettings()
    assert (s.temperature, s.top_p, s.top_k, s.greedy) == (1.0, 1.0, 0, False)
    logits = np.log(np.arange(1, 61, dtype=np.float64))[None]
    np.testing.assert_allclose(Sampler(s).probabilities(logits)[0], np.arange(1, 61) / 1830, rtol=1e-12)


def test_temperature_zero_is_greedy_and_negative_is_refused():
    s = SamplingSettings(temperature=0, seed=1)
    assert s.greedy
    logits = np.array([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 5.0, 4.9]])  # equal maxima: the first, as NumPy
    assert Sampler(s)(logits).tolist() == [1, 0]
    for bad in (-0.5, float("nan")):
        with pytest.raises(UsageError) as e:
            SamplingSettings(temperature=bad)
        assert e.value.option == "temperature"


def api_tokens(client, **body) -> tuple[list[int], str]:
    """The completion's token ids (from logprobs' tokens, each token's own string) and its text."""
    from gpt2x.serve.openai.render import token_text

    ids = {token_text(i): i for i in range(50257)}
    r = client.post("/v1/completions", json={**body, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tokens = [ids[t] for t in choice["logprobs"]["tokens"]]
    if choice["finish_reason"] == "stop" and tokens[-1:] == [EOT_ID]:  # listed last, as vLLM; generate omits it
        tokens = tokens[:-1]
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]  # logprobs change nothing
    assert plain == choice["text"]
    return tokens, choice["text"]


@pytest.fixture(scope="module")
def api_client(export_dir):
    from fastapi.testclient import TestClient

    from gpt2x.serve.openai.routes import local_app

    service = local_service(export_dir)
    with TestClient(local_app(service)) as client:
        yield client
    service.close()


@pytest.mark.parametrize("flags,body,written_out", [
    # no sampling flags or fields: both sides' defaults, which must be OpenAI's
    ((), {}, dict(temperature=1.0, top_k=0, top_p=1.0)),
    (("--temperature", "0.8", "--top-k", "40", "--top-p", "0.9"), dict(temperature=0.8, top_k=40, top_p=0.9),
     dict(temperature=0.8, top_k=40, top_p=0.9)),
])
def test_generate_and_the_api_give_the_same_tokens(capsys, export_dir, reference, api_client, flags, body, written_out):
    """Same prompt, seed and settings: `gpt2x generate --seed S --json` and POST /v1/completions give the
    same token ids, which are those of the settings written out here (OpenAI's defaults by hand)."""
    from gpt2x.generation.generate import generate

    n, seed, prompt = 24, 5, "KING HENRY:"
    code, out, err = cli(capsys, "generate", prompt, "--onnx", str(export_dir), "--threads", "1", "--seed", str(seed),
                         "--max-new-tokens", str(n), "--json", *flags)
    assert code == 0, err
    got = json.loads(out)
    assert got["prompt_tokens"] == encode(prompt)
    ids, text = api_tokens(api_client, prompt=prompt, max_tokens=n, seed=seed, **body)
    assert got["tokens"] == ids and got["text"] == text
    [want] = generate(reference, [prompt], SamplingSettings(max_new_tokens=n, seed=seed, **written_out))
    assert want.tokens == got["tokens"]
    # and the old generate default (top-k 50) is not what ran: the sampled tokens would differ
    if not flags:
        [top50] = generate(reference, [prompt], SamplingSettings(max_new_tokens=n, seed=seed, top_k=50))
        assert top50.tokens != got["tokens"]


def test_temperature_zero_is_greedy_on_the_command_line(capsys, export_dir, reference, api_client):
    """`--temperature 0` gives `--greedy`'s tokens, which are the argmax of each step's logits computed
    here without a cache (a whole-sequence forward per step), and the API's temperature 0 gives them too."""
    args = ("generate", "ROMEO:", "--onnx", str(export_dir), "--threads", "1", "--max-new-tokens", "10", "--json")
    runs = {}
    for name, flags in (("t0", ("--temperature", "0", "--seed", "1")), ("t0b", ("--temperature", "0", "--seed", "2")),
                        ("greedy", ("--greedy",))):
        code, out, err = cli(capsys, *args, *flags)
        assert code == 0, err
        runs[name] = json.loads(out)["tokens"]
    ids = encode("ROMEO:")
    expected = []
    for _ in range(10):
        seq = np.asarray([ids + expected], dtype=np.int64)
        mask = np.ones_like(seq)
        logits = reference.run(seq, mask, positions(mask, seq.shape[1]), None)[0]
        expected.append(int(logits[0, -1].argmax()))
        if expected[-1] == EOT_ID:
            expected.pop()
            break
    assert runs["t0"] == runs["t0b"] == runs["greedy"] == expected
    assert api_tokens(api_client, prompt="ROMEO:", max_tokens=10, temperature=0)[0] == expected

    code, _, err = cli(capsys, "generate", "hi", "--backend", "torch", "--temperature", "-1")
    assert_one_line_error(code, err, UsageError.exit_code, "--temperature must be >= 0 (0: greedy), got -1")


# ---------------------------------------------------------------- num_speculative_tokens


def test_draft_length_is_num_speculative_tokens(capsys):
    """The field, the flag and the error say num_speculative_tokens; --draft-tokens still works (hidden),
    with a one-line notice, and gives the same tokens."""
    assert DraftSettings().num_speculative_tokens == 8 and not hasattr(DraftSettings(), "max_tokens")
    args = ("generate", "ROMEO: ROMEO: ROMEO:", "--backend", "torch", "--greedy", "--max-new-tokens", "12", "--json", "--draft", "ngram",
            "--no-draft-adaptive")
    code, new, err = cli(capsys, *args, "--num-speculative-tokens", "2")
    assert code == 0 and "deprecated" not in err, err
    code, old, err = cli(capsys, *args, "--draft-tokens", "2")
    assert code == 0 and err.splitlines() == [f"warning: {DRAFT_NOTICE}"]
    new, old = json.loads(new), json.loads(old)
    assert new["tokens"] == old["tokens"] and new["speculation"] == old["speculation"]
    spec = new["speculation"]
    assert spec["drafts"] >= 1 and spec["drafted"] <= 2 * spec["drafts"]  # at most K = 2 per verification
    code, _, err = cli(capsys, "generate", "hi", "--backend", "torch", "--draft", "ngram", "--num-speculative-tokens", "0")
    assert_one_line_error(code, err, UsageError.exit_code, "--num-speculative-tokens must be in 1..32, got 0")
    for command in ("generate", "bench", "serve"):
        code, out, _ = cli(capsys, command, "--help")
        assert code == 0 and "--num-speculative-tokens" in out and "--draft-tokens" not in out


# ---------------------------------------------------------------- bench's precisions per provider


def test_bench_precisions_default_to_the_providers_own(capsys, monkeypatch):
    assert default_precisions(ProviderKind.cpu) == [Precision.fp32, Precision.int8]
    assert default_precisions(ProviderKind.cuda) == [Precision.fp32, Precision.fp16]
    assert bench.BenchSettings().precisions == [Precision.fp32, Precision.int8]
    assert bench.BenchSettings(provider=ProviderKind.cuda).precisions == [Precision.fp32, Precision.fp16]
    assert bench.BenchSettings(precisions=[Precision.int4]).precisions == [Precision.int4]
    # on the CPU nothing the defaults name is skipped (fp16 was: "fp16 runs on CUDA only")
    run, skipped = bench.combos(bench.BenchSettings(backends=[BackendKind.ort]))
    assert run == [(BackendKind.ort, Precision.fp32), (BackendKind.ort, Precision.int8)] and skipped == []

    from gpt2x.cli import bench as bench_cli

    seen = []

    def stop(settings, *a, **k):
        seen.append(settings)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_cli, "run_bench", stop)
    cli(capsys, "bench")
    cli(capsys, "bench", "--precisions", "fp32,fp16")
    assert [s.precisions for s in seen] == [[Precision.fp32, Precision.int8], [Precision.fp32, Precision.fp16]]


# ---------------------------------------------------------------- where exports are kept


def test_commands_that_export_say_where_even_quiet(capsys, own_exports, quick_bench, tmp_path, monkeypatch):
    """GPT2X_EXPORTS (here TMP/exported) is where exports made by name go; the command says so on
    stderr, on one line, with --quiet too; --exports DIR names another folder for one command."""
    code, _, err = cli(capsys, "-q", "generate", "hi", "--greedy", "--max-new-tokens", "2")
    assert code == 0, err
    fp32 = own_exports / "shakespeare-fp32"
    assert err.splitlines() == [f"no export at {fp32}: exporting shakespeare (fp32) first"] and (fp32 / "gpt2x.json").is_file()
    args = ["ort" if a == "torch" else a for a in quick_bench]  # the ort backend, on the export just made
    code, out, err = cli(capsys, "-q", *args, "--json")
    assert code == 0 and "no export" not in err and json.loads(out)["speed"], err  # found where it was made
    other = tmp_path / "elsewhere"
    args[args.index("--precisions") + 1] = "int8"
    code, _, err = cli(capsys, "-q", *args, "--exports", str(other), "--json")
    assert code == 0, err
    assert f"no export at {other / 'shakespeare-int8'}: exporting shakespeare (int8) first" in err.splitlines()
    assert (other / "shakespeare-int8" / "gpt2x.json").is_file() and not (own_exports / "shakespeare-int8").exists()
