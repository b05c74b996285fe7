"""The HTTP surface: OpenAI's chat completions, models, health and metrics, over one decode thread.

Starlette with uvicorn: a maintained ASGI stack whose server handles keep-alive, slow clients and
disconnects, and whose streaming response notices a client leaving, which is what lets a dropped stream
cancel its decode. Plain Starlette routes rather than FastAPI's: FastAPI's per-request dependency and
response machinery cost about 0.14 ms a request here and this app uses none of it. Requests are
validated by pydantic, from a body read under a size cap, so every refusal is OpenAI's error shape.
The model runs on one thread while the event loop keeps answering health and metrics: at --max-batch 1 one
request at a time, in arrival order (`DecodeQueue`); above it, requests join a running batch as slots free
(`BatchQueue` over the API's batch thread), each answered exactly as alone.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import math
import queue
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..defaults import RUN_MAX_NEW_TOKENS
from ..errors import GlanceError
from ..decode.sampling import derived
from ..formats.common import MAX_DEPTH, parse
from ..prompt.prompt_builder import Prompt
from .engine import Cancelled, Completion, Engine, Job, ModelSpec
from .openai_errors import RequestError
from .media import Opened, PixelBudget, open_image_url
from ..formats.logprobs import choice_logprobs, token_logprobs
from .metrics import Metrics
from .relay import Relay
from .schema import ChatRequest, parse_request

log = logging.getLogger("glance.serve")
CLIENT_CLOSED = 499  # the status logged for a request whose client left before the answer (no reply is sent)
PREPARED = object()  # a stream's first event: its prompt was accepted
ARRIVED = "glance.arrived"  # the scope key of a request's arrival (perf_counter), stamped before routing
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class ServeConfig:
    spec: ModelSpec = ModelSpec()
    served_model_name: str | None = None
    api_key: str | None = None
    media_dir: Path | None = None
    max_queue: int = 64  # requests waiting for the runner (those decoding not counted)
    timeout_s: float = 120.0  # arrival to last token, queue wait included
    max_body_bytes: int = 16 << 20
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 4 * 4096 * 4096  # all of a request's images together
    max_tokens: int = 1024  # the most a request may ask for
    default_max_tokens: int = RUN_MAX_NEW_TOKENS  # glance-run's default
    max_messages: int = 64


class DecodeQueue:
    """The one decode thread and its FIFO queue; the engine is created and used on that thread only.

    A bare thread on a `queue.SimpleQueue` rather than a ThreadPoolExecutor: handing a job over is one
    put, and its answer comes back as one `call_soon_threadsafe` that settles the awaited future, where
    `run_in_executor` chains a concurrent future into an asyncio one (locks and callbacks each way). In a
    loop-and-thread ping-pong on this machine a job started 0.03 ms after its put, against 0.10-0.13 ms
    through `run_in_executor`.
    """

    def __init__(self, config: ServeConfig, metrics: Metrics, progress: Callable[[str], None]):
        self.config, self.metrics, self.progress = config, metrics, progress
        self.engine: Engine | None = None
        self.waiting = 0
        self.lock = threading.Lock()
        self.decode_s = 0.1  # running mean of a decode, for Retry-After
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False

    def _serve(self) -> None:
        while (item := self.jobs.get()) is not None:
            loop, future, call = item
            result, exc = None, None
            if self.closed:
                exc = asyncio.CancelledError()
            else:
                try:
                    result = call()
                except BaseException as error:  # the awaiting request turns it into its answer
                    exc = error
            try:
                loop.call_soon_threadsafe(_settle, future, result, exc)
            except RuntimeError:  # the event loop has closed: nobody is left waiting
                pass

    def _put(self, call: Callable[[], Any]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned request's end is not an error
        self.jobs.put((loop, future, call))
        return future

    def load(self) -> "asyncio.Future[None]":
        def load() -> None:
            engine = Engine(self.config.spec, self.progress)
            engine.warm()
            # What loading made lives as long as the server: frozen, a full garbage collection skips it instead
            # of walking the tokenizer's and model's objects mid-request (tens of ms on the embedded default).
            gc.freeze()
            self.engine = engine

        threading.Thread(target=self._serve, name="glance-decode").start()  # stopped by close()
        return self._put(load)

    def submit(self, job: Job) -> "asyncio.Future[Completion]":
        submitted = time.monotonic()
        with self.lock:
            if self.waiting >= self.config.max_queue:
                retry = max(1, math.ceil(self.waiting * self.decode_s))
                raise RequestError(f"the queue is full ({self.waiting} requests waiting); retry in {retry} s",
                                   429, code="queue_full", type="rate_limit_error",
                                   headers={"Retry-After": str(retry)})
            self.waiting += 1
            self.metrics.queue_depth.set(self.waiting)

        def run() -> Completion:
            started = time.monotonic()
            with self.lock:
                self.waiting -= 1
                self.metrics.queue_depth.set(self.waiting)
            self.metrics.queue_wait.observe(started - submitted)
            self.metrics.busy.set(1)
            self.metrics.batch_active.set(1)
            try:
                return self._decode(job, (started - submitted) * 1e3)
            finally:
                self.metrics.busy.set(0)
                self.metrics.batch_active.set(0)
                self.decode_s = 0.8 * self.decode_s + 0.2 * (time.monotonic() - started)

        return self._put(run)

    def _decode(self, job: Job, queue_ms: float) -> Completion:
        """On the decode thread, at the head of the queue: the prompt is built only now, and the request costs
        two thread hand-offs in all."""
        if job.cancelled():  # the client left, or the time ran out, while the request waited
            raise Cancelled
        t0 = time.perf_counter()
        prompt = job.prepare()
        prepare_ms = (time.perf_counter() - t0) * 1e3
        completion = self.engine.complete(prompt, job.max_tokens, job.stops, emit=job.emit, cancelled=job.cancelled,
                                          sampling=job.sampling, logprobs=job.logprobs, on_tokens=job.on_tokens)
        completion.prepare_ms, completion.queue_ms = prepare_ms, queue_ms
        return completion

    def close(self) -> None:
        """Jobs still queued are cancelled; the one decoding finishes (the interpreter waits for it at exit)."""
        self.closed = True
        self.jobs.put(None)


class BatchQueue:
    """Requests decoded together (--max-batch above 1): each prompt is built on a small pool of threads
    (images decoded there, off the event loop and off the batch), then waits for a slot of the batch, which
    the API's batch thread fills at round boundaries."""

    PREPARE_THREADS = 2  # prompts built at once: enough to keep slots filled, few enough to bound pixel memory

    def __init__(self, config: ServeConfig, metrics: Metrics, progress: Callable[[str], None]):
        self.config, self.metrics, self.progress = config, metrics, progress
        self.engine: Engine | None = None
        self.preparing = 0
        self.lock = threading.Lock()
        self.decode_s = 0.1  # running mean of a request's decode, for Retry-After
        self.pool = ThreadPoolExecutor(self.PREPARE_THREADS, thread_name_prefix="glance-prepare")

    @property
    def waiting(self) -> int:
        """Requests waiting for a prompt thread or for a slot (those being built now are not waiting)."""
        scheduler = self.engine.model.scheduler if self.engine else None
        return max(self.preparing - self.PREPARE_THREADS, 0) + (scheduler.queued if scheduler else 0)

    def load(self) -> "asyncio.Future[None]":
        def load() -> None:
            engine = Engine(self.config.spec, self.progress)
            engine.warm()
            gc.freeze()  # as DecodeQueue.load: what loading made is skipped by full collections
            scheduler, m = engine.model.scheduler, self.metrics
            m.batch_slots.set(scheduler.capacity)
            m.batch_active.set_function(lambda: scheduler.active)
            m.busy.set_function(lambda: int(scheduler.active > 0))
            m.queue_depth.set_function(lambda: self.waiting)
            scheduler.on_round = m.batch_sequences.observe
            scheduler.on_prefill = lambda ms: m.batch_prefill.observe(ms / 1e3)
            self.engine = engine

        return asyncio.wrap_future(self.pool.submit(load))

    def submit(self, job: Job) -> "asyncio.Future[Completion]":
        with self.lock:
            waiting = self.waiting
            if waiting >= self.config.max_queue:
                retry = max(1, math.ceil(waiting * self.decode_s / self.engine.model.max_batch))
                raise RequestError(f"the queue is full ({waiting} requests waiting for a slot); retry in {retry} s",
                                   429, code="queue_full", type="rate_limit_error",
                                   headers={"Retry-After": str(retry)})
            self.preparing += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned request's end is not an error

        def settle(result: Completion | None, exc: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(_settle, future, result, exc)
            except RuntimeError:  # the event loop has closed: nobody is left waiting
                pass

        def finished(started: Future, prepare_ms: float) -> None:
            try:
                completion = started.result()
            except BaseException as exc:  # the awaiting request turns it into its answer
                settle(None, exc)
                return
            completion.prepare_ms = prepare_ms
            self.metrics.queue_wait.observe(completion.queue_ms / 1e3)
            self.decode_s = 0.8 * self.decode_s + 0.2 * completion.ms / 1e3
            settle(completion, None)

        def prepare() -> None:
            try:
                if job.cancelled():  # the client left, or the time ran out, while the request waited
                    raise Cancelled
                t0 = time.perf_counter()
                prompt = job.prepare()
                prepare_ms = (time.perf_counter() - t0) * 1e3
                started = self.engine.start(prompt, job.max_tokens, job.stops, job.emit, job.cancelled, job.sampling,
                                            job.logprobs, job.on_tokens)
            except BaseException as exc:
                settle(None, exc)
                return
            finally:
                with self.lock:
                    self.preparing -= 1
            started.add_done_callback(lambda f: finished(f, prepare_ms))

        self.pool.submit(prepare)
        return future

    def close(self) -> None:
        """Prompts not yet built are dropped; the batch thread stops after its round, failing what it holds."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the request was given up (its client left, its time ran out, or the server is stopping)
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    elif exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


class ClientLeft(Exception):
    """A waiting request's client closed its connection."""


class Watchdog:
    """Non-streamed requests waiting for their decode, checked by one task every POLL_S: one whose client
    has left or whose time has run out has its future failed (its decode then stops at its next round).

    One task for all rather than asyncio.wait with a timeout per request: a request then awaits its future
    directly, which saves a timer, the waiter's callbacks and a loop iteration on every answer (awaiting a
    settled future took 0.05 ms through asyncio.wait and 0.016 ms directly, in a hot loop on this machine).
    """

    POLL_S = 0.2

    def __init__(self, metrics: Metrics, timeout: Callable[[], RequestError]):
        self.metrics, self.timeout = metrics, timeout
        self.waiting: dict[asyncio.Future, tuple[Request, float]] = {}
        self.task: asyncio.Task | None = None

    async def until(self, request: Request, future: asyncio.Future, deadline: float) -> bool:
        """True once `future` is done (its result or error is the request's to read); False when the client
        left first; the timeout's 504 is the future's error past the deadline."""
        self.waiting[future] = (request, deadline)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())
        try:
            await future
        except ClientLeft:
            return False
        except Exception:  # the request's own error: it reads it from the future
            pass
        finally:
            self.waiting.pop(future, None)
        return True

    async def _run(self) -> None:
        while self.waiting:
            await asyncio.sleep(self.POLL_S)
            for future, (request, deadline) in list(self.waiting.items()):
                if future.done():
                    continue
                if time.monotonic() > deadline:
                    future.set_exception(self.timeout())
                elif await request.is_disconnected() and not future.done():
                    self.metrics.cancelled.labels("client").inc()
                    self.metrics.requests.labels(str(CLIENT_CLOSED)).inc()
                    future.set_exception(ClientLeft())


