"""lm-evaluation-harness on gpt2x (gpt2x.lmeval, gpt2x.evaluate.harness, `gpt2x eval`), checked against
lm-eval's own Hugging Face model (transformers' GPT2LMHeadModel on the same weights, the same GPT-2
tokenizer), against gpt2x's perplexity and a hand computation of rolling windows, and against gpt2x's
own greedy generation. The tasks are tests/data/lm_eval_tasks (offline: their data is local JSONL).

Exports go to tmp folders (never the repository's exported/)."""

from __future__ import annotations

import json
import math
import os
import shutil

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read by `datasets` when first imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gpt2x.choices import BackendKind, Precision  # noqa: E402
from gpt2x.errors import HubError, MissingDependencyError, UsageError  # noqa: E402
from gpt2x.evaluate import harness, metrics  # noqa: E402
from gpt2x.generation.generate import generate  # noqa: E402
from gpt2x.generation.settings import SamplingSettings  # noqa: E402
from gpt2x.lmeval import Gpt2xLM  # noqa: E402
from gpt2x.lmeval.model import sampling_from  # noqa: E402
from gpt2x.lmeval.run import task_manager  # noqa: E402
from gpt2x.model.weights import load_model  # noqa: E402
from gpt2x.numerics import log_softmax, positions  # noqa: E402
from gpt2x.onnx.artifact import EXPORTS_ENV
from gpt2x.runtime.pytorch import TorchBackend  # noqa: E402
from gpt2x.tokenizer import EOT_ID, bpe_file, decode, encode  # noqa: E402
from gpt2x.workflows.backends import export_backend  # noqa: E402

from ..helpers import (  # noqa: E402  # noqa: E402
    REPO,
    assert_one_line_error,
    cli,
    make_hf_model,
    run_gpt2x,  # noqa: E402
)

TASKS = REPO / "tests" / "data" / "lm_eval_tasks"
MC = "gpt2x_shakespeare_mc"
PPL = "gpt2x_shakespeare_ppl"
# Per-request log-likelihoods (nats, a continuation's summed token log-probs) of two fp32 runs of the
# same weights: transformers' model takes log_softmax in float32, gpt2x in float64 from float32 logits,
# and ONNX Runtime's and OpenVINO's fused kernels add ~1e-6 relative. Measured on the whole MC task
# (log-likelihoods up to 132 nats): 1.5e-4 between lm-eval's hf model and gpt2x on torch, ort, openvino
# or genai, 1e-5 between gpt2x's backends. 1e-3 leaves a 7x margin, while a scoring bug (an off-by-one
# position, a dropped token, truncation on the wrong side, padding read as context) moves a request by a
# whole token's log-prob, 0.1 nat or more.
FP32_LOGPROB_ATOL = 1e-3
# int8/int4 exports score with quantized weights: their log-likelihoods are not fp32's. Bound: the mean
# |difference| per scored token against fp32 (gpt2x's parity gates bound the logits; this bounds what a
# task sees). Measured on the whole MC task: int8 0.004-0.0045, int4 0.013 nat per token, on ort,
# openvino and genai alike; the bounds leave about 4x.
QUANT_MEAN_ABS_PER_TOKEN = {Precision.int8: 0.02, Precision.int4: 0.05}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """transformers' GPT-2 tokenizer from the BPE files gpt2x ships (vocab.json and merges.txt are them)."""
    from transformers import GPT2TokenizerFast

    folder = tmp_path_factory.mktemp("gpt2-tokenizer")
    shutil.copy(bpe_file("encoder.json"), folder / "vocab.json")
    shutil.copy(bpe_file("vocab.bpe"), folder / "merges.txt")
    return GPT2TokenizerFast.from_pretrained(str(folder))


def hf_lm(model, tokenizer):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=8, device="cpu")


@pytest.fixture(scope="module")
def shakespeare():
    return load_model("shakespeare")


@pytest.fixture(scope="module")
def torch_backend(shakespeare):
    return TorchBackend(shakespeare[0], model_name="shakespeare")


@pytest.fixture(scope="module")
def exports(bundled_export):
    """The bundled model's exports (the run's shared ones, each made once through its parity gate)."""
    return bundled_export


@pytest.fixture(scope="module")
def hf_shakespeare(hf_tokenizer):
    """lm-eval's `hf` model on the bundled weights, in float32 (they are stored in float16; transformers
    would otherwise compute in the stored type)."""
    from transformers import GPT2LMHeadModel

    return hf_lm(GPT2LMHeadModel.from_pretrained(REPO / "gpt2x" / "data" / "shakespeare", dtype=torch.float32), hf_tokenizer)


