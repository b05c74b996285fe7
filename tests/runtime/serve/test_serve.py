"""`glance-serve` live on loopback ports, driven by the official `openai` client and raw HTTP: it answers
with `glance-run`'s exact text (plain and streamed, 16 clients at once), refuses bad requests with OpenAI's
error shape and stays healthy, survives dropped streams, a full queue and a killed process."""
from __future__ import annotations

import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

import glance_runtime as gr
from glance_runtime.cli.serve import main as serve_main
from glance_runtime.prompt.token_bytes import TokenBytes
from support import MODEL_NAME, RECEIPT, data_url, glance_run, start_server, user

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

KEY = "test-key"
CLIENT_TIMEOUT_S = 60
QUESTIONS = [("What is the total?", RECEIPT), ("Describe this.", None)]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    shutil.copy(RECEIPT, root / "receipt.png")
    (root / "notes.txt").write_text("not an image")
    secret = tmp_path_factory.getbasetemp() / "secret.png"
    secret.write_bytes(RECEIPT.read_bytes())
    (root / "link.png").symlink_to(secret)
    return root


@pytest.fixture(scope="module")
def server(media):
    srv = start_server("--api-key", KEY, "--media-dir", str(media), "--max-body-mb", "2", "--max-messages", "8",
                       "--max-tokens", "512")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected():
    """glance-run's answers to QUESTIONS, by prompt."""
    return {prompt: glance_run(prompt, image) for prompt, image in QUESTIONS}


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


def ask(server, prompt: str, image=None, **kw):
    return client(server).chat.completions.create(model=MODEL_NAME, messages=user(prompt, image and data_url(image)),
                                                  **kw)


def test_openai_client_gets_glance_runs_text_plain_and_streamed(server, expected):
    for prompt, image in QUESTIONS:
        ref = expected[prompt]
        out = ask(server, prompt, image)
        assert out.choices[0].message.content == ref["text"]
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == len(ref["token_ids"])
        assert out.model_extra["glance"]["rounds"] >= 1 and out.model_extra["glance"]["tau"] >= 1
        pieces = [c.choices[0].delta.content or "" for c in ask(server, prompt, image, stream=True) if c.choices]
        assert "".join(pieces) == ref["text"] and len([p for p in pieces if p]) > 1


def test_a_sampled_answer_is_glance_runs_for_its_seed_plain_and_streamed(server):
    """temperature, top_p and seed through the official client: the answer glance-run samples with that seed, a
    drawn seed reported in the glance object and giving the same answer when sent back."""
    for prompt, image in QUESTIONS:
        ref = glance_run(prompt, image, None, "--temperature", "1.3", "--top-p", "0.95", "--seed", "17")
        out = ask(server, prompt, image, temperature=1.3, top_p=0.95, seed=17)
        assert out.choices[0].message.content == ref["text"] and out.model_extra["glance"]["seed"] == 17
        pieces = [c.choices[0].delta.content or "" for c in ask(server, prompt, image, stream=True, temperature=1.3,
                                                                 top_p=0.95, seed=17) if c.choices]
        assert "".join(pieces) == ref["text"]
    drawn = ask(server, "Describe this.", temperature=1.3)
    seed = drawn.model_extra["glance"]["seed"]
    assert isinstance(seed, int) and ask(server, "Describe this.", temperature=1.3, seed=seed).choices[0].message.content \
        == drawn.choices[0].message.content
    assert ask(server, "Describe this.").model_extra["glance"]["seed"] is None


def test_n_answers_are_sampled_with_the_seed_plus_their_index(server):
    """n answers to one request: answer i is glance-run's with the request's seed + i; usage counts the prompt
    once and every answer's tokens; n greedy answers are the greedy answer n times."""
    out = ask(server, "Describe this.", temperature=1.3, top_p=0.95, seed=30, n=3)
    texts = [c.message.content for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2] and out.model_extra["glance"]["seed"] == 30
    refs = [glance_run("Describe this.", None, None, "--temperature", "1.3", "--top-p", "0.95", "--seed", str(30 + i))
            for i in range(3)]
    assert texts == [r["text"] for r in refs] and len(set(texts)) > 1
    assert out.usage.completion_tokens == sum(len(r["token_ids"]) for r in refs)
    greedy = ask(server, "What is the total?", RECEIPT, n=2)
    assert [c.message.content for c in greedy.choices] == [glance_run("What is the total?", RECEIPT)["text"]] * 2


