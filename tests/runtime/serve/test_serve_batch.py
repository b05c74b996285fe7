"""`glance-serve --max-batch` live on loopback ports, driven by the official `openai` client: requests decoded
together each get exactly the answer the same request gets alone (plain and streamed), a client leaving
mid-stream frees its slot, a full queue is 429, a timeout is 504, and /metrics shows the batch's occupancy."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import glance_runtime as gr
from support import MODEL_NAME, RECEIPT, data_url, start_server, user

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

CLIENT_TIMEOUT_S = 60
MAX_TOKENS = 48
QUESTIONS = [("What is the total?", RECEIPT), ("Describe this.", None), ("What is the date?", RECEIPT),
             ("Hello", None), ("Name a colour.", None), ("What store is this?", RECEIPT)]


@pytest.fixture(scope="module")
def alone():
    """Each question's answer decoded alone, through the API (batch 1)."""
    with gr.load(threads=1) as model:
        return {q: model.generate(q, images=[str(image)] if image else None, max_new_tokens=MAX_TOKENS).text
                for q, image in QUESTIONS}


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-batch", "4")
    yield srv
    srv.stop()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def answer(srv, question: str, image, stream: bool) -> str:
    messages = user(question, image and data_url(image))
    if not stream:
        return client(srv).chat.completions.create(model=MODEL_NAME, messages=messages,
                                                   max_tokens=MAX_TOKENS).choices[0].message.content
    chunks = client(srv).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                 stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def metric(srv, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_six_concurrent_requests_plain_and_streamed_each_get_their_answer_alone(server, alone):
    barrier = threading.Barrier(len(QUESTIONS))

    def ask(i: int) -> str:
        question, image = QUESTIONS[i]
        barrier.wait()
        return answer(server, question, image, stream=bool(i % 2))

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        got = list(pool.map(ask, range(len(QUESTIONS))))
    assert got == [alone[q] for q, _ in QUESTIONS]
    assert metric(server, "glance_batch_slots") == 4
    assert metric(server, "glance_batch_sequences_count") >= 1  # rounds were run through the batch
    assert "glance_batch_active" in httpx.get(f"{server.url}/metrics").text


def test_clients_leaving_mid_stream_free_their_slots(server, alone):
    """As many streams as slots are left after their first chunk; the requests after them still complete."""
    body = {"model": MODEL_NAME, "messages": user("What is the total?", data_url(RECEIPT)), "stream": True,
            "max_tokens": 512}
    for _ in range(4):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S) as r:
            assert next(r.iter_lines()).startswith("data: ")  # the role chunk: the answer has begun; hang up
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        got = list(pool.map(lambda qi: answer(server, *qi, stream=False), QUESTIONS))
    assert got == [alone[q] for q, _ in QUESTIONS]
    deadline = time.monotonic() + 30  # a left stream leaves the batch at its next round boundary
    while metric(server, "glance_batch_active") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "glance_batch_active") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_full_queue_answers_429_and_the_rest_their_answers(alone):
    srv = start_server("--max-batch", "2", "--max-queue", "1")
    try:
        barrier = threading.Barrier(12)

        def post(_):
            with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
                barrier.wait()
                return http.post(f"{srv.url}/v1/chat/completions",
                                 json={"model": MODEL_NAME, "messages": user("What is the total?", data_url(RECEIPT)),
                                       "max_tokens": MAX_TOKENS})

        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(post, range(12)))
        busy = [r for r in replies if r.status_code == 429]
        assert busy and all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
                            for r in busy)
        ok = [r for r in replies if r.status_code == 200]
        assert len(ok) + len(busy) == 12 and ok
        assert {r.json()["choices"][0]["message"]["content"] for r in ok} == {alone["What is the total?"]}
    finally:
        srv.stop()


def test_a_request_over_its_timeout_is_504_and_the_server_carries_on():
    srv = start_server("--max-batch", "4", "--timeout", "0.001")
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=CLIENT_TIMEOUT_S,
                       json={"model": MODEL_NAME, "messages": user("What is the total?", data_url(RECEIPT))})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert metric(srv, "glance_batch_active") == 0
    finally:
        srv.stop()


def test_max_batch_above_one_is_refused_at_start_for_the_torch_reference(capsys):
    from glance_runtime.cli.serve import main as serve_main

    assert serve_main(["--backend", "torch", "--max-batch", "4", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-batch" in err and "torch" in err
