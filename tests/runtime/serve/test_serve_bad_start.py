"""`glance-serve` at its edges: flags no client could use are refused at start-up in one line; a client that
leaves mid-body is one log line, not an internal error; stopping says so in one line, with or without the
requests in flight; a directory or FIFO named as an image is called what it is, never opened. Each server is
live on a loopback port, answered by real clients and real signals."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import httpx
import pytest

from glance_runtime.cli.serve import main as serve_main
from support import MODEL_NAME, Server, start_server, user

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

WAIT_S = 60


@pytest.mark.parametrize("argv, flag", [
    (["--api-key", ""], "--api-key"),
    (["--api-key", "   "], "--api-key"),
    (["--api-key", "", "--host", "0.0.0.0"], "--api-key"),
    (["--api-key", "\t", "--host", "0.0.0.0"], "--api-key"),
    (["--api-key", " key "], "--api-key"),
    (["--api-key", "clé"], "--api-key"),
    (["--served-model-name", ""], "--served-model-name"),
    (["--served-model-name", "  "], "--served-model-name"),
    (["--served-model-name", " glance "], "--served-model-name"),
])
def test_a_key_or_name_no_client_could_send_is_refused_at_start(argv, flag, capsys):
    assert serve_main(["--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glance-serve: error: {flag}") and err.count("\n") == 1 and "Traceback" not in err


def _address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.05)


BODY = json.dumps({"model": MODEL_NAME, "max_tokens": 4, "messages": user("What is shown?")}).encode().ljust(1000)
FIRST = 10  # body bytes a half-sent request sends before waiting


def _half_sent(server: Server) -> socket.socket:
    """A connection whose chat request declares its whole body and has sent the first bytes, counted in flight."""
    before = _metric(server, "glance_requests_in_flight")
    conn = socket.create_connection(_address(server), timeout=WAIT_S)
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: glance\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY[:FIRST]))
    _until(lambda: _metric(server, "glance_requests_in_flight") > before, "the request is in flight")
    return conn


def _answer(conn: socket.socket) -> tuple[bytes, dict]:
    """The status line and JSON body the server sends before closing the connection (it is stopping)."""
    chunks = []
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
    conn.close()
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


def _lines_until(server: Server, pattern: str) -> list[str]:
    """stderr lines up to and including the first matching `pattern` (the server keeps running)."""
    lines: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while not lines or not re.search(pattern, lines[-1]):
        line = server.lines.next(deadline - time.monotonic())
        assert line is not None, f"stderr ended, or no line matched {pattern!r} in time: {lines}"
        lines.append(line)
    return lines


def _ended(server: Server) -> tuple[int, list[str]]:
    """The exit code and the rest of stderr, once the server has exited; no line of it is a failure's."""
    lines = server.lines.rest()
    assert not [line for line in lines if re.search("Traceback|Exception|internal error|ERROR", line)], lines
    return server.proc.wait(timeout=WAIT_S), lines


def _stops(lines: list[str]) -> int:
    return sum(line.startswith(("glance-serve: stopped", "glance-serve: stopping")) for line in lines)


def _ask(server: Server) -> dict:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 4,
                                                                 "messages": user("What is shown?")},
                      timeout=WAIT_S).json()


def test_a_client_that_leaves_mid_body_is_one_log_line_and_ctrl_c_says_stopped():
    server = start_server()
    try:
        for _ in range(2):
            _half_sent(server).close()
            _until(lambda: _metric(server, "glance_requests_in_flight") == 0, "the request is given up")
        assert _ask(server)["choices"][0]["message"]["content"]
        assert _metric(server, 'glance_requests_total{status="499"}') == 2
        server.proc.send_signal(signal.SIGINT)
        code, lines = _ended(server)
    finally:
        server.stop()
    assert code == 130 and lines[-1] == "glance-serve: stopped"
    assert lines.count("glance-serve: client went away before its request to /v1/chat/completions was read") == 2


@pytest.mark.parametrize("sig, ignore_sigint, exit_code", [(signal.SIGTERM, False, -signal.SIGTERM),
                                                          (signal.SIGINT, True, 130)],
                         ids=["sigterm", "sigint-to-a-background-job"])
def test_a_stop_signal_says_stopped_in_one_line(sig, ignore_sigint, exit_code):
    """SIGTERM ends the server by that signal; SIGINT with 130 (as Ctrl-C), also where it started with SIGINT
    ignored, as a shell's background job does (uvicorn's re-raise of the signal is then ignored)."""
    server = start_server(ignore_sigint=ignore_sigint)
    try:
        assert _ask(server)["choices"][0]["message"]["content"]
        server.proc.send_signal(sig)
        code, lines = _ended(server)
    finally:
        server.stop()
    assert code == exit_code and lines[-1] == "glance-serve: stopped" and _stops(lines) == 1


def test_ctrl_c_waits_for_the_request_in_flight_and_then_says_stopped():
    server = start_server()
    try:
        conn = _half_sent(server)
        server.proc.send_signal(signal.SIGINT)
        waiting = _lines_until(server, "stopping")
        assert waiting[-1] == "glance-serve: stopping after answering the requests in flight (1); Ctrl-C again " \
                              "cancels them"
        conn.sendall(BODY[FIRST:])
        status, answer = _answer(conn)
        code, lines = _ended(server)
    finally:
        server.stop()
    assert status == b"HTTP/1.1 200 OK" and answer["choices"][0]["message"]["content"]
    assert code == 130 and lines[-1] == "glance-serve: stopped" and _stops(lines) == 1


def test_a_second_ctrl_c_cancels_the_request_in_flight_with_a_503_and_says_so():
    server = start_server()
    try:
        conn = _half_sent(server)
        server.proc.send_signal(signal.SIGINT)
        _lines_until(server, "stopping after answering the requests in flight")
        server.proc.send_signal(signal.SIGINT)
        code, lines = _ended(server)
        status, answer = _answer(conn)
    finally:
        server.stop()
    assert status.startswith(b"HTTP/1.1 503") and answer["error"]["code"] == "server_stopped"
    assert code == 130 and lines[-1] == "glance-serve: stopped; cancelled 1 request in flight" and _stops(lines) == 1


def test_a_directory_or_fifo_under_the_media_dir_is_named_for_what_it_is(tmp_path):
    (tmp_path / "folder.png").mkdir()
    os.mkfifo(tmp_path / "pipe.png")
    server = start_server("--media-dir", str(tmp_path))
    try:
        for name, what in (("folder.png", "a directory"), ("pipe.png", "a named pipe")):
            messages = [{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": {"url": (tmp_path / name).as_uri()}},
                                                     {"type": "text", "text": "What is shown?"}]}]
            reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=WAIT_S,
                               json={"model": MODEL_NAME, "max_tokens": 4, "messages": messages})
            error = reply.json()["error"]
            assert reply.status_code == 400 and error["code"] == "not_an_image_file"
            assert what in error["message"] and "does not exist" not in error["message"]
        assert _ask(server)["choices"][0]["message"]["content"]
    finally:
        server.stop()