@pytest.fixture(scope="module")
def api():
    """The Python API on the same default, in this process: what the server's answers are held to."""
    with gr.load(threads=1) as model:
        yield model


def _reported(content) -> list[tuple]:
    return [(e.token, bytes(e.bytes), e.logprob, [(t.token, bytes(t.bytes), t.logprob) for t in e.top_logprobs])
            for e in content]


def _expected_reports(api, prompt: str, image, top: int, **kw) -> list[tuple]:
    out = api.generate(prompt, images=[str(image)] if image else None, logprobs=top, **kw)
    spell = TokenBytes(api.session.codec.tokenizer)
    return [(spell.text(t), spell.bytes(t), r.logprob, [(spell.text(a), spell.bytes(a), v) for a, v in r.top])
            for t, r in zip(out.token_ids, out.logprobs)]


def _close(got: list[tuple], want: list[tuple]) -> None:
    """The same tokens and alternatives, and log-probs equal to float32 rounding: the server's batch pool and the
    API's lone one are graphs of other shapes (a few ulps apart seen, 1.4e-6 at -12)."""
    assert [(g[0], g[1], [a[:2] for a in g[3]]) for g in got] == [(w[0], w[1], [a[:2] for a in w[3]]) for w in want]
    got_values = [v for g in got for v in (g[2], *(a[2] for a in g[3]))]
    assert got_values == pytest.approx([v for w in want for v in (w[2], *(a[2] for a in w[3]))], rel=1e-5, abs=1e-5)


def test_log_probs_plain_and_streamed_are_the_apis(server, api):
    """logprobs and top_logprobs through the official client, greedy and sampled, plain and streamed: one entry per
    answered token, with its text, bytes and log-prob and its best alternatives, equal to the API's reports."""
    for prompt, image in QUESTIONS:
        for kw in ({}, {"temperature": 1.3, "top_p": 0.95, "seed": 17}):
            want = _expected_reports(api, prompt, image, 3, **kw)
            out = ask(server, prompt, image, logprobs=True, top_logprobs=3, **kw)
            got = _reported(out.choices[0].logprobs.content)
            assert len(got) == out.usage.completion_tokens
            _close(got, want)
            streamed = [e for c in ask(server, prompt, image, stream=True, logprobs=True, top_logprobs=3, **kw)
                        if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            _close(_reported(streamed), want)
    plain = ask(server, "Describe this.", logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert ask(server, "Describe this.").choices[0].logprobs is None


def test_n_answers_stream_side_by_side(server):
    """n answers streamed: each choice's pieces join to the unstreamed answer of the same index, each ends once
    with its finish reason, and the usage counts them all."""
    kw = {"temperature": 1.3, "top_p": 0.95, "seed": 40, "n": 3}
    whole = ask(server, "Describe this.", **kw)
    texts, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
    for chunk in ask(server, "Describe this.", stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices] and len(set(texts.values())) > 1
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_eight_clients_half_greedy_half_sampled_each_get_their_answer_alone(server):
    """Eight requests at once through the batch, every other one sampled with its own seed: each answer is the one
    glance-run gives the same request alone."""
    asks = [(prompt, image, {} if i % 2 == 0 else {"temperature": 1.2, "top_p": 0.9, "seed": 100 + i})
            for i, (prompt, image) in enumerate(QUESTIONS * 4)]
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: ask(server, a[0], a[1], **a[2]).choices[0].message.content, asks))
    for (prompt, image, kw), text in zip(asks, got):
        flags = [] if not kw else ["--temperature", "1.2", "--top-p", "0.9", "--seed", str(kw["seed"])]
        assert text == glance_run(prompt, image, None, *flags)["text"], kw


