"""The command line as a user meets it: results on stdout, one-line errors with their exit codes."""

from __future__ import annotations

import json

import pytest
import typer

from gpt2x.errors import HubError, ModelNotFoundError, UsageError
from gpt2x.onnx.artifact import EXPORTS_ENV

from ..helpers import assert_one_line_error, cli, run_cli


@pytest.mark.parametrize("command", ["generate", "export", "verify", "inspect", "train", "bench", "info", "serve", "loadtest",
                                     "run-batch"])
def test_every_command_has_help_with_examples(capsys, command):
    code, out, _ = cli(capsys, command, "--help")
    assert code == 0 and "Example" in out


@pytest.mark.parametrize("command", ["generate", "export", "bench", "serve", "loadtest"])
def test_help_shows_switches_as_switches(command):
    """A switch takes no value: --help shows none (Typer labelled each `<bool>`)."""
    r = run_cli(command, "--help", env={"COLUMNS": "100"})
    assert r.returncode == 0 and "--json" in r.stdout and "<bool>" not in r.stdout


def test_generate_help_puts_the_common_options_first_and_the_rest_in_panels():
    """At 100 columns: after the prompt, the options a user reaches for first (--max-new-tokens, --temperature,
    --seed) in the first panel; the sampling controls, structured output, beam search, speculative decoding and the
    runtime's options each in a panel of its own, after it."""
    r = run_cli("generate", "--help", env={"COLUMNS": "100"})
    assert r.returncode == 0
    text = r.stdout
    panels = ["Options", "Sampling controls", "Structured output", "Beam search", "Speculative decoding",
              "Backend, export and runtime"]
    at = [text.index(f"─ {name} ─") for name in panels]
    assert at[0] == min(at)
    first = text[at[0]:min(a for a in at if a > at[0])]
    assert all(opt in first for opt in ("--max-new-tokens", "--temperature", "--top-p", "--seed", "--greedy", "--model"))
    assert "--min-p" not in first and "--prefill" not in first and "--json-schema" not in first


