"""lm-evaluation-harness's `local-completions` model scoring a served export through the completions
API (token-id prompts, `echo`, `max_tokens: 0`, `logprobs`) gives what `gpt2x eval` gives in-process
on the same export: the same accuracy, and the same log-likelihoods per request."""

from __future__ import annotations

import json
import shutil

import pytest
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gpt2x.lmeval.model import Gpt2xLM  # noqa: E402
from gpt2x.onnx.artifact import read_export  # noqa: E402
from gpt2x.runtime.ort import OrtBackend  # noqa: E402
from gpt2x.serve.openai.routes import local_app  # noqa: E402
from gpt2x.tokenizer import bpe_file  # noqa: E402

from ..helpers import REPO, local_service, uvicorn_server  # noqa: E402

TASKS = REPO / "tests" / "data" / "lm_eval_tasks"
MC = "gpt2x_shakespeare_mc"
LIMIT = 12  # documents (4 requests each)
# The served answer and the in-process one are the same fp32 graph on the same tokens, one row per
# request against left-padded batches: ONNX Runtime's fp32 rows agree to about 1e-5 per token.
LOGLIK_ATOL = 1e-3


@pytest.fixture(scope="module")
def base_url(export_dir):
    import uvicorn  # noqa: F401 (uvicorn_server's: missing, the tests fail)
    service = local_service(export_dir)
    with uvicorn_server(local_app(service)) as port:
        yield f"http://127.0.0.1:{port}/v1/completions"
    service.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """GPT-2's tokenizer files for lm-eval's client side (vocab.json and merges.txt are gpt2x's BPE files)."""
    folder = tmp_path_factory.mktemp("gpt2-tokenizer")
    shutil.copy(bpe_file("encoder.json"), folder / "vocab.json")
    shutil.copy(bpe_file("vocab.bpe"), folder / "merges.txt")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>",
                                                              "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    return folder


def run(lm):
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    result = simple_evaluate(model=lm, tasks=[MC], task_manager=manager, limit=LIMIT, log_samples=True)
    samples = sorted(result["samples"][MC], key=lambda s: s["doc_id"])
    return result["results"][MC], [[r[0] for r in s["resps"]] for s in samples]


def test_local_completions_against_gpt2x_serve_equals_gpt2x_eval(base_url, tokenizer_dir, export_dir):
    served = LocalCompletionsAPI(base_url=base_url, model="shakespeare", tokenizer_backend="huggingface",
                                 tokenizer=str(tokenizer_dir), tokenized_requests=True, max_length=256,
                                 batch_size=1, max_retries=1)
    in_process = Gpt2xLM(OrtBackend(read_export(export_dir), threads=1))
    served_metrics, served_resps = run(served)
    local_metrics, local_resps = run(in_process)
    assert served_metrics["acc,none"] == local_metrics["acc,none"]
    assert served_metrics["acc_norm,none"] == local_metrics["acc_norm,none"]
    assert len(served_resps) == len(local_resps) == LIMIT
    for served_doc, local_doc in zip(served_resps, local_resps):
        for (s_ll, s_greedy), (l_ll, l_greedy) in zip(served_doc, local_doc):
            assert abs(float(s_ll) - float(l_ll)) <= LOGLIK_ATOL
            assert bool(s_greedy) == bool(l_greedy)