def test_usage_in_the_stream_and_a_file_under_the_media_dir(server, expected, media):
    ref = expected["What is the total?"]
    chunks = list(client(server).chat.completions.create(
        model=MODEL_NAME, messages=user("What is the total?", (media / "receipt.png").as_uri()), stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"]) and chunks[-1].usage.prompt_tokens > 0


def test_max_tokens_and_stop_strings(server, expected):
    ref = glance_run("What is the total?", RECEIPT, max_new_tokens=3)
    out = ask(server, "What is the total?", RECEIPT, max_tokens=3)
    assert out.choices[0].message.content == ref["text"] and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3
    full = expected["What is the total?"]["text"]
    cut = full.index(" is ")
    for stream in (False, True):
        got = ask(server, "What is the total?", RECEIPT, stop=[" is "], stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in got if c.choices) if stream \
            else got.choices[0].message.content
        assert text == full[:cut]


def test_a_system_prompt_and_earlier_turns_are_part_of_the_prompt(server, expected):
    turns = [{"role": "system", "content": "You are brief."}, *user("What is the total?", data_url(RECEIPT)),
             {"role": "assistant", "content": expected["What is the total?"]["text"]}, *user("Describe this.")]
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=turns)
    alone = ask(server, "Describe this.")
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content
    assert out.usage.prompt_tokens > alone.usage.prompt_tokens + 16  # the image and the earlier turns were prefilled


def test_a_follow_up_turn_reuses_the_conversations_rows_and_equals_a_fresh_decode(server, expected):
    first = user("What is the total?", data_url(RECEIPT))
    ask(server, "Describe this.")  # the server now holds another conversation's rows
    a1 = client(server).chat.completions.create(model=MODEL_NAME, messages=first)
    assert a1.choices[0].message.content == expected["What is the total?"]["text"]
    turns = [*first, {"role": "assistant", "content": a1.choices[0].message.content},
             *user("Is it more than 30?")]
    a2 = client(server).chat.completions.create(model=MODEL_NAME, messages=turns)
    glance = a2.model_extra["glance"]
    assert glance["prefill_tokens"] < a2.usage.prompt_tokens - 16  # the image and the first turn were kept
    with Image.open(RECEIPT) as img, gr.load(threads=1) as model:
        fresh = model.generate(messages=[{"role": "user", "content": [{"type": "image", "image": img.copy()},
                                                                      {"type": "text", "text": "What is the total?"}]},
                                         turns[1], {"role": "user", "content": "Is it more than 30?"}])
    assert a2.choices[0].message.content == fresh.text
    assert a2.usage.completion_tokens == len(fresh.token_ids)


def test_several_images_in_one_request(server, media):
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(RECEIPT)}},
                                        {"type": "image_url", "image_url": {"url": (media / "receipt.png").as_uri()}},
                                        {"type": "text", "text": "What changed?"}]}]
    one = client(server).chat.completions.create(model=MODEL_NAME, messages=[
        {"role": "user", "content": [two[0]["content"][0], two[0]["content"][2]]}])
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=two)
    assert out.choices[0].message.content and out.usage.prompt_tokens > one.usage.prompt_tokens + 16


def test_sixteen_concurrent_clients_all_get_the_text_while_metrics_answer(server, expected):
    ref = expected["What is the total?"]["text"]
    depths: list[float] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT_S) as http:
            while not done.is_set():
                assert http.get(f"{server.url}/health").status_code == 200
                text = http.get(f"{server.url}/metrics").text
                depths.append(float(next(line.split()[1] for line in text.splitlines()
                                         if line.startswith("glance_queue_depth "))))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: ask(server, "What is the total?", RECEIPT,
                                                  stream=bool(i % 2)), range(16)))
    finally:
        done.set()
        watcher.join(timeout=CLIENT_TIMEOUT_S)
    texts = ["".join(c.choices[0].delta.content or "" for c in a if c.choices) if i % 2 else a.choices[0].message.content
             for i, a in enumerate(answers)]
    assert texts == [ref] * 16
    assert max(depths) >= 1  # health and metrics answered while requests queued behind a decode
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'glance_requests_total{status="200"}' in metrics
    assert "glance_queue_wait_seconds_count" in metrics and "glance_tau_bucket" in metrics


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, format="PNG")  # ~100 MP in a file of a few KB
    return buf.getvalue()


def _png(size=(5000, 5000)) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size).save(buf, format="PNG")
    return buf.getvalue()


