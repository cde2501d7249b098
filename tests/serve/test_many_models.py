"""Several models behind one server (openai/many.py): the bundled model's fp32 export and a tiny random GPT-2's,
each request answered by the model its body names, checked against generation on each export's own independent
backend; /v1/models, /health and /metrics covering both; models loaded on demand and closed for room
(--models-max); the command's one-line refusals."""

from __future__ import annotations

import time

import httpx
import pytest

from gpt2x.choices import Precision
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime import openvino_prefill
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import EngineSettings
from gpt2x.serve.openai.chat_completion.template import find_template
from gpt2x.serve.openai.many import Models, ModelSlot, models_app
from gpt2x.serve.openai.service import CompletionService
from gpt2x.tokenizer import decode

from ..helpers import assert_one_line_error, cli, scrape, served_models, serving, uvicorn_server

A, B = "shakespeare", "tiny"
PROMPT = "ROMEO:"
TOKENS = 8


@pytest.fixture(scope="module")
def folders(export_dir, tiny_export):
    return {A: export_dir, B: tiny_export(Precision.fp32, gated=False)[2].folder}


class Opened:
    """The services each slot opened, so that a test sees which were closed."""

    def __init__(self, folders: dict):
        self.folders = folders
        self.services: list[CompletionService] = []

    def slot(self, model_id: str) -> ModelSlot:
        folder = self.folders[model_id]

        def open_service() -> CompletionService:
            backend = OrtBackend(read_export(folder), threads=1)
            service = CompletionService(backend, EngineSettings(max_batch_size=4), model_id,
                                        chat_template=find_template(folder, None, True))
            self.services.append(service)
            return service

        def close_service(service: CompletionService) -> None:
            service.close()
            service.backend.close()

        info = read_export(folder)
        return ModelSlot(model_id, open_service, close_service, info.config.n_positions, info.precision.value, "ort", "cpu")


def expected(folder, backend_type=OrtBackend) -> str:
    """The greedy continuation on an independent backend over the export."""
    backend = backend_type(read_export(folder), threads=1)
    try:
        return decode(generate(backend, [PROMPT], SamplingSettings(max_new_tokens=TOKENS, greedy=True))[0].tokens)
    finally:
        backend.close()


@pytest.fixture(scope="module")
def references(folders):
    return {m: expected(f) for m, f in folders.items()}


def complete(client: httpx.Client, model: str | None) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, **({} if model is None else {"model": model})}
    return client.post("/v1/completions", json=body)


@pytest.fixture(scope="module")
def client(folders):
    opened = Opened(folders)
    with served_models([opened.slot(A), opened.slot(B)]) as c:
        yield c