MC_LIMIT = 16  # documents (4 requests each) of the multiple-choice task in the comparisons


def run_task(lm, manager, task: str, limit: int | None):
    """simple_evaluate's metrics for `task` and each document's responses (by doc_id)."""
    result = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True)
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return result["results"][task], [[r[0] for r in s["resps"]] for s in samples]


@pytest.fixture(scope="module")
def hf_mc(hf_shakespeare, manager):
    return run_task(hf_shakespeare, manager, MC, MC_LIMIT)


def instances(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]


# ---------------------------------------------------------------- the harness in NumPy


def test_batches_go_longest_first_within_rows_and_token_slots():
    lengths = [3, 10, 7, 10, 1, 5]
    assert harness.batches(lengths, batch_size=2, max_tokens=100) == [[1, 3], [2, 5], [0, 4]]
    # 3 rows of 10 slots exceed 25 slots: the batch closes at 2 rows; a row longer than the budget runs alone
    assert harness.batches(lengths, batch_size=8, max_tokens=25) == [[1, 3], [2, 5, 0], [4]]
    assert harness.batches([40, 2], batch_size=8, max_tokens=25) == [[0], [1]]


class Uniform:
    """A backend whose every distribution is uniform over `vocab` tokens; it records the batches it runs."""

    name, n_positions, vocab_size = "uniform", 16, 10

    def __init__(self):
        self.shapes = []

    def run(self, ids, mask, pos, past):
        assert past is None and pos.shape == ids.shape
        self.shapes.append(ids.shape)
        return np.zeros((*ids.shape, self.vocab_size), dtype=np.float32), None


def test_scores_hand_computed_on_a_uniform_model():
    backend = Uniform()
    requests = [([1, 2], [3]), ([1], [4, 5, 6]), ([7], []), (list(range(10)), list(range(9)))]
    got = harness.score_continuations(backend, requests, batch_size=2)
    want = [-math.log(10) * n for n in (1, 3, 0, 9)]
    assert [g[0] for g in got] == pytest.approx(want)
    assert got[2] == (0.0, True)  # an empty continuation
    # the longest input is truncated from the left to the context: 10 + 9 tokens, less the last, keep 16
    assert backend.shapes == [(2, 16), (1, 2)]
    with pytest.raises(UsageError, match="does not fit"):
        harness.score_continuations(backend, [([1], list(range(17)))])


def test_cut_at_stop_and_prompts_for_generation():
    assert harness.cut_at_stop("abc\n\ndef:g", ["\n\n", ":"]) == "abc"
    assert harness.cut_at_stop("abc", []) == "abc"
    assert harness.prompt_for_generation([], 16, 4) == [EOT_ID]
    assert harness.prompt_for_generation(list(range(20)), 16, 4) == list(range(8, 20))
    assert harness.prompt_for_generation(list(range(20)), 16, 40) == [19]


def test_gen_kwargs_map_to_sampling_settings():
    s, until = sampling_from({"until": "\n", "max_gen_toks": 7}, 256, 1)
    assert until == ("\n",) and s.greedy and s.max_new_tokens == 7 and s.seed == 1
    s, _ = sampling_from({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5}, 256, 1)
    assert not s.greedy and s.temperature == 0.7 and s.top_p == 0.9 and s.top_k == 5
    assert sampling_from({"do_sample": True, "temperature": 0.0}, 256, 1)[0].greedy  # temperature 0: greedy
    assert sampling_from({"temperature": 0.7}, 256, 1)[0].greedy  # no do_sample: greedy, as lm-eval's hf model


# ---------------------------------------------------------------- against lm-eval's hf model


@pytest.mark.parametrize("backend", ["torch", "ort"])
def test_same_accuracy_and_loglikelihoods_as_lm_evals_hf_model(backend, torch_backend, exports, hf_mc, manager):
    runner = torch_backend if backend == "torch" else export_backend(BackendKind.ort, exports(Precision.fp32), threads=2)
    ours, ours_resps = run_task(Gpt2xLM(runner, batch_size=8), manager, MC, MC_LIMIT)
    theirs, theirs_resps = hf_mc
    assert ours["acc,none"] == theirs["acc,none"] and ours["acc_norm,none"] == theirs["acc_norm,none"]
    assert ours["sample_len"] == theirs["sample_len"] == MC_LIMIT
    got = np.array([ll for doc in ours_resps for ll, _ in doc])
    want = np.array([ll for doc in theirs_resps for ll, _ in doc])
    assert len(got) == 4 * MC_LIMIT and np.abs(got - want).max() <= FP32_LOGPROB_ATOL, np.abs(got - want).max()
    assert [g for doc in ours_resps for _, g in doc] == [g for doc in theirs_resps for _, g in doc]