def _body(messages=None, **kw) -> dict:
    return {"model": MODEL_NAME, "messages": user("What is the total?") if messages is None else messages, **kw}


def _image(url: str) -> dict:
    return _body(user("What is the total?", url))


REFUSALS = {
    "malformed JSON": (b'{"model": ', 400, "invalid_json"),
    "not an object": (b'[1, 2]', 400, "invalid_request"),
    "messages not a list": (_body(messages="hi"), 400, "invalid_request"),
    "max_tokens a string": (_body(max_tokens="5"), 400, "invalid_request"),
    "unknown role": (_body(messages=[{"role": "robot", "content": "hi"}]), 400, "invalid_request"),
    "missing messages": ({"model": MODEL_NAME}, 400, "invalid_request"),
    "missing model": ({"messages": user("hi")}, 400, "invalid_request"),
    "empty messages": (_body(messages=[]), 400, "invalid_request"),
    "n over the bound": (_body(n=17), 400, "sampling_unsupported"),
    "top_logprobs without logprobs": (_body(top_logprobs=2), 400, "invalid_request"),
    "top_logprobs over 20": (_body(logprobs=True, top_logprobs=21), 400, "invalid_request"),
    "penalty": (_body(presence_penalty=0.5), 400, "sampling_unsupported"),
    "temperature over 2": (_body(temperature=2.5), 400, "invalid_request"),
    "a negative seed": (_body(temperature=0.7, seed=-1), 400, "invalid_sampling"),
    "unknown model": ({**_body(), "model": "gpt-4o"}, 404, "model_not_found"),
    "bad base64": (_image("data:image/png;base64,@@@not-base64@@@"), 400, "invalid_base64"),
    "not an image": (_image("data:image/png;base64,aGVsbG8gd29ybGQ="), 400, "invalid_image"),
    "decompression bomb": (_image("data:image/png;base64," + __import__("base64").b64encode(_bomb()).decode()), 400,
                           "image_too_large"),
    "image over the pixel cap": (_image("data:image/png;base64," + __import__("base64").b64encode(_png()).decode()),
                                 400, "image_too_large"),
    "remote URL": (_image("https://example.com/receipt.png"), 400, "remote_image_refused"),
    "path outside the media dir": (_image("file:///etc/passwd"), 400, "path_outside_media_dir"),
    "relative escape": (_image("file:../secret.png"), 400, "path_outside_media_dir"),
    "dot-dot escape": (lambda media: _image(f"file://{media}/../secret.png"), 400, "path_outside_media_dir"),
    "a link out of the media dir": (lambda media: _image((media / "link.png").as_uri()), 400,
                                    "path_outside_media_dir"),
    "missing media file": (lambda media: _image((media / "nothing.png").as_uri()), 400, "image_not_found"),
    "a text file as image": (lambda media: _image((media / "notes.txt").as_uri()), 400, "invalid_image"),
    "overflowing the context": (_body(messages=user("x " * 4000)), 400, "invalid_prompt"),
    "max_tokens over the cap": (_body(max_tokens=100_000), 400, "max_tokens_too_large"),
    "too many messages": (_body(messages=user("hi") * 9), 400, "too_many_messages"),
    "body too large": (_body(messages=user("x" * (3 << 20))), 413, "body_too_large"),
    **{f"unsupported {field}": (_body(**{field: value}), 400, "unsupported_field") for field, value in (
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "required"),
        ("functions", [{"name": "f"}]), ("function_call", "auto"), ("logit_bias", {"1": 5}),
        ("response_format", {"type": "json_object"}), ("parallel_tool_calls", True))},
    "a message's name": (_body(messages=[{"role": "user", "content": "hi", "name": "bob"}]), 400,
                         "unsupported_field"),
    "an unknown image detail": (_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,", "detail": "ultra"}}]}]), 400,
                                "invalid_request"),
    "JSON nested 100k deep": (b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json"),
    "a lone surrogate in the prompt": (json.dumps(_body(messages=user("total? \ud800"))).encode(), 400,
                                       "invalid_prompt"),
    "a NUL in a file name": (_image("file:///receipt%00.png"), 400, "invalid_image_url"),
    "a 5000-character file name": (_image("file:" + "a" * 5000 + ".png"), 400, "invalid_image_url"),
    "images over the request's pixels": (_body(messages=[{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": "data:image/png;base64," + __import__("base64").b64encode(
            _png((4096, 4096))).decode()}} for _ in range(5)), {"type": "text", "text": "hi"}]}]), 400,
                                         "request_pixels_too_large"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_requests_get_their_4xx_in_openais_shape_and_the_server_stays_healthy(server, expected, media, case):
    body, status, code = REFUSALS[case]
    body = body(media) if callable(body) else body
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw, timeout=CLIENT_TIMEOUT_S,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and "Traceback" not in r.text
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert ask(server, "Describe this.").choices[0].message.content == expected["Describe this."]["text"]