def test_info_names_the_exports_folder_the_commands_use(capsys, monkeypatch, tmp_path):
    """GPT2X_EXPORTS where set, else the user's cache (XDG_CACHE_HOME's): not the working directory's ./exported."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "mine"))
    code, out, _ = cli(capsys, "info", "--json")
    assert code == 0 and json.loads(out)["exports"] == str(tmp_path / "mine")
    monkeypatch.delenv(EXPORTS_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out, _ = cli(capsys, "info", "--json")
    assert code == 0 and json.loads(out)["exports"] == str(tmp_path / "cache" / "gpt2x" / "exported")


def test_generate_json_and_seed(capsys):
    args = ["generate", "ROMEO:", "--backend", "torch", "--max-new-tokens", "12", "--seed", "3", "--json"]
    code, out, _ = cli(capsys, *args)
    assert code == 0
    first = json.loads(out)
    assert first["prompt_tokens"] and first["seed"] == 3
    # 12 tokens, unless <|endoftext|> came first (then fewer, and said so)
    assert (len(first["tokens"]), first["finish_reason"]) == (12, "length") or \
        (len(first["tokens"]) < 12 and first["finish_reason"] == "eos")
    from gpt2x.tokenizer import decode, encode

    assert first["prompt_tokens"] == encode("ROMEO:") and first["text"] == decode(first["tokens"])
    assert json.loads(cli(capsys, *args)[1]) == first  # same seed, same text


def test_generate_runs_the_fp32_twin_by_default_with_the_tokens_of_the_growing_cache(capsys, monkeypatch):
    """By default (and with --kv-cache in-place) the fp32 export runs as its GroupQueryAttention twin (made once per
    run), with the greedy tokens of the export as it is (--kv-cache growing: no twin); a backend with a cache of its own
    refuses the option in one line."""
    from gpt2x.onnx import optimize  # where the ort backend takes it from, as it opens a session

    monkeypatch.setenv("GPT2X_GRAPHS", "off")  # the twin rewritten by each run, not read back (tests/onnx/test_wire.py)
    args = ["generate", "ROMEO:", "--max-new-tokens", "12", "--greedy", "--json"]
    assert cli(capsys, *args, "--max-new-tokens", "1")[0] == 0  # the export made first, where missing (its gate runs a twin)
    made, real = [], optimize.in_place_form
    monkeypatch.setattr(optimize, "in_place_form", lambda path: made.append(path) or real(path))
    code, out, _ = cli(capsys, *args, "--kv-cache", "growing")
    assert code == 0 and made == []
    code, twin, _ = cli(capsys, *args)
    assert code == 0 and len(made) == 1
    assert json.loads(twin)["tokens"] == json.loads(out)["tokens"]
    code, asked, _ = cli(capsys, *args, "--kv-cache", "in-place")
    assert code == 0 and len(made) == 2 and json.loads(asked)["tokens"] == json.loads(out)["tokens"]
    code, _, err = cli(capsys, "generate", "ROMEO:", "--backend", "openvino", "--kv-cache", "in-place")
    assert_one_line_error(code, err, UsageError.exit_code, "--kv-cache in-place applies to the ort backend")
    # The fixed-capacity cache (CUDA's default decoder, asked for here): the same tokens, and it says it ran there.
    code, fixed, _ = cli(capsys, *args, "--kv-cache", "fixed")
    assert code == 0 and json.loads(fixed)["tokens"] == json.loads(out)["tokens"]
    assert json.loads(fixed)["decoder"] == "fixed cache" and "decoder" not in json.loads(out)
    code, shown, err = cli(capsys, "generate", "ROMEO:", "--kv-cache", "fixed", "--top-p", "0.5")
    assert_one_line_error(code, err, UsageError.exit_code, "--kv-cache fixed: the device sampler takes a temperature only")
    assert shown == ""  # refused before the prompt is echoed
    for command in ("serve", "bench"):
        code, _, err = cli(capsys, command, "--kv-cache", "fixed")
        assert_one_line_error(code, err, UsageError.exit_code, "--kv-cache fixed is gpt2x generate's")


def test_generate_streams_prompt_and_text(capsys):
    code, out, _ = cli(capsys, "generate", "ROMEO:", "--backend", "torch", "--max-new-tokens", "5", "--greedy")
    from gpt2x.generation.generate import generate
    from gpt2x.generation.settings import SamplingSettings
    from gpt2x.model.weights import load_model
    from gpt2x.runtime.pytorch import TorchBackend
    from gpt2x.tokenizer import decode

    [want] = generate(TorchBackend(load_model("shakespeare")[0]), ["ROMEO:"], SamplingSettings(max_new_tokens=5, greedy=True))
    assert len(want.tokens) == 5
    assert code == 0 and out == "ROMEO:" + decode(want.tokens) + "\n"


def test_prompts_file_batch(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("ROMEO:\n\nJULIET:\nO\n", encoding="utf-8")
    code, out, _ = cli(capsys, "generate", "--prompts-file", str(f), "--backend", "torch", "--greedy",
                       "--max-new-tokens", "6", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["prompt"] for r in rows] == ["ROMEO:", "JULIET:", "O"]


@pytest.mark.parametrize("content,fragment", [(None, "not found"), (b"\n  \n", "no prompts"), (b"\xff\xfe\x00bad", "not UTF-8")])
def test_bad_prompts_file(capsys, tmp_path, content, fragment):
    f = tmp_path / "p.txt"
    if content is not None:
        f.write_bytes(content)
    code, _, err = cli(capsys, "generate", "--prompts-file", str(f), "--backend", "torch")
    assert_one_line_error(code, err, UsageError.exit_code, fragment)


@pytest.mark.parametrize("args,fragment", [
    (["--temperature", "-0.5"], "--temperature must be >= 0"),  # 0 is greedy (tests/test_cli_agreement.py)
    (["--top-p", "1.5"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--num-beams", "0"], "--num-beams"),
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
    (["--min-tokens", "65"], "--min-tokens must be at most max_new_tokens (64)"),
    (["--n", "0"], "--n must be at least 1"),
    (["--logit-bias", "198"], "--logit-bias: '198' is not TOKEN_ID=BIAS"),
    (["--logit-bias", "198=x"], "--logit-bias: '198=x' is not TOKEN_ID=BIAS"),
    (["--logit-bias", "198=101"], "--logit-bias must hold biases in [-100, 100]"),
    (["--logit-bias", "50257=1"], "--logit-bias must hold token ids in [0, 50257)"),
    (["--stop-token-ids", "13,x"], "--stop-token-ids: '13,x' is not a comma-separated list of integers"),
    (["--num-beams", "2", "--repetition-penalty", "1.2"], "--num-beams is 2: beam search takes none of repetition_penalty"),
])
def test_bad_sampling_values(capsys, args, fragment):
    code, _, err = cli(capsys, "generate", "hi", "--backend", "torch", *args)
    assert_one_line_error(code, err, UsageError.exit_code, fragment)


def test_generate_sampling_flags_reach_the_processors(capsys):
    """Every processor flag (repeatable and comma lists alike) gives generate()'s tokens for the same
    settings, which differ from those without them; --n samples are seeded seed + i."""
    from dataclasses import replace

    from gpt2x.generation.generate import generate
    from gpt2x.generation.settings import SamplingSettings
    from gpt2x.model.weights import load_model
    from gpt2x.runtime.pytorch import TorchBackend

    backend = TorchBackend(load_model("shakespeare")[0])
    args = ["generate", "ROMEO:", "--backend", "torch", "--max-new-tokens", "12", "--json"]
    flags = ["--presence-penalty", "0.5", "--frequency-penalty", "0.3", "--repetition-penalty", "1.3", "--logit-bias",
             "198=-100", "--logit-bias", "11=2.5,13=-1", "--min-p", "0.05", "--min-tokens", "3", "--ignore-eos"]
    settings = SamplingSettings(max_new_tokens=12, seed=3, presence_penalty=0.5, frequency_penalty=0.3,
                                repetition_penalty=1.3, logit_bias={198: -100, 11: 2.5, 13: -1.0}, min_p=0.05,
                                min_tokens=3, ignore_eos=True)
    code, out, _ = cli(capsys, *args, "--seed", "3", *flags)
    assert code == 0
    got = json.loads(out)
    assert got["tokens"] == generate(backend, ["ROMEO:"], settings)[0].tokens
    assert got["tokens"] != json.loads(cli(capsys, *args, "--seed", "3")[1])["tokens"] and 198 not in got["tokens"]
    code, out, _ = cli(capsys, *args, "--seed", "3", "--greedy", *flags)
    assert json.loads(out)["tokens"] == generate(backend, ["ROMEO:"], replace(settings, greedy=True))[0].tokens
    code, out, _ = cli(capsys, *args, "--seed", "4", "--num-return-sequences", "3", "--top-k", "20")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [(r["sample"], r["seed"]) for r in rows] == [(0, 4), (1, 5), (2, 6)]
    for r in rows:
        assert r["tokens"] == generate(backend, ["ROMEO:"], SamplingSettings(max_new_tokens=12, top_k=20, seed=r["seed"]))[0].tokens
    greedy = generate(backend, ["ROMEO:"], SamplingSettings(max_new_tokens=12, greedy=True))[0].tokens
    code, out, _ = cli(capsys, *args, "--greedy", "--stop-token-ids", f"{greedy[4]},50000")
    r = json.loads(out)
    assert (r["tokens"], r["finish_reason"]) == (greedy[: greedy.index(greedy[4])], "stop")


def test_prompt_longer_than_context(capsys):
    code, _, err = cli(capsys, "generate", "to be or not " * 100, "--backend", "torch")
    assert_one_line_error(code, err, UsageError.exit_code, "context")
    code, out, _ = cli(capsys, "generate", "to be or not " * 100, "--backend", "torch", "--truncate",
                       "--max-new-tokens", "4", "--json")
    assert code == 0 and len(json.loads(out)["prompt_tokens"]) == 256 - 4


def test_unknown_local_path(capsys):
    code, _, err = cli(capsys, "generate", "hi", "--backend", "torch", "--model", "./no/such/model")
    assert_one_line_error(code, err, ModelNotFoundError.exit_code, "no such file")


def test_inspect_json_total(capsys):
    code, out, _ = cli(capsys, "inspect", "gpt2", "--json", "--seq-len", "5")
    d = json.loads(out)
    assert code == 0 and d["total_params"] == 124_439_808
    assert d["activations"][-1]["shape"] == [5, 50257]


def test_subprocess_offline_hub_error_and_debug_traceback(tmp_path):
    """A hub model neither cached nor reachable: one line, before PyTorch is imported (the whole command then took 1
    s, not 5), and no export folder left; with GPT2X_DEBUG, the traceback."""
    env = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "GPT2X_EXPORTS": str(tmp_path / "exported")}
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "torch.py").write_text("raise ImportError('torch imported')\n", encoding="utf-8")
    r = run_cli("generate", "Hello", "--model", "gpt2", env={**env, "PYTHONPATH": str(blocked)})
    notice, error = r.stderr.strip().splitlines()  # the export it was about to make, then why it cannot
    assert notice.startswith("no export at ") and notice.endswith("exporting gpt2 (fp32) first")
    assert_one_line_error(r.returncode, error, HubError.exit_code, "bundled model 'shakespeare'")
    assert not (tmp_path / "exported" / "gpt2-fp32").exists()
    r = run_cli("generate", "Hello", "--model", "gpt2", env={**env, "GPT2X_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_subprocess_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("gpt2x ")


@pytest.mark.parametrize("args,error,fragment", [
    (["--backend", "openvino", "--provider", "cuda"], "ProviderError", "OpenVINO has no CUDA device"),
    (["--backend", "ort", "--precision", "fp16"], "ProviderError", "fp16 runs on CUDA only"),
    (["--backend", "genai", "--precision", "fp16"], "ProviderError", "fp16 runs on CUDA only"),
    (["--backend", "torch", "--precision", "int4"], "UsageError", "run by the ort, openvino, genai and web backends"),
    (["--backend", "torch", "--onnx", "exported/x"], "UsageError", "the ort, openvino, genai and web backends run"),
])
def test_combinations_that_cannot_run_are_refused_before_any_work(capsys, monkeypatch, tmp_path, args, error, fragment):
    """Refused at once: no export is made first (the export folder stays absent), whatever the model."""
    from gpt2x import errors

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    code, out, err = cli(capsys, "generate", "hi", "--model", "random:gpt2", *args)
    assert_one_line_error(code, err, getattr(errors, error).exit_code, fragment)
    assert out == "" and not (tmp_path / "exported").exists()


def test_unknown_provider_is_a_usage_error(capsys):
    code, _, err = cli(capsys, "generate", "hi", "--provider", "tpu")
    assert code == 2 and "tpu" in err and "Traceback" not in err


def test_bench_cuda_without_gpu_and_ctrl_c(capsys, monkeypatch, tmp_path):
    from gpt2x.cli import bench
    from gpt2x.errors import INTERRUPTED_EXIT_CODE, ProviderError
    from gpt2x.runtime.providers import available_providers

    if available_providers()["loadable"]["cuda"] != "ok":
        code, _, err = cli(capsys, "bench", "--provider", "cuda")
        assert_one_line_error(code, err, ProviderError.exit_code, "CUDAExecutionProvider")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_bench", interrupted)
    out_json = tmp_path / "b.json"
    code, _, err = cli(capsys, "bench", "--output", str(out_json))
    assert code == INTERRUPTED_EXIT_CODE and "interrupted" in err and not out_json.exists()


def test_an_option_given_is_told_from_its_default_in_typers_own_context():
    """cli.options.given_by_user on a real Typer context (Typer vendors click: click's own ParameterSource compared
    equal to nothing, and `serve --from-bench` took the result's backend over the one given)."""
    from typer.testing import CliRunner

    from gpt2x.cli.options import given_by_user

    app = typer.Typer()
    seen: dict = {}

    @app.command()
    def command(ctx: typer.Context, a: int = 1, b: int = 2) -> None:
        seen.update(a=given_by_user(ctx, "a"), b=given_by_user(ctx, "b"))

    assert CliRunner().invoke(app, ["--a", "3"]).exit_code == 0
    assert seen == {"a": True, "b": False}