def test_truncation_and_empty_contexts_as_lm_evals_hf_model(tmp_path, hf_tokenizer):
    """A tiny model with a 48-token context: requests longer than it keep their end (lm-eval's hf model
    truncates from the left), an empty context is scored after <|endoftext|>; batched with short ones."""
    hf = make_hf_model(tmp_path, seed=5, n_positions=48)
    model, _ = load_model(str(tmp_path))
    text = metrics.heldout_text()
    pairs = [(text[:400], text[400:460]), (text[:120], " the king"), ("", "ROMEO: hello"), ("", "\n"),
             (text[1000:1010], text[1010:1100]), ("CURTIS:\n", "How?")]
    assert max(len(encode(c + x)) for c, x in pairs) > 48
    got = Gpt2xLM(TorchBackend(model), batch_size=4).loglikelihood(instances(pairs))
    want = hf_lm(hf, hf_tokenizer).loglikelihood(instances(pairs))
    assert np.abs(np.array([g[0] for g in got]) - np.array([w[0] for w in want])).max() <= FP32_LOGPROB_ATOL
    assert [g[1] for g in got] == [w[1] for w in want]


# ---------------------------------------------------------------- rolling log-likelihood


def test_rolling_loglikelihood_is_gpt2xs_perplexity_when_a_document_fits(tmp_path):
    """Documents within the context: one window, [EOT] + tokens; exp(-ll / tokens) is metrics.perplexity."""
    make_hf_model(tmp_path, seed=3, n_positions=64)
    backend = TorchBackend(load_model(str(tmp_path))[0])
    docs = ["ROMEO:\nO, she doth teach the torches to burn bright!", "GRUMIO:\nLend thine ear.", "x"]
    lls = Gpt2xLM(backend).loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), 0) for d in docs])

    def full_logits(x):
        mask = np.ones_like(x)
        return backend.run(x, mask, positions(mask, x.shape[1]), None)[0]

    for doc, ll in zip(docs, lls):
        ids = [EOT_ID, *encode(doc)]
        assert math.exp(-ll / (len(ids) - 1)) == pytest.approx(metrics.perplexity(full_logits, ids, window=len(ids)), rel=1e-6)


def hand_rolling_loglikelihood(backend, ids: list[int]) -> float:
    """Every token scored once: the first n after <|endoftext|> in one window of the context n, each
    following chunk of up to n tokens from a window of the n tokens before its end (as much context
    as fits), one sequence at a time, no padding, no cache."""
    n = backend.n_positions
    seq = [EOT_ID, *ids]  # seq[j + 1] is ids[j]
    total = 0.0
    for start in range(0, len(ids), n):
        end = min(start + n, len(ids))  # score ids[start:end]
        window = seq[max(0, end - n) : end]  # predicts seq[max(0, end - n) + 1 : end + 1]
        x = np.array([window])
        mask = np.ones_like(x)
        lp = log_softmax(backend.run(x, mask, positions(mask, x.shape[1]), None)[0][0])
        first = len(window) - (end - start)
        total += sum(lp[first + k, ids[start + k]] for k in range(end - start))
    return float(total)


def test_rolling_loglikelihood_of_long_documents_by_hand(torch_backend, manager):
    """The ppl task's first two documents (370-570 tokens, those lm-eval scores below with limit=2) on the bundled
    model (256 positions): several windows each, batched; and lm-eval's bits per byte from those log-likelihoods."""
    lines = (TASKS / "shakespeare_ppl.jsonl").read_text(encoding="utf-8").splitlines()[:2]
    docs = [json.loads(line)["text"] for line in lines]
    assert all(len(encode(d)) > torch_backend.n_positions for d in docs)
    lm = Gpt2xLM(torch_backend, batch_size=4)
    lls = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), 0) for d in docs])
    want = [hand_rolling_loglikelihood(torch_backend, encode(d)) for d in docs]
    assert np.abs(np.array(lls) - np.array(want)).max() <= FP32_LOGPROB_ATOL
    result = simple_evaluate(model=lm, tasks=[PPL], task_manager=manager, limit=2, log_samples=False)["results"][PPL]
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert result["bits_per_byte,none"] == pytest.approx(-sum(want) / n_bytes / math.log(2), rel=1e-5)
    assert result["byte_perplexity,none"] == pytest.approx(math.exp(-sum(want) / n_bytes), rel=1e-5)


# ---------------------------------------------------------------- every backend and precision