TEXT = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                  st.characters(max_codepoint=0x1F)), max_size=30)
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), TEXT),
                      lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
                      max_leaves=8)
FIELDS = ["stop", "stream", "temperature", "top_p", "n", "seed", "user", "logprobs", "top_logprobs", "stream_options",
          "tools", "response_format", "max_completion_tokens", "presence_penalty", "store", "metadata", "x"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, role=st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
       extra=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3), content=st.one_of(st.none(), VALUES))
def test_any_request_is_answered_or_refused_in_openais_shape(server, text, role, extra, content):
    """Arbitrary fields, values and text (lone surrogates, control characters): a 200 or a 4xx with OpenAI's
    error body; never a 500."""
    message = {"role": role, "content": text if content is None else content}
    body = {**extra, "model": MODEL_NAME, "messages": [message, {"role": "user", "content": text}], "max_tokens": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body).encode(), timeout=CLIENT_TIMEOUT_S,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and "\n" not in error["message"] and error["type"]


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_only_json_bodies_are_read(server, kind):
    """What a web page may post cross-origin without asking (a form, text) is refused as such: 415."""
    headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": kind} if kind else {})}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(_body()).encode(), headers=headers,
                   timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


def test_the_openai_client_raises_on_refusals(server):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        ask(server, "hi", top_logprobs=2)
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=user("hi"))


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_wrong_api_key_is_401(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
        r = httpx.request(method, f"{server.url}{path}", json=_body(), headers=headers, timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    if key:  # the client itself refuses to send no key at all
        with pytest.raises(openai.AuthenticationError):
            client(server, key).chat.completions.create(model=MODEL_NAME, messages=user("hi"))
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_models_lists_and_retrieves_the_served_model(server):
    assert [m.id for m in client(server).models.list()] == [MODEL_NAME]
    card = client(server).models.retrieve(MODEL_NAME)
    assert (card.id, card.object, card.owned_by) == (MODEL_NAME, "model", "glance")
    with pytest.raises(openai.NotFoundError) as missing:
        client(server).models.retrieve("nope/other")
    assert missing.value.body == {"message": "the model 'nope/other' does not exist here; this server serves "
                                             f"{MODEL_NAME!r}", "type": "invalid_request_error", "param": "model",
                                  "code": "model_not_found"}
    r = httpx.get(f"{server.url}/v1/models/{MODEL_NAME}", timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_dropped_stream_leaves_the_next_request_correct(server, expected):
    ref = expected["What is the total?"]["text"]
    for _ in range(3):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=CLIENT_TIMEOUT_S,
                          json=_body(user("What is the total?", data_url(RECEIPT)), stream=True),
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: the answer has begun; then hang up
    assert ask(server, "What is the total?", RECEIPT).choices[0].message.content == ref
    assert httpx.get(f"{server.url}/health").status_code == 200


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith(name))


def _client_cancels(server) -> float:
    return _metric(server, 'glance_cancelled_total{reason="client"}')


def test_plain_requests_whose_clients_leave_while_queued_are_cancelled(server, expected):
    """Whole requests are sent on raw connections and left once the server has queued them: a client timing
    out instead could give up before its request was even read (then there is nothing to cancel)."""
    before = _client_cancels(server)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(_image(data_url(RECEIPT))).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    clients = [socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S) for _ in range(48)]
    try:
        for sock in clients:
            sock.sendall(head + body)
        deadline = time.monotonic() + 60  # wait until most are queued behind the decode in progress
        while _metric(server, "glance_queue_depth") < 24 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        for sock in clients:  # the clients leave with dozens of decodes still ahead of the last of them
            sock.close()
    while _client_cancels(server) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _client_cancels(server) > before
    ref = expected["What is the total?"]["text"]
    assert ask(server, "What is the total?", RECEIPT).choices[0].message.content == ref
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_full_queue_answers_429_and_a_killed_server_restarts_cleanly(expected):
    srv = start_server("--max-queue", "1")
    port = srv.url.rsplit(":", 1)[1]
    try:
        barrier = threading.Barrier(12)

        def post(_):
            with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
                barrier.wait()
                return http.post(f"{srv.url}/v1/chat/completions", json=_body(user("What is the total?",
                                                                                   data_url(RECEIPT))))

        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(post, range(12)))
        busy = [r for r in replies if r.status_code == 429]
        assert busy and all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
                            for r in busy)
        ok = [r for r in replies if r.status_code == 200]
        assert len(ok) + len(busy) == 12 and len(ok) >= 2
        assert {r.json()["choices"][0]["message"]["content"] for r in ok} == {expected["What is the total?"]["text"]}
        srv.stop(signal.SIGKILL)
        srv = start_server("--port", port)  # the same port, at once
        assert srv.url.endswith(f":{port}")
        out = httpx.post(f"{srv.url}/v1/chat/completions", json=_body(user("Describe this.")),
                         timeout=CLIENT_TIMEOUT_S)
        assert out.json()["choices"][0]["message"]["content"] == expected["Describe this."]["text"]
    finally:
        srv.stop()


