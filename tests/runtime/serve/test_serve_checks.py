"""`glance-serve` checks a request whole before answering it: a bad field of a streamed request is the same 400 in
OpenAI's JSON shape as unstreamed (never a 200 whose stream then carries the error), content parts it cannot read
are refused by their type, a request HTTP itself cannot parse is still answered in OpenAI's shape, and flags the
graphs cannot serve are refused before the server says it is listening. Live servers on loopback ports, driven by
the official `openai` client, httpx and raw sockets."""
from __future__ import annotations

import json
import re
import socket

import httpx
import openai
import pytest

from glance_runtime.cli.serve import main as serve_main, parser
from support import MODEL_NAME, RECEIPT, data_url, start_server, user

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

TIMEOUT_S = 60
BAD_FIELDS = {  # a field at fault: (the request's extra fields, its messages, the param named)
    "an empty stop string": ({"stop": [""]}, user("What is the total?"), "stop.0"),
    "a lone surrogate in a stop string": ({"stop": "a\ud800"}, user("What is the total?"), "stop"),
    "a lone surrogate in a message": ({}, [{"role": "user", "content": "total? \ud800"}], "messages.0.content"),
    "a lone surrogate in a text part": ({}, user("total? \ud800"), "messages.0.content.0.text"),
    "a lone surrogate in a system message": ({}, [{"role": "system", "content": "\udfff"}, *user("hi")],
                                             "messages.0.content"),
}


@pytest.fixture(scope="module", params=["batched", "one-at-a-time"])
def server(request):
    srv = start_server(*(["--max-batch", "1"] if request.param == "one-at-a-time" else []))
    yield srv
    srv.stop()


def _post(server, body: dict) -> httpx.Response:
    """The body as JSON text: a lone surrogate goes out as its \\ud800 escape, as a client's JSON encoder sends it."""
    return httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body).encode(), timeout=TIMEOUT_S,
                      headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_a_bad_field_is_a_400_in_openais_shape_streamed_or_not(server, case, stream):
    extra, messages, param = BAD_FIELDS[case]
    r = _post(server, {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "stream": stream, **extra})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


def test_the_openai_client_gets_a_bad_streamed_stop_as_its_400(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    with pytest.raises(openai.BadRequestError, match="stop.0 is an empty string"):
        client.chat.completions.create(model=MODEL_NAME, messages=user("What is the total?"), stop=[""],
                                       stream=True)
    pieces = client.chat.completions.create(model=MODEL_NAME, messages=user("What is the total?"), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)  # the server carries on


@pytest.mark.parametrize("detail", ["auto", "low", "high"])
def test_every_image_detail_is_accepted_and_changes_nothing(server, detail):
    def ask(image_url: dict) -> str:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": image_url},
                                                 {"type": "text", "text": "What is the total?"}]}]
        r = _post(server, {"model": MODEL_NAME, "messages": messages, "max_tokens": 16})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    url = data_url(RECEIPT)
    assert ask({"url": url, "detail": detail}) == ask({"url": url})


@pytest.mark.parametrize("part, kind", [
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "input_audio"),
    ({"type": "file", "file": {"file_id": "f"}}, "file"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video_url"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_an_unsupported_content_part_is_refused_by_its_type(server, part, kind, stream):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    r = _post(server, {"model": MODEL_NAME, "messages": messages, "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_content_part" and error["param"] == "messages.0.content.1"
    assert repr(kind) in error["message"] and "'text'" in error["message"] and "'image_url'" in error["message"]
    assert "should be a valid string" not in error["message"]


@pytest.mark.parametrize("length", [b"abc", b"-5", b"12x", b"1, 2"])
def test_a_malformed_content_length_is_a_400_in_openais_shape(server, length):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: glance\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + length + b"\r\n\r\n{}")
        chunks = []
        while chunk := conn.recv(1 << 16):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert lines[0] == "HTTP/1.1 400 Bad Request" and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http" and "Content-Length" in error["message"]
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT_S).status_code == 200


@pytest.mark.parametrize("argv, flag", [
    (["--max-context", "13"], "--max-context 13"),
    (["--max-context", "100000000"], "--max-context 100000000"),
    (["--max-tree", "100000"], "--max-tree 100000"),
    (["--budget", "100000"], "--budget 100000"),
    (["--max-batch", "100000"], "--max-batch 100000"),
    (["--provider", "no-such-provider"], "execution provider 'no-such-provider'"),
])
def test_a_flag_the_graphs_cannot_serve_is_refused_before_listening(argv, flag, capsys):
    assert serve_main(["--port", "0", "--threads", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glance-serve: error: {flag}") and err.count("\n") == 1
    assert "listening" not in err and "Traceback" not in err


def test_a_max_context_too_small_for_the_template_names_the_smallest_that_serves(capsys):
    """The refusal names --max-context and its smallest workable value (never a prompt the user did not send),
    and that value serves while one less is refused."""
    assert serve_main(["--port", "0", "--threads", "1", "--max-context", "3"]) == 2
    err = capsys.readouterr().err
    assert "prompt longer" not in err
    smallest = int(re.fullmatch(r"glance-serve: error: --max-context 3 .*; pass --max-context (\d+) or more\n",
                                err).group(1))
    assert serve_main(["--port", "0", "--threads", "1", "--max-context", str(smallest - 1)]) == 2
    assert f"pass --max-context {smallest} or more" in capsys.readouterr().err
    srv = start_server("--max-context", str(smallest))
    try:
        r = _post(srv, {"model": MODEL_NAME, "messages": user("Hello"), "max_tokens": 1})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_help_describes_every_flag_and_shows_every_default(capsys):
    p = parser()
    formatter = p._get_formatter()
    for action in p._actions:
        if action.dest in ("help", "version"):
            continue
        text = formatter._expand_help(action)
        assert "default" in text and not text.startswith("default"), f"{action.option_strings[0]}: {text!r}"
        if action.default is not None:
            assert str(action.default) in text or f"{action.default:g}" in text, (action.option_strings[0], text)
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # as wrapped to no width
    for shown in ("(default: 8000)", "(default: 64)", "(default: 120)", "(default: 1024)", "(default: 16)"):
        assert shown in out


def test_a_request_naming_no_max_tokens_gets_at_most_the_servers_cap():
    """A --max-tokens below glance-run's default caps the default too: a request that names no max_tokens is
    answered, never refused for a number it did not send."""
    srv = start_server("--max-tokens", "2")
    try:
        r = _post(srv, {"model": MODEL_NAME, "messages": user("What is the total?")})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        srv.stop()