@pytest.fixture(scope="module")
def mc_requests():
    rows = [json.loads(line) for line in (TASKS / "shakespeare_mc.jsonl").read_text(encoding="utf-8").splitlines()][:8]
    return rows, instances([(r["context"] + "\n", c) for r in rows for c in r["choices"]])


def accuracy(rows, lls) -> float:
    return float(np.mean([int(np.argmax(lls[4 * i : 4 * i + 4])) == r["gold"] for i, r in enumerate(rows)]))


@pytest.fixture(scope="module")
def reference_mc(torch_backend, mc_requests):
    rows, reqs = mc_requests
    return np.array([ll for ll, _ in Gpt2xLM(torch_backend).loglikelihood(reqs)])


@pytest.mark.parametrize("backend,precision", [
    ("openvino", Precision.fp32), ("genai", Precision.fp32),
    ("ort", Precision.int8), ("ort", Precision.int4), ("openvino", Precision.int8), ("genai", Precision.int4),
])
def test_every_backend_and_precision_scores_the_task(backend, precision, exports, mc_requests, reference_mc):
    rows, reqs = mc_requests
    runner = export_backend(BackendKind(backend), exports(precision), threads=2)
    got = np.array([ll for ll, _ in Gpt2xLM(runner, batch_size=8).loglikelihood(reqs)])
    diff = np.abs(got - reference_mc)
    if precision is Precision.fp32:
        assert diff.max() <= FP32_LOGPROB_ATOL
        assert accuracy(rows, got) == accuracy(rows, reference_mc)
    else:
        tokens = sum(len(encode(i.args[0] + i.args[1])) - len(encode(i.args[0].rstrip())) for i in reqs)
        assert diff.sum() / tokens <= QUANT_MEAN_ABS_PER_TOKEN[precision], diff.sum() / tokens
        assert 0.0 <= accuracy(rows, got) <= 1.0
        assert abs(accuracy(rows, got) - accuracy(rows, reference_mc)) <= 0.25  # at most 2 of 8 answers change


def test_the_registered_model_opens_a_backend_from_model_args(exports, manager, shakespeare):
    """simple_evaluate(model="gpt2x", model_args=...): the registry, lm-eval's argument string, open_backend."""
    folder = exports(Precision.int8).folder
    result = simple_evaluate(model="gpt2x", model_args=f"model=shakespeare,backend=ort,precision=int8,onnx={folder},threads=2",
                             tasks=[MC], task_manager=manager, limit=4, batch_size=4, log_samples=False)
    assert 0.0 <= result["results"][MC]["acc,none"] <= 1.0
    assert result["config"]["gpt2x_backend"] == "ort" and result["config"]["gpt2x_batch_size"] == 4
    with pytest.raises(UsageError, match="backend 'nope'"):
        Gpt2xLM.create_from_arg_string("model=shakespeare,backend=nope")


# ---------------------------------------------------------------- generate_until


def test_generate_until_is_gpt2xs_greedy_generation_cut_at_the_stop_string(torch_backend):
    long_context = metrics.heldout_text()[:2000]  # ~650 tokens: truncated from the left to leave room
    requests = [
        ("ROMEO:\n", {"until": ["\n\n"], "max_gen_toks": 40}),
        ("GRUMIO:\n", {"until": ["\n\n"], "max_gen_toks": 40}),
        ("CURTIS:", {"until": [",", ":"], "max_gen_toks": 30}),
        ("", {"until": ["\n"], "max_gen_toks": 20}),
        ("KING RICHARD III:\n", {"until": [], "max_gen_toks": 5}),
        (long_context, {"until": ["\n"], "max_gen_toks": 16}),
    ]
    got = Gpt2xLM(torch_backend, batch_size=2).generate_until(
        [Instance("generate_until", {}, req, i) for i, req in enumerate(requests)])
    n = torch_backend.n_positions
    for (context, kwargs), text in zip(requests, got):
        prompt = (encode(context) or [EOT_ID])[-(n - kwargs["max_gen_toks"]) :]
        [ref] = generate(torch_backend, [context], SamplingSettings(max_new_tokens=kwargs["max_gen_toks"], greedy=True),
                         prompt_ids=[prompt])
        want = decode(ref.tokens)
        for stop in kwargs["until"]:
            want = want.split(stop)[0]
        assert text == want
        assert len(encode(text)) <= kwargs["max_gen_toks"]
    assert got[4] and len(encode(got[4])) <= 5 and "\n\n" not in got[0] and "," not in got[2]