def test_a_request_over_its_timeout_is_504_and_the_server_carries_on(expected, tmp_path, monkeypatch):
    """Requests while the model loads are 503s, and one over its deadline a 504. The load is held until both were
    answered: in a fresh cache, opening the vocab graph waits for the lock on its optimised copy, which this test
    holds (a load takes well under a second, so a server let go could be ready before the second request)."""
    import onnxruntime

    from glance_runtime.backends.ort_cache import _entry
    from glance_runtime.defaults import DEFAULT_ARTIFACTS
    from glance_runtime.formats.artifacts import read as read_manifest
    from glance_runtime.store.cache import file_lock

    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path / "cache"))
    vocab = DEFAULT_ARTIFACTS / "vocab.onnx"
    entry = _entry(vocab, read_manifest(DEFAULT_ARTIFACTS).file_hashes["vocab.onnx"].sha256, ["CPUExecutionProvider"],
                   onnxruntime.__version__)
    held = file_lock(entry.with_name(f"{entry.name}.lock"))
    held.__enter__()
    released: list[bool] = []
    while_loading: list[httpx.Response] = []

    def release() -> None:  # the load goes on
        if not released:
            released.append(True)
            held.__exit__(None, None, None)

    def probe(url: str) -> None:
        try:
            while_loading.append(httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT_S))
            while_loading.append(httpx.post(f"{url}/v1/chat/completions", json=_body(), timeout=CLIENT_TIMEOUT_S))
        finally:
            release()

    try:
        srv = start_server("--timeout", "0.001", on_listening=probe)
    finally:
        release()
    try:
        health, early = while_loading
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert early.status_code == 503 and early.json()["error"]["code"] == "loading"
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=_body(user("What is the total?", data_url(RECEIPT))),
                       timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert "glance_cancelled_total" in httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()


@pytest.mark.parametrize("argv, message", [
    (["--host", "0.0.0.0"], "--api-key"),
    (["--media-dir", "/nonexistent/dir"], "--media-dir"),
    (["--max-queue", "0"], "--max-queue"),
    (["--port", "99999"], "--port"),
    (["--max-body-mb", "nan"], "--max-body-mb"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--max-request-pixels", "10", "--max-image-pixels", "100"], "--max-request-pixels"),
])
def test_unsafe_or_bad_flags_are_one_line_refusals(argv, message, capsys):
    try:
        code = serve_main(["--port", "0", *argv])
    except SystemExit as exc:  # a value argparse refuses
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_model_that_fails_to_load_ends_the_server_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "glance_runtime.serve", "--port", "0", "--artifacts", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "error: " in done.stderr and "manifest" in done.stderr and "Traceback" not in done.stderr