def test_each_model_answers_as_its_own_backend(client, references):
    for model in (A, B):
        r = complete(client, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model and r.json()["choices"][0]["text"] == references[model]
    assert references[A] != references[B]  # the two models differ: the routing is seen
    default = complete(client, None)  # no model (and ""): the first, as a single model's server
    assert default.json()["choices"][0]["text"] == references[A]
    assert complete(client, "").json()["model"] == A
    chat = client.post("/v1/chat/completions", json={"model": B, "messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == B
    tokens = client.post("/tokenize", json={"model": B, "prompt": PROMPT})
    assert tokens.status_code == 200 and tokens.json()["max_model_len"] == 96


def test_an_unknown_model_is_a_404_listing_the_served_ones(client):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/tokenize", {"prompt": "x"})):
        r = client.post(path, json={**body, "model": "gpt4"})
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "'gpt4'" in error["message"] and repr(A) in error["message"] and repr(B) in error["message"]


def test_models_health_and_metrics_cover_every_model(client, folders):
    cards = client.get("/v1/models").json()["data"]
    lengths = {m: read_export(f).config.n_positions for m, f in folders.items()}
    assert [(c["id"], c["max_model_len"], c["precision"]) for c in cards] == [(A, lengths[A], "fp32"), (B, 96, "fp32")]
    health = client.get("/health").json()
    assert health["model"] == A and [m["model"] for m in health["models"]] == [A, B]
    before = scrape(client.get("/metrics").text)
    complete(client, B)
    text = client.get("/metrics").text
    families = scrape(text)  # prometheus_client's parser: one valid exposition
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) and "# TYPE vllm:prompt_tokens_total counter" in types  # each family once

    def count(families, model):
        return families["vllm:generation_tokens"][1].get(("vllm:generation_tokens_total", (("model_name", model),)), 0)

    assert count(families, B) - count(before, B) == TOKENS and count(families, A) == count(before, A)
    assert count(families, A) > 0


def test_models_max_loads_on_demand_and_closes_the_least_recently_used(folders, references):
    opened = Opened(folders)
    models = Models([opened.slot(A), opened.slot(B)], max_loaded=1)
    try:
        with uvicorn_server(models_app(models)) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            assert opened.services == [] and not c.get("/health").json()["models"][0]["loaded"]
            assert complete(c, A).json()["choices"][0]["text"] == references[A]
            assert [s.model_id for s in opened.services] == [A]
            assert complete(c, B).json()["choices"][0]["text"] == references[B]
            first, second = opened.services
            assert first.engine.closing and not first.engine.alive and second.engine.alive  # A closed for B
            assert [m["loaded"] for m in c.get("/health").json()["models"]] == [False, True]
            assert complete(c, A).json()["choices"][0]["text"] == references[A]  # loaded again
            assert second.engine.closing and len(opened.services) == 3
    finally:
        models.close_all()


def test_an_idle_model_is_closed_and_loaded_again(folders, references):
    opened = Opened(folders)
    models = Models([opened.slot(A), opened.slot(B)], idle_unload_s=0.3)
    models.load_all()
    try:
        with uvicorn_server(models_app(models)) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            assert complete(c, B).status_code == 200  # starts the idle check
            deadline = time.monotonic() + 10
            while not all(s.engine.closing for s in opened.services) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [m["loaded"] for m in c.get("/health").json()["models"]] == [False, False]
            assert complete(c, A).json()["choices"][0]["text"] == references[A]
            assert len(opened.services) == 3
    finally:
        models.close_all()


def test_a_model_that_fails_to_load_is_a_503_naming_it(folders):
    def fail() -> CompletionService:
        raise RuntimeError("no such file")

    slot = Opened(folders).slot(A)
    models = Models([slot, ModelSlot("broken", fail, lambda s: None, 96)], max_loaded=2)
    with uvicorn_server(models_app(models)) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        r = complete(c, "broken")
        assert r.status_code == 503 and "'broken'" in r.json()["error"]["message"]
    models.close_all()


def test_the_command_refuses_duplicate_ids_and_ray_in_one_line(capsys, export_dir):
    code, _, err = cli(capsys, "serve", "--onnx", str(export_dir), "--onnx", str(export_dir), "--port", "0")
    assert_one_line_error(code, err, 2, "two models would be served as 'shakespeare'")
    # several models are served on Ray too (tests/serve/test_ray.py), each loaded for good: no loading on demand there
    code, _, err = cli(capsys, "serve", "--model", "a", "--model", "b", "--ray", "--models-max", "1")
    assert_one_line_error(code, err, 2, "--models-max and --idle-unload-s load and close models in the one-process server")
    code, _, err = cli(capsys, "serve", "--model", "a", "--replicas", "2", "--idle-unload-s", "60")
    assert_one_line_error(code, err, 2, "on Ray Serve each model is a deployment that stays loaded")
    code, _, err = cli(capsys, "serve", "--onnx", str(export_dir), "--onnx", str(export_dir),
                       "--served-model-name", "x")
    assert_one_line_error(code, err, 2, "once per model")


@pytest.mark.skipif(not openvino_prefill.cpu_has_bf16(), reason="this CPU does not compute bf16")
def test_a_bf16_export_beside_an_fp32_one_is_served_on_the_backend_its_record_runs(tiny_export):
    """Without --backend, each model on its own export's default backend: bf16 on openvino, fp32 on ort (the first's
    choice had been made for all, and the bf16 export refused)."""
    from gpt2x.runtime.openvino import OpenVinoBackend

    fp32, bf16 = (tiny_export(p)[2].folder for p in (Precision.fp32, Precision.bf16))
    with serving("--onnx", str(fp32), "--onnx", str(bf16), "--served-model-name", "f", "--served-model-name", "b",
                 "--port", "0", "--threads", "1") as (proc, ready):
        assert [(m["model"], m["backend"]) for m in ready["models"]] == [("f", "ort"), ("b", "openvino")]
        with httpx.Client(base_url=ready["url"], timeout=60) as client:
            for model, folder, backend_type in (("f", fp32, OrtBackend), ("b", bf16, OpenVinoBackend)):
                r = complete(client, model)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == expected(folder, backend_type)
            health = client.get("/health").json()
        assert [(m["model"], m["backend"]) for m in health["models"]] == [("f", "ort"), ("b", "openvino")]