def test_sampled_generate_until_is_gpt2xs_seeded_sampling(torch_backend):
    kwargs = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": True, "temperature": 0.8, "top_p": 0.9}
    requests = [Instance("generate_until", {}, ("ROMEO:\n", kwargs), 0)]
    got = Gpt2xLM(torch_backend, seed=7).generate_until(requests)
    [ref] = generate(torch_backend, ["ROMEO:\n"], SamplingSettings(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7))
    assert got == [decode(ref.tokens).split("\n\n")[0]]
    assert Gpt2xLM(torch_backend, seed=7).generate_until(requests) == got  # seeded: the same text again


# ---------------------------------------------------------------- gpt2x eval


def test_cli_eval_prints_a_table_and_writes_json(capsys, exports, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    folder = exports(Precision.fp32).folder
    code, out, err = cli(capsys, "eval", "--model", "shakespeare", "--backend", "ort", "--precision", "fp32", "--onnx", str(folder),
                         "--tasks", MC, "--include-path", str(TASKS), "--limit", "8", "--output", "r.json", "--threads", "2")
    assert code == 0, err
    assert MC in out and "acc" in out and "acc_norm" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert 0.0 <= result["results"][MC]["acc,none"] <= 1.0 and result["results"][MC]["sample_len"] == 8
    assert result["gpt2x"]["gpt2x_backend"] == "ort" and result["gpt2x"]["tasks"] == [MC]
    assert "gpt2x loglikelihood" in err  # progress on stderr
    assert not (tmp_path / "exported").exists()


def test_cli_eval_json_prints_the_result_alone_on_stdout(capsys, exports, tmp_path, monkeypatch):
    """--json: lm-eval's result on stdout and nothing else (the tables go to stderr); the old
    `--json PATH` writes the file with a one-line deprecation notice."""
    monkeypatch.chdir(tmp_path)
    args = ("eval", "--onnx", str(exports(Precision.fp32).folder), "--tasks", MC, "--include-path", str(TASKS), "--limit", "4",
            "--threads", "2")
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["results"][MC]["sample_len"] == 4 and result["gpt2x"]["tasks"] == [MC]
    assert "acc_norm" in err and "deprecated" not in err
    code, out, err = cli(capsys, *args, "--json", "old.json")
    assert code == 0 and "acc_norm" in out, err
    assert json.loads((tmp_path / "old.json").read_text())["results"][MC]["sample_len"] == 4
    assert "warning: --json PATH is deprecated; use --output PATH (--json now prints the JSON on stdout)" in err.splitlines()


def test_cli_eval_unknown_task_is_one_line_before_any_export(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    code, _, err = cli(capsys, "eval", "--tasks", f"{MC}x", "--include-path", str(TASKS), "--precision", "int8")
    assert_one_line_error(code, err, UsageError.exit_code, f"unknown task '{MC}x' (did you mean {MC}")
    assert not (tmp_path / "exported").exists()


def test_cli_eval_a_data_set_that_cannot_be_loaded_is_one_line(capsys, tmp_path, monkeypatch):
    """Offline (the tests are), a task whose data set is on the hub and not cached: a HubError, not a traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPORTS_ENV, str(tmp_path / "exported"))  # exports by model name land there
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "remote.yaml").write_text(
        "task: gpt2x_remote\ndataset_path: gpt2x-tests/no-such-dataset\noutput_type: loglikelihood_rolling\n"
        "test_split: test\ndoc_to_text: ''\ndoc_to_target: text\nmetric_list:\n  - metric: bits_per_byte\n")
    code, _, err = cli(capsys, "--quiet", "eval", "--backend", "torch", "--tasks", "gpt2x_remote", "--include-path", "tasks")
    assert_one_line_error(code, err, HubError.exit_code, "data set cannot be loaded")


def test_cli_eval_has_help_with_examples(capsys):
    code, out, _ = cli(capsys, "eval", "--help")
    assert code == 0 and "Example" in out and "--include-path" in out


def test_task_manager_skips_lm_evals_own_index_when_the_include_path_has_every_task():
    manager = task_manager((MC, "gpt2x_shakespeare"), (TASKS,))
    assert set(manager.all_tasks) == {MC, PPL, "gpt2x_shakespeare"}
    with pytest.raises(UsageError, match="include path"):
        task_manager((MC,), (TASKS / "nope",))


def test_without_lm_eval_eval_is_one_line_naming_the_extra(tmp_path):
    r = run_gpt2x("eval", "--tasks", MC, cwd=tmp_path, blocked=True, block="lm_eval")
    assert r.returncode == MissingDependencyError.exit_code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'gpt2x[eval]'" in lines[0] and "Traceback" not in r.stderr
