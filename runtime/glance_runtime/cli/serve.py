"""`glance-serve`: one model on one device behind OpenAI's HTTP API.

One process holds one runner. With graphs exported with batched graphs it decodes up to --max-batch requests
together (default SERVE_MAX_BATCH, at most what the graphs were exported for), each answered exactly as alone;
--max-batch 1 decodes one request at a time, in arrival order. More devices mean more processes, one per
device, each on its own port, behind a load balancer (or Triton's model repository from `glance-export triton`).
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from .flags import OneLineParser, batch_flag, between, budget, check_dirs, guarded, positive, runner_flags
from ..defaults import BUDGET, RUN_MAX_NEW_TOKENS, SERVE_MAX_BATCH
from ..errors import GlanceError
from ..prompt.images import MAX_IMAGE_PIXELS as MAX_PIXELS
from ..serve.app import ServeConfig, create_app
from ..serve.engine import ModelSpec, default_batch, preflight
from ..serve.openai_errors import RequestError

LOOPBACK_NAMES = ("localhost",)
MAX_QUEUE = 100_000  # upper bounds of what a flag may set, each held in memory by the server
MAX_TOKENS = 1 << 20
MAX_BODY_MB = 1024
MAX_MESSAGES = 100_000
MAX_TIMEOUT_S = 7 * 24 * 3600


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-serve", description="OpenAI-compatible server for one GLANCE model "
                      "(greedy, lossless; requests decoded together, each as alone)")
    runner_flags(p)
    batch_flag(p, SERVE_MAX_BATCH)
    p.add_argument("--budget", type=budget, help="tree nodes verified per round besides the anchor, or auto "
                   f"(default: as glance-run, auto for exported graphs and engines, else {BUDGET})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; any but loopback needs --api-key (default: %(default)s)")
    p.add_argument("--port", type=between("--port", 0, 65535, "TCP ports"), default=8000,
                   help="port to bind; 0 picks a free one, printed at start (default: %(default)s)")
    p.add_argument("--api-key", help="required as `Authorization: Bearer KEY` on every endpoint but /health "
                   "(default: none, for loopback clients only)")
    p.add_argument("--media-dir", type=Path, help="directory whose files requests may name as file:// image URLs "
                   "(default: none, so only data: URLs)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model directory's name)")
    p.add_argument("--max-queue", type=between("--max-queue", 1, MAX_QUEUE, "requests held in memory"),
                   default=64, help="requests that may wait for a slot of the runner; more get 429 "
                   "(default: %(default)s)")
    p.add_argument("--timeout", type=positive("--timeout"), default=120.0,
                   help="seconds per request, queue wait included; later ones get 504 (default: %(default)g)")
    p.add_argument("--max-tokens", type=between("--max-tokens", 1, MAX_TOKENS, "tokens one answer may take"),
                   default=1024, help="the largest max_tokens a request may ask for (default: %(default)s); a "
                   f"request that names none gets {RUN_MAX_NEW_TOKENS} (as glance-run) or this, if fewer")
    p.add_argument("--max-body-mb", type=positive("--max-body-mb"), default=16.0,
                   help=f"largest request body, in MiB, at most {MAX_BODY_MB}; larger get 413 (default: %(default)g)")
    p.add_argument("--max-image-pixels", type=between("--max-image-pixels", 1, MAX_PIXELS,
                                                             "the largest image the runtime decodes"),
                   default=4096 * 4096, help="largest image, in pixels (default: %(default)s, 4096 x 4096)")
    p.add_argument("--max-request-pixels", type=between("--max-request-pixels", 1, 16 * MAX_PIXELS,
                                                               "every image of one request together"),
                   default=4 * 4096 * 4096, help="most pixels of all a request's images together "
                   "(default: %(default)s, four 4096 x 4096 images)")
    p.add_argument("--max-messages", type=between("--max-messages", 1, MAX_MESSAGES, "messages one request holds"),
                   default=64, help="most messages in one request (default: %(default)s)")
    return p


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(args: argparse.Namespace) -> None:
    """Refusals that need no model: an exposed port without a key, a key or name no client could send, missing
    directories, bad limits."""
    key = args.api_key
    if key is not None and not key.strip():
        raise GlanceError("--api-key is blank, so it would guard nothing; pass a real key, or drop --api-key to "
                          "serve this machine's clients without one")
    if key is not None and (key != key.strip() or not (key.isascii() and key.isprintable())):
        raise GlanceError("--api-key must be printable ASCII without spaces around it (clients send it in an "
                          "Authorization header); pass such a key")
    if args.served_model_name is not None and (not args.served_model_name.strip()
                                               or args.served_model_name != args.served_model_name.strip()):
        raise GlanceError("--served-model-name is blank or has spaces around it, which clients would have to send "
                          "as the model; pass a name such as glance-vl-tiny, or drop it for the model directory's")
    if not _is_loopback(args.host) and not args.api_key:
        raise GlanceError(f"binding {args.host} exposes the server beyond this machine; pass --api-key KEY too "
                          "(clients then send Authorization: Bearer KEY), or bind 127.0.0.1")
    check_dirs(args)
    if args.media_dir is not None and not args.media_dir.is_dir():
        raise GlanceError(f"--media-dir {args.media_dir} "
                          f"{'is not a directory' if args.media_dir.exists() else 'does not exist'}; "
                          "pass an existing directory")
    if args.timeout > MAX_TIMEOUT_S:
        raise GlanceError(f"--timeout {args.timeout:g} is over {MAX_TIMEOUT_S} s (a week); pass a smaller --timeout")
    if args.max_body_mb > MAX_BODY_MB:
        raise GlanceError(f"--max-body-mb {args.max_body_mb:g} is over {MAX_BODY_MB} (a body is held in memory "
                          f"whole); pass --max-body-mb up to {MAX_BODY_MB}")
    if args.max_request_pixels < args.max_image_pixels:
        raise GlanceError(f"--max-request-pixels {args.max_request_pixels} is below --max-image-pixels "
                          f"{args.max_image_pixels}; a request could not hold one image of the largest size")


def max_batch(args: argparse.Namespace, spec: ModelSpec) -> int:
    """--max-batch as given (torch refused above 1: it decodes one request at a time); unset, the default for
    what is served (`engine.default_batch`)."""
    if args.max_batch is None:
        return default_batch(spec)
    if args.max_batch > 1 and (spec.backend or "") == "torch":
        raise GlanceError(f"--max-batch {args.max_batch}: the torch reference decodes one request at a time; "
                          "pass --max-batch 1, or serve with --backend onnxruntime or tensorrt")
    return args.max_batch


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so the port is known (and printed) at once, and
    clients can already ask /health."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP by name: asyncio then sets TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections made from now on wait in the backlog until uvicorn accepts them
    except OSError as exc:
        sock.close()
        raise GlanceError(f"cannot bind {host}:{port} ({exc.strerror}); pick another --port or stop what holds it") \
            from None
    return sock


def http_protocol() -> type:
    """uvicorn's HTTP protocol, answering a request it cannot parse (a malformed Content-Length or request line)
    in OpenAI's JSON error shape rather than its text/plain 400: such a request never reaches the app."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class OpenAIShaped(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(RequestError(
                "the request is not valid HTTP/1.1 (a malformed request line or header, such as a Content-Length "
                "that is not a number); send a well-formed request", code="invalid_http").body()).encode()
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return OpenAIShaped