def _sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class Service:
    def __init__(self, config: ServeConfig, progress: Callable[[str], None], on_fatal: Callable[[Exception], None],
                 on_ready: Callable[[str, str], None]):
        self.config, self.on_fatal, self.on_ready = config, on_fatal, on_ready
        self.metrics = Metrics()
        self.runner = (BatchQueue if config.spec.max_batch > 1 else DecodeQueue)(config, self.metrics, progress)
        self.watchdog = Watchdog(self.metrics, self._timeout)
        self.ready = False
        self.in_flight = 0  # chat requests being read or answered now (what a stopping server waits for)
        self.dropped = 0  # chat requests cut off unanswered because the server stopped without waiting for them
        self.metrics.in_flight.set_function(lambda: self.in_flight)

    @property
    def name(self) -> str:
        return self.config.served_model_name or (self.runner.engine.name if self.runner.engine else "glance")

    async def start(self) -> None:
        try:
            await self.runner.load()
        except Exception as exc:  # any failure to load ends the server with its one-line reason
            self.on_fatal(exc)
            return
        self.ready = True
        self.on_ready(self.name, self.runner.engine.backend)

    # -- checks -----------------------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        """Only the served model exists here (404 in OpenAI's shape otherwise)."""
        if name != self.name:
            raise RequestError(f"the model {name!r} does not exist here; this server serves {self.name!r}", 404,
                               param="model", code="model_not_found")

    def card(self) -> dict[str, Any]:
        """The served model as OpenAI's model object."""
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "glance"}

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError("missing or wrong API key; send it as the header Authorization: Bearer KEY", 401,
                               code="invalid_api_key", type="authentication_error")

    async def body(self, request: Request) -> Any:
        """The JSON body, read under the size cap. Only `application/json` is parsed: a browser may post a form
        or text/plain to a loopback server from any page without asking, but not JSON."""
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "application/json":
            raise RequestError(f"the request body must be sent as Content-Type: application/json, not "
                               f"{kind or 'none'!r}", 415, code="unsupported_media_type")
        cap = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise RequestError(f"the request body is {declared} bytes, over this server's {cap}", 413,
                               code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise RequestError(f"the request body is over this server's {cap} bytes", 413, code="body_too_large")
            chunks.append(chunk)
        try:
            return parse(b"".join(chunks).decode("utf-8"))
        except UnicodeDecodeError:
            raise RequestError("the request body is not UTF-8 text", code="invalid_json") from None
        except ValueError as exc:
            where = f" (over this server's {MAX_DEPTH} levels)" if "nested" in str(exc) else ""
            raise RequestError(f"the request body is not valid JSON ({exc}{where})", code="invalid_json") from None

    def messages(self, req: ChatRequest) -> list[dict[str, Any]]:
        """OpenAI messages as the engine takes them: decoded images in place of their URLs. Every image's size
        is read from its header and counted against the request's pixel budget before any is decoded."""
        budget = PixelBudget(self.config.max_image_pixels, self.config.max_request_pixels)
        opened: list[Opened] = []

        def image(url: str) -> Opened:
            opened.append(open_image_url(url, self.config.media_dir, budget, self.config.max_body_bytes))
            return opened[-1]

        out = []
        try:
            for m in req.messages:
                content = m.content if isinstance(m.content, list) else [] if m.content is None else None
                if content is None:
                    parts = [{"type": "text", "text": m.content}]
                else:
                    parts = [{"type": "text", "text": p.text} if p.type == "text" else
                             {"type": "image", "image": image(p.image_url.url)} for p in content]
                out.append({"role": "system" if m.role == "developer" else m.role, "content": parts})
            for message in out:
                for part in message["content"]:
                    if part["type"] == "image":
                        part["image"] = part["image"].decode()
        finally:
            for each in opened:
                each.close()
        return out

    def prompt(self, req: ChatRequest, limit: int) -> Prompt:
        """The prompt (the runner times it: an in-process caller's share)."""
        try:
            return self.runner.engine.prepare(self.messages(req), limit)
        except GlanceError as exc:
            raise RequestError(str(exc), param="messages", code="invalid_prompt") from None

    def max_tokens(self, req: ChatRequest) -> int:
        asked = req.limit or min(self.config.default_max_tokens, self.config.max_tokens)
        if asked > self.config.max_tokens:
            raise RequestError(f"max_tokens {asked} is over this server's {self.config.max_tokens}; ask for fewer",
                               param="max_tokens", code="max_tokens_too_large")
        return asked

    # -- the endpoint -----------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        arrived = time.monotonic()
        self.authorize(request)
        req = parse_request(await self.body(request))
        req.refuse_sampling()
        sampling = req.sampling()
        if not self.ready:
            raise RequestError("the model is still loading; retry when GET /health answers 200", 503,
                               code="loading", type="server_error", headers={"Retry-After": "1"})
        self.check_model(req.model)
        if len(req.messages) > self.config.max_messages:
            raise RequestError(f"{len(req.messages)} messages is over this server's {self.config.max_messages}",
                               param="messages", code="too_many_messages")
        limit = self.max_tokens(req)
        cancel = threading.Event()
        deadline = arrived + self.config.timeout_s
        cancelled = lambda: cancel.is_set() or time.monotonic() > deadline  # noqa: E731
        events = Relay(asyncio.get_running_loop())  # stream: PREPARED per answer, and (answer, what it adds)
        put = events.put

        def prepare() -> Prompt:
            """On the runner's thread, once the request's turn comes: images are decoded only now."""
            prompt = self.prompt(req, limit)
            if req.stream:
                put(PREPARED)
            return prompt

        seeded = sampling if sampling.greedy else sampling.seeded()  # n answers derive from one seed
        if not req.stream:
            futures = self._submit([Job(prepare, limit, req.stops, None, cancelled, derived(seeded, i), req.reported)
                                    for i in range(req.choices)], cancel)
            together = asyncio.gather(*futures)
            try:
                if not await self.watchdog.until(request, together, deadline):
                    return Response(status_code=CLIENT_CLOSED)
                completions = self._result(together)
            finally:
                cancel.set()
            self._count(completions, arrived)
            return JSONResponse(self._response(completions, request))
        jobs = [Job(prepare, limit, req.stops, lambda piece, i=i: put((i, piece)), cancelled, derived(seeded, i),
                    req.reported, None if req.reported is None else lambda ids, reports, i=i: put((i, (ids, reports))))
                for i in range(req.choices)]  # an answer adds text pieces, (ids, reports) and None: its end
        futures = self._submit(jobs, cancel)
        for i, future in enumerate(futures):
            future.add_done_callback(lambda _, i=i: put((i, None)))
        first = asyncio.ensure_future(events.get())
        try:  # the status waits for the prompt: a refused one is still a 4xx, not an error inside a 200 stream
            if not await self._until(request, first, deadline):
                cancel.set()
                return Response(status_code=CLIENT_CLOSED)
            if first.result() is not PREPARED:
                self._result(futures[first.result()[0]])  # ended before its prompt was accepted: raises its refusal
        except BaseException:
            cancel.set()
            first.cancel()
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(self._stream(request, futures, events, cancel, deadline, arrived, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _submit(self, jobs: list[Job], cancel: threading.Event) -> list[asyncio.Future]:
        """Every answer's job queued, or none: a refusal (a full queue) cancels those queued before it."""
        futures = []
        try:
            for job in jobs:
                futures.append(self.runner.submit(job))
        except BaseException:
            cancel.set()
            raise
        return futures

    async def _until(self, request: Request, waitable: asyncio.Future, deadline: float) -> bool:
        """For a stream's first event: True once `waitable` is done; False when the client left first (the
        decode is then cancelled at its next round); the timeout's 504 past the deadline."""
        while True:
            done, _ = await asyncio.wait({waitable}, timeout=min(0.2, max(deadline - time.monotonic(), 0)))
            if done:
                return True
            if time.monotonic() > deadline:
                raise self._timeout()
            if await request.is_disconnected():
                self.metrics.cancelled.labels("client").inc()
                self.metrics.requests.labels(str(CLIENT_CLOSED)).inc()
                return False

    def _result(self, future) -> Completion:
        try:
            return future.result()
        except Cancelled:
            raise self._timeout() from None
        except GlanceError as exc:
            raise RequestError(str(exc), code="invalid_prompt") from None

    def _timeout(self) -> RequestError:
        self.metrics.cancelled.labels("timeout").inc()
        return RequestError(f"the request took over this server's {self.config.timeout_s:g} s timeout", 504,
                            code="timeout", type="server_error")

    async def _stream(self, request: Request, futures: list[asyncio.Future], events: Relay, cancel: threading.Event,
                      deadline: float, arrived: float, include_usage: bool) -> AsyncIterator[bytes]:
        """Every answer's chunks as its rounds commit (choice i's carry index i), each answer's last with its finish
        reason and glance figures once it ends, then the usage of them all."""
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        spelling = self.runner.engine.spelling

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            return _sse({"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.name,
                         "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                      **({"logprobs": extra.pop("logprobs")} if "logprobs" in extra else {})}],
                         **extra})

        def item(index: int, payload: str | tuple | None) -> bytes:
            if isinstance(payload, str):
                return chunk(index, {"content": payload})
            if payload is not None:
                return chunk(index, {"content": ""}, logprobs={"content": token_logprobs(*payload, spelling)})
            completion = completions[index] = self._result(futures[index])
            return chunk(index, {}, completion.finish_reason, glance=self._glance(completion, request))

        finished = False
        completions: list[Completion | None] = [None] * len(futures)
        try:
            yield b"".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(len(futures)))
            while any(c is None for c in completions):  # the items that arrived together leave in one write
                batch = await asyncio.wait_for(events.batch(), max(deadline - time.monotonic(), 0))
                if out := [item(*event) for event in batch if event is not PREPARED]:
                    yield b"".join(out)
            self._count(completions, arrived)
            if include_usage:
                yield _sse({"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.name,
                            "choices": [], "usage": self._usage(*completions)})
            yield _sse("[DONE]")
            finished = True
        except (asyncio.TimeoutError, RequestError) as exc:
            error = exc if isinstance(exc, RequestError) else self._timeout()
            self.metrics.requests.labels(str(error.status)).inc()
            yield _sse(error.body())
            finished = True
        finally:
            cancel.set()
            if not finished:
                self.metrics.cancelled.labels("client").inc()
                self.metrics.requests.labels(str(CLIENT_CLOSED)).inc()

    # -- answers ----------------------------------------------------------------------------------------

    def _count(self, answers: list[Completion], arrived: float) -> None:
        """One request answered (with one or more answers to one prompt)."""
        m = self.metrics
        m.requests.labels("200").inc()
        m.prompt_tokens.inc(answers[0].prompt_tokens)
        for c in answers:
            m.completion_tokens.inc(len(c.token_ids))
            if c.rounds:
                m.tau.observe(c.tau)
        m.latency.observe(time.monotonic() - arrived)

    @staticmethod
    def _usage(*answers: Completion) -> dict[str, int]:
        """OpenAI's usage: the prompt once, every answer's tokens."""
        completion = sum(len(c.token_ids) for c in answers)
        return {"prompt_tokens": answers[0].prompt_tokens, "completion_tokens": completion,
                "total_tokens": answers[0].prompt_tokens + completion}

    def _glance(self, c: Completion, request: Request) -> dict[str, Any]:
        """GLANCE's own figures: acceptance, the wait for the runner, the time an in-process caller would have
        spent (prepare: images and tokens; decode: the answer), the server's whole time, from the request's
        arrival at the app to this answer's last chunk being formed, so a client can tell what HTTP added, and the
        seed a sampled answer was drawn with (send it back as `seed` to get the same answer)."""
        engine = self.runner.engine
        return {"tau": round(c.tau, 4), "rounds": c.rounds, "prefill_tokens": c.prefill_tokens,
                "backend": engine.backend if engine else None, "budget": engine.budget if engine else None,
                "queue_ms": round(c.queue_ms, 3), "prepare_ms": round(c.prepare_ms, 3), "decode_ms": round(c.ms, 3),
                "server_ms": round((time.perf_counter() - request.scope[ARRIVED]) * 1e3, 3), "seed": c.seed}

    def _response(self, answers: list[Completion], request: Request) -> dict[str, Any]:
        """OpenAI's chat completion; the glance object is the first answer's (answer i sampled with its seed + i)."""
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                                                 "finish_reason": c.finish_reason,
                                                 "logprobs": choice_logprobs(c.token_ids, c.logprobs,
                                                                             self.runner.engine.spelling)}
                                                for i, c in enumerate(answers)],
                "usage": self._usage(*answers), "glance": self._glance(answers[0], request)}


