"""The shipped EAGLE-3 head of the default model, exported, served and called as a GLANCE head is: through the
Python API and a live `glance-serve` answered to the official `openai` client, every answer greedy's own."""
from __future__ import annotations

import openai
import pytest

import glance_runtime as gr
from glance_runtime.defaults import DEFAULT_MODEL, MODELS_ROOT
from support import RECEIPT, data_url, start_server, user

EAGLE3_HEAD = MODELS_ROOT / "glance-vl-tiny-eagle3"
SERVED = "glance-vl-tiny-eagle3"
QUESTIONS = [("What is the total?", RECEIPT), ("Describe the image.", RECEIPT), ("Say hello.", None)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from glance_export.onnx import export_artifacts

    return export_artifacts(DEFAULT_MODEL, EAGLE3_HEAD, tmp_path_factory.mktemp("eagle3") / "onnx", max_tree=64,
                            max_context=1024, progress=lambda _: None)


@pytest.fixture(scope="module")
def greedy(artifacts):
    with gr.load(artifacts=artifacts, threads=1, speculative=False) as model:
        return {q: model.generate(q, images=[image] if image else None, max_new_tokens=32).text
                for q, image in QUESTIONS}


@pytest.mark.parametrize("budget", [7, 63, "auto"])
def test_the_api_decodes_with_an_eagle3_head_as_greedy_does(artifacts, greedy, budget, tmp_path, monkeypatch):
    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path))  # auto's cost profile measured here, not found elsewhere
    with gr.load(artifacts=artifacts, threads=1, budget=budget) as model:
        for question, image in QUESTIONS:
            out = model.generate(question, images=[image] if image else None, max_new_tokens=32)
            assert out.text == greedy[question], question
        if budget == 63:
            assert model.generate("What is the total?", images=[RECEIPT]).tau > 1.5


def test_glance_serve_answers_with_an_eagle3_head(artifacts, greedy):
    server = start_server("--artifacts", str(artifacts), "--served-model-name", SERVED)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for question, image in QUESTIONS:
            reply = client.chat.completions.create(model=SERVED, messages=user(question, image and data_url(image)),
                                                   max_tokens=32)
            assert reply.choices[0].message.content == greedy[question]
            streamed = client.chat.completions.create(model=SERVED, stream=True, max_tokens=32,
                                                      messages=user(question, image and data_url(image)))
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == greedy[question]
    finally:
        server.stop()