def run(args: argparse.Namespace) -> int:
    check(args)
    try:
        import uvicorn
    except ImportError:
        raise GlanceError("glance-serve needs its extra: pip install 'glance-toolkit[serve]'") from None
    spec = ModelSpec(model=args.model, head=args.head, artifacts=args.artifacts, engines=args.engines,
                     backend=args.backend, providers=args.provider, threads=args.threads, budget=args.budget,
                     max_context=args.max_context, max_tree=args.max_tree)
    batch = max_batch(args, spec)
    spec = replace(spec, max_batch=batch)
    preflight(spec)  # a flag the graphs cannot serve is refused before the server says it is listening
    config = ServeConfig(spec=spec, served_model_name=args.served_model_name, api_key=args.api_key,
                         media_dir=args.media_dir, max_queue=args.max_queue, timeout_s=args.timeout,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)), max_image_pixels=args.max_image_pixels,
                         max_request_pixels=args.max_request_pixels,
                         max_tokens=args.max_tokens, max_messages=args.max_messages)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    fatal: list[Exception] = []
    stopped: list[bool] = []  # the server stopped after answering every request it had
    server: uvicorn.Server | None = None

    def progress(line: str) -> None:
        print(f"glance-serve: {line}", file=sys.stderr, flush=True)

    def on_fatal(exc: Exception) -> None:
        fatal.append(exc)
        server.should_exit = True

    def on_ready(name: str, backend: str) -> None:
        progress(f"ready: {name} ({backend}, {batch} request{'s' * (batch != 1)} at once) on {url}")

    def on_stop() -> None:  # printed here, before uvicorn re-raises the signal it stopped on (SIGTERM ends us)
        if not fatal:
            stopped.append(True)
            progress("stopped")

    app = create_app(config, progress, on_fatal, on_ready, on_stop)
    service = app.state.service
    progress(f"listening on {url}; loading the model")
    # uvicorn picks httptools (the serve extra's C parser) where installed: it parses a request and writes its
    # answer about 0.3 ms sooner than h11, which uvicorn falls back to. Proxy headers off: nothing here reads
    # the client's address, so the middleware uvicorn would wrap around every request to rewrite it is skipped.
    signals: list[int] = []  # the stop signals the server took

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            """A first Ctrl-C lets the requests in flight finish: say so, since nothing else shows until then. The
            stop is taken before the line is written: a second Ctrl-C run inside this one, while the line is
            written, then cancels rather than saying it again."""
            signals.append(sig)
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and service.in_flight:
                progress(f"stopping after answering the requests in flight ({service.in_flight}); Ctrl-C again "
                         "cancels them")

    server = Server(uvicorn.Config(app, http=http_protocol(), log_level="warning", access_log=False, lifespan="on",
                                   proxy_headers=False))
    interrupted = False
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it stopped on
        interrupted = True
    if fatal:
        exc = fatal[0]
        raise exc if isinstance(exc, GlanceError) else GlanceError(f"the model failed to load: {exc}")
    if not stopped:  # a second Ctrl-C stopped it without waiting for the requests in flight
        dropped = service.dropped
        progress("stopped" + (f"; cancelled {dropped} request{'s' * (dropped != 1)} in flight" if dropped else ""))
    # uvicorn re-raises the signal it stopped on once it has shut down, but a Ctrl-C re-raised as the event loop
    # closes can be swallowed there; the exit code follows the signal taken, not whether the re-raise came through
    return 130 if interrupted or signal.SIGINT in signals else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="glance-serve: %(message)s")
    return guarded("glance-serve", lambda: run(parser().parse_args(argv)), interrupted="stopped")