class Arrival:
    """Stamps each request's arrival before routing, and counts the chat requests in flight (a pure ASGI
    wrapper).

    A server stopped without waiting for its requests (a second Ctrl-C) cancels their tasks: each is answered
    503 here (or its started answer ended) and counted, rather than logged as uvicorn's traceback of
    CancelledError."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        scope[ARRIVED] = time.perf_counter()
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chat = int(scope["path"] == CHAT_PATH)
        started = answered = False

        def done() -> None:
            nonlocal answered
            if chat and not answered:
                self.service.in_flight -= 1
            answered = True

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done()  # before the client can see its answer end: it is no longer in flight
            await send(message)

        if chat:
            self.service.in_flight += 1
        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not answered:
                self.service.dropped += chat
                await self._abandon(send, started)
        finally:
            done()

    @staticmethod
    async def _abandon(send, started: bool) -> None:
        """End a request the stopping server will not answer: a 503 in OpenAI's shape, or the end of its body."""
        try:
            if not started:
                error = RequestError("the server stopped before answering this request; retry once it is back", 503,
                                     code="server_stopped", type="server_error")
                body = json.dumps(error.body()).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            else:
                await send({"type": "http.response.body", "body": b""})
        except (OSError, RuntimeError):  # the connection is already gone: nothing left to end
            pass


def create_app(config: ServeConfig, progress: Callable[[str], None] = lambda _: None,
               on_fatal: Callable[[Exception], None] = lambda exc: None,
               on_ready: Callable[[str, str], None] = lambda name, backend: None,
               on_stop: Callable[[], None] = lambda: None) -> Starlette:
    """The ASGI app; the model loads (and warms) in the background once the server starts. `on_stop` is called
    once the server has stopped after answering every request it had (not when it was forced to stop sooner)."""
    service = Service(config, progress, on_fatal, on_ready)
    tasks: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        tasks.add(asyncio.create_task(service.start()))
        try:
            yield
        except asyncio.CancelledError:  # a forced stop skips the shutdown: the command reports what it cut off
            service.runner.close()
            return
        service.runner.close()
        on_stop()

    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        if request.url.path == CHAT_PATH:
            service.metrics.requests.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(RequestError(str(exc.detail), exc.status_code, code=str(exc.status_code)).body(),
                            status_code=exc.status_code)

    async def gone(request: Request, _exc: ClientDisconnect) -> Response:
        """A client that closed its connection mid-body: nothing to answer, and no fault of the server's."""
        log.warning("client went away before its request to %s was read", request.url.path)
        if request.url.path == CHAT_PATH:
            service.metrics.requests.labels(str(CLIENT_CLOSED)).inc()
        return Response(status_code=CLIENT_CLOSED)

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        if request.url.path == CHAT_PATH:
            service.metrics.requests.labels("500").inc()
        return JSONResponse(RequestError("internal server error; the server's log has the details", 500,
                                         code="internal_error", type="server_error").body(), status_code=500)

    async def models(request: Request) -> JSONResponse:
        service.authorize(request)
        return JSONResponse({"object": "list", "data": [service.card()]})

    async def model(request: Request) -> JSONResponse:
        service.authorize(request)
        service.check_model(request.path_params["model"])
        return JSONResponse(service.card())

    async def health(_request: Request) -> JSONResponse:
        if service.ready:
            return JSONResponse({"status": "ok", "model": service.name})
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics(request: Request) -> Response:
        service.authorize(request)
        return Response(service.metrics.text(), media_type="text/plain; version=0.0.4")

    routes = [Route(CHAT_PATH, service.chat, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    app = Starlette(routes=routes, middleware=[Middleware(Arrival, service=service)], lifespan=lifespan,
                    exception_handlers={RequestError: refused, HTTPException: http_error, ClientDisconnect: gone,
                                        Exception: internal})
    app.state.service = service
    return app
