"""The Python API an application embeds: load a model once, then generate, stream and chat.

    import glance_runtime as gr
    with gr.load() as model:
        print(model.generate("What is the total?", images=["receipt.png"]).text)

Defaults are `glance-run`'s (the same backend choice, budget policy, stop ids and answer length), so
`generate` returns exactly its tokens: a Model is a `session.Session` (the commands' one way to decode with an
opened backend) with conversations, streamed text and stop strings around it, and every call goes
through one internal function (`Model._run`: prompt in, decode, text out).
A conversation (`Model.chat`) keeps what the backend has committed: each turn prefills only the
rows after the prefix it shares with the last one (`prefix.shared_rows`), and its answer is
token-identical to decoding the whole conversation from scratch, because the kept rows are the
rows a fresh prefill would compute and the loop is lossless.
A server whose clients resend the whole conversation each turn (OpenAI's HTTP API) uses `Model.reuse`
instead: a handle that decodes prompts made with `build`, keeps whatever rows each shares with the one
before, and can be stopped between rounds.
A Model loaded with `max_batch` > 1 decodes the calls of several threads together: each call is a request
to one batch thread (`batching.Scheduler`) and waits for its answer, which is token for token the answer
decoded alone; each slot of the batch keeps its last request's rows for whichever prompt shares most of them.
"""
from __future__ import annotations

import queue
import reprlib
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence, TypeVar

import numpy as np

from .defaults import AUTO, BRANCH_K, RUN_MAX_NEW_TOKENS as MAX_NEW_TOKENS, resolve
from .errors import GlanceError, InputError
from .decode.limits import check_context, check_settings, check_speculation, whole
from .decode.loop import DecodeConfig, DecodeResult, RoundLog
from .decode.sampling import GREEDY, SamplingParams, TokenLogprob, derived, logprob_count, sampling_params
from .prompt.messages import ImageLike, VideoLike, conversation, user_turn
from .prompt.prompt_builder import Prompt, check_unicode
from .prompt.prefix_reuse import Committed, image_runs, shared_rows
from .backends.batch_rounds import open_batch
from .backends.registry import BACKENDS, Source, open_session
from .batching import Answer, Done, OnTokens, Scheduler, Ticket
from .decode.session import Session, Settings

T = TypeVar("T")
PROMPT_KEYS = ("prompt", "images", "messages", "system", "videos")  # what one item of a list of prompts may name
ROOM_FIX = "shorten the prompt, lower max_new_tokens, or load with a larger max_context"


def _answer_length(max_new_tokens: int) -> int:
    """An int (numpy's integers included, as for `load`'s settings) of at least 1."""
    return whole("max_new_tokens", max_new_tokens, 1)


def _stops(stop: str | Sequence[str]) -> list[str]:
    """`stop` as a list of non-empty strings of valid Unicode (one string is one stop string)."""
    if not isinstance(stop, (str, list, tuple)):
        raise InputError(f"stop must be a string or a list of strings, got {type(stop).__name__}; pass "
                         "stop=[\"\\n\\n\"] or stop=()")
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InputError(f"every stop string must be a non-empty string, got {type(s).__name__} "
                             f"{reprlib.repr(s)}; drop it or pass text")
        check_unicode(s, "a stop string")
    return stops


def _prompt(prompt: object) -> Prompt:
    """A Prompt as `Model.build` makes it; anything else is refused before it is measured or decoded."""
    if not isinstance(prompt, Prompt):
        raise InputError(f"expected a Prompt from model.build(...), got {type(prompt).__name__}; build the prompt "
                         "first: model.build(text, images=[...])")
    return prompt


@dataclass(frozen=True)
class Output:
    """One answer: its text (stop string excluded), the generated ids, tokens per round, and measurements
    (and the per-round log, for tools that report it)."""

    text: str
    token_ids: list[int]
    tau: float
    stats: dict[str, Any] = field(default_factory=dict)
    rounds: list[RoundLog] = field(default_factory=list, repr=False)
    seed: int | None = None  # the seed it was sampled with (drawn where none was given); None: greedy
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # per token id, where asked for


class Model:
    """A loaded model. Loaded with max_batch 1 (the default) it is not thread-safe: its backend holds one KV
    cache and one set of device buffers, so a call made while another thread's call runs is refused
    (GlanceError); use one Model per thread, or hold a lock around every call. Loaded with max_batch > 1,
    calls from any number of threads are decoded together, up to max_batch at once (the rest wait for a slot)."""

    def __init__(self, session: Session, max_batch: int = 1):
        self._session: Session | None = session
        self._lock = threading.Lock()
        self._owner: Chat | None = None  # the conversation whose rows the backend holds now (max_batch 1)
        self._scheduler: Scheduler | None = None
        if max_batch > 1:
            session.config  # resolved now: once the batch thread runs, it alone uses the backend
            self._scheduler = Scheduler(open_batch(session), session.codec)

    @property
    def max_batch(self) -> int:
        """Requests decoded together at most."""
        return self._scheduler.capacity if self._scheduler is not None else 1

    @property
    def scheduler(self) -> Scheduler | None:
        """The batch thread of a model loaded with max_batch > 1 (its occupancy, for servers), else None."""
        return self._scheduler

    @property
    def session(self) -> Session:
        if self._session is None:
            raise GlanceError("this model is closed; load another with glance_runtime.load()")
        return self._session

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the backend's device buffers and graphs now rather than at garbage collection."""
        with self._busy():
            if self._scheduler is not None:
                self._scheduler.close()  # requests still waiting or decoding fail
            if self._session is not None:
                self._session.close()
            self._session = self._owner = self._scheduler = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _busy(self) -> Iterator[None]:
        if self._scheduler is not None:  # the batch thread serialises the backend's use
            yield
            return
        if not self._lock.acquire(blocking=False):
            raise GlanceError("this model is already decoding in another call (a Model is not thread-safe); use "
                              "one Model per thread, or hold a lock around its calls")
        try:
            yield
        finally:
            self._lock.release()

    # -- the public calls ------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[str | dict[str, Any]] | None = None, *,
                 images: Sequence[ImageLike] | None = None,
                 messages: Sequence[dict[str, Any]] | None = None, system: str | None = None,
                 max_new_tokens: int = MAX_NEW_TOKENS, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None,
                 videos: Sequence[VideoLike] | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 logprobs: int | None = None) -> Output | list[Output]:
        """Answer one prompt (with any number of images and videos, each a list even for one: images=["a.png"];
        a video is its frames, taken at 2 per second unless given as {"video": frames, "fps": rate}) or one
        OpenAI-style conversation; `stop` is one string or a list of them; `on_text` sees the text in pieces as
        rounds commit, on this thread (what `stream` yields).

        A list of prompts is answered as one batch, one Output per prompt in order: each item is a string, or a
        dict of this call's prompt arguments ({"prompt": ..., "images": [...]}, or {"messages": [...]});
        `max_new_tokens`, `stop` and the sampling settings apply to each (a list sampled from one seed gives each
        prompt its own, derived from it: `sampling.derived`).

        temperature 0 (the default) decodes greedily; above 0 each token is sampled from the target's distribution
        at that temperature, truncated by top_k (0: off), top_p (1: off) and min_p (0: off), with noise keyed by
        `seed` (drawn when None, and reported as Output.seed) and the token's position in the answer: for a seed,
        the answer is the same with the draft on or off, at any budget, alone or in a batch.

        `logprobs` n (0..20; None: off) reports, in Output.logprobs, each token's log-prob under the target's
        untempered distribution at its position and the n best alternatives there (as OpenAI's logprobs and
        top_logprobs): the same with the draft on or off, up to the float rounding of the pass that computed them."""
        sampling, count = sampling_params(temperature, top_p, top_k, min_p, seed), logprob_count(logprobs)
        if isinstance(prompt, (list, tuple)):
            if any(v is not None for v in (images, messages, system, videos, on_text)):
                raise InputError("with a list of prompts, give each one's images, messages, system or videos in its "
                                 "own dict ({\"prompt\": ..., \"images\": [...]}), and no on_text")
            return self._many(prompt, max_new_tokens, stop, sampling, count)
        with self._busy():
            built = self.build(prompt, images=images, messages=messages, system=system, videos=videos)
            return self._run(built, max_new_tokens, stop, on_piece=on_text, sampling=sampling, logprobs=count)

    def stream(self, prompt: str | None = None, *, images: Sequence[ImageLike] | None = None,
               messages: Sequence[dict[str, Any]] | None = None, system: str | None = None,
               max_new_tokens: int = MAX_NEW_TOKENS, stop: Sequence[str] = (),
               videos: Sequence[VideoLike] | None = None, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
               logprobs: int | None = None) -> "Stream":
        """`generate`'s text in pieces as rounds commit; the pieces join to exactly its text, and once they are
        exhausted the stream's `output` is `generate`'s Output. Closing the stream early ends decoding after
        the current round."""
        sampling, count = sampling_params(temperature, top_p, top_k, min_p, seed), logprob_count(logprobs)
        return Stream(self._streamed(prompt, images, messages, system, max_new_tokens, stop, videos, sampling, count))

    def _streamed(self, prompt, images, messages, system, max_new_tokens, stop, videos,
                  sampling: SamplingParams, logprobs: int | None) -> Generator[str, None, Output]:
        with self._busy():
            built = self.build(prompt, images=images, messages=messages, system=system, videos=videos)
            return (yield from self._pieces(lambda on_piece, cancel: self._run(built, max_new_tokens, stop,
                                                                                on_piece=on_piece,
                                                                                cancelled=cancel.is_set,
                                                                                sampling=sampling,
                                                                                logprobs=logprobs)))

    def chat(self, system: str | None = None) -> "Chat":
        """A conversation that keeps its KV between turns."""
        return Chat(self, system)

    def build(self, prompt: str | None = None, *, images: Sequence[ImageLike] | None = None,
              messages: Sequence[dict[str, Any]] | None = None, system: str | None = None,
              videos: Sequence[VideoLike] | None = None) -> Prompt:
        """The prompt (ids, pixels, grids) a call would decode."""
        return self.session.build(conversation(prompt, images, messages, system, videos))

    def reuse(self) -> "Reuse":
        """A handle that decodes built prompts, keeping the rows each shares with the previous one."""
        return Reuse(self)

    def check_room(self, prompt: Prompt, max_new_tokens: int = MAX_NEW_TOKENS, *, fix: str = ROOM_FIX) -> None:
        """Refuse (LimitError, ending with `fix`: what the caller's user can change) a prompt whose answer could
        overflow the context, before any work is queued for it."""
        check_context(_prompt(prompt).length, _answer_length(max_new_tokens), self.session.max_context, fix)

    @property
    def budget(self) -> int | str:
        """The verify tree's node budget every call uses: "auto", a count, or 0 without speculation."""
        cfg = self.session.config
        return AUTO if cfg.auto else cfg.budget if cfg.speculative else 0

    # -- the one internal path -------------------------------------------------------------------

    def submit(self, prompt: Prompt, *, max_new_tokens: int = MAX_NEW_TOKENS, stop: Sequence[str] = (),
               on_text: Callable[[str], None] | None = None,
               cancelled: Callable[[], bool] | None = None, sampling: SamplingParams = GREEDY,
               logprobs: int | None = None, on_tokens: OnTokens | None = None) -> "Future[Output]":
        """Queue a prompt made with `build` and return at once: the future settles with its Output. For servers
        on a model loaded with max_batch > 1: `on_text` and `cancelled` (asked each round; True ends the answer
        there, finish "cancelled") run on the batch thread, and either raising fails this future alone, with its
        error. At max_batch 1 the answer is decoded now, on this thread, and the future is already settled.
        `sampling`: `sampling_params`' settings (greedy by default); `logprobs`: as `generate`'s, and `on_tokens`
        sees each round's kept tokens and their reports, after their text reached `on_text` (on the same thread)."""
        count = logprob_count(logprobs)
        if self._scheduler is None:
            future: Future = Future()
            try:
                with self._busy():
                    future.set_result(self._run(_prompt(prompt), max_new_tokens, stop, on_piece=on_text,
                                                cancelled=cancelled, sampling=sampling, logprobs=count,
                                                on_tokens=on_tokens))
            except Exception as exc:
                future.set_exception(exc)
            return future
        prompt, stops, cfg = self._checked(_prompt(prompt), max_new_tokens, stop, ROOM_FIX, sampling, count)
        ticket = self._scheduler.submit(prompt, cfg, stops, on_text, cancelled, on_tokens)
        out: Future = Future()

        def settle(done: Future) -> None:
            try:
                out.set_result(self._finished(done.result(), cfg, prompt))
            except Exception as exc:
                out.set_exception(exc)

        ticket.future.add_done_callback(settle)
        return out

    def _many(self, items: Sequence[str | dict[str, Any]], max_new_tokens: int, stop: Sequence[str],
              sampling: SamplingParams, logprobs: int | None) -> list[Output]:
        """`generate` over a list: every prompt built and checked before any is decoded."""
        built = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict) or not set(item) <= set(PROMPT_KEYS):
                raise InputError(f"prompt {i} of the list must be a string or a dict with keys among "
                                 f"{', '.join(PROMPT_KEYS)}, got {reprlib.repr(item)}")
            built.append(self.build(**item))
        if self._scheduler is None:
            with self._busy():
                for b in built:
                    self.check_room(b, max_new_tokens)
                return [self._run(b, max_new_tokens, stop, sampling=derived(sampling, i), logprobs=logprobs)
                        for i, b in enumerate(built)]
        checked = [self._checked(b, max_new_tokens, stop, ROOM_FIX, derived(sampling, i), logprobs)
                   for i, b in enumerate(built)]
        tickets = [self._scheduler.submit(b, cfg, stops) for b, stops, cfg in checked]
        try:
            return [self._finished(t.future.result(), cfg, b) for t, (b, _, cfg) in zip(tickets, checked)]
        except BaseException:
            for t in tickets:
                t.cancel()
            raise

    def _config(self, max_new_tokens: int, sampling: SamplingParams, logprobs: int | None = None) -> DecodeConfig:
        """glance-run's DecodeConfig (the session resolves auto's policy once, then it is reused), sampling as asked
        (its seed drawn now where none was given, so the Output can report it), reporting log-probs as asked."""
        return replace(self.session.config, max_new_tokens=_answer_length(max_new_tokens),
                       sampling=GREEDY if sampling.greedy else sampling.check().seeded(),
                       logprobs=logprob_count(logprobs))

    def _checked(self, prompt: Prompt, max_new_tokens: int, stop: Sequence[str], fix: str,
                 sampling: SamplingParams = GREEDY, logprobs: int | None = None
                 ) -> tuple[Prompt, list[str], DecodeConfig]:
        """The prompt, its stop strings and its config, once the prompt is known to fit."""
        stops = _stops(stop)
        self.check_room(prompt, max_new_tokens, fix=fix)
        return prompt, stops, self._config(max_new_tokens, sampling, logprobs)

    def _run(self, prompt: Prompt, max_new_tokens: int, stop: Sequence[str], keep: int = 0,
             on_piece: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None,
             fix: str = ROOM_FIX, sampling: SamplingParams = GREEDY, logprobs: int | None = None,
             on_tokens: OnTokens | None = None) -> Output:
        prompt, stops, cfg = self._checked(prompt, max_new_tokens, stop, fix, sampling, logprobs)
        if on_piece is not None and not callable(on_piece):
            raise InputError(f"on_text must be a callable taking each piece of text, got {type(on_piece).__name__}")
        if self._scheduler is not None:
            return self._batched(prompt, cfg, stops, on_piece, cancelled, on_tokens)
        answer = Answer(self.session.codec.tokenizer, stops, on_piece, cancelled, on_tokens)
        self._owner = None  # the backend's rows are about to change
        result = self.session.decode(prompt, answer.on_commit, config=cfg, keep=keep)
        reason = answer.finish(result)
        return self._output(answer, result, cfg, self._stats(result, cfg, prompt, keep, answer.kept, reason))

    @staticmethod
    def _output(answer: Answer, result: DecodeResult, cfg: DecodeConfig, stats: dict[str, Any]) -> Output:
        return Output(answer.joined, answer.kept, result.tau, stats, result.rounds, cfg.sampling.seed,
                      None if cfg.logprobs is None else answer.logprobs)

    def _batched(self, prompt: Prompt, cfg: DecodeConfig, stops: list[str], on_piece: Callable[[str], None] | None,
                 cancelled: Callable[[], bool] | None, on_tokens: OnTokens | None = None) -> Output:
        """One request through the batch thread; its pieces reach `on_piece` (and its reports `on_tokens`) on
        this thread."""
        pieces: queue.SimpleQueue = queue.SimpleQueue()
        ticket: Ticket = self._scheduler.submit(prompt, cfg, stops, None if on_piece is None else pieces.put,
                                                cancelled, None if on_tokens is None else
                                                lambda ids, reports: pieces.put((ids, reports)))
        try:
            if on_piece is not None or on_tokens is not None:
                ticket.future.add_done_callback(lambda _: pieces.put(None))
                while (item := pieces.get()) is not None:
                    if isinstance(item, str):
                        on_piece(item)
                    else:
                        on_tokens(*item)
            return self._finished(ticket.future.result(), cfg, prompt)
        except BaseException:  # the caller's callback failed or it was interrupted: the request leaves the batch
            ticket.cancel()
            raise

    def _finished(self, done: Done, cfg: DecodeConfig, prompt: Prompt) -> Output:
        answer, result = done.answer, done.result
        stats = self._stats(result, cfg, prompt, done.keep, answer.kept, done.reason)
        return self._output(answer, result, cfg, {**stats, "queue_ms": round(done.queue_ms, 3)})

    def _kept(self, owner: object, committed: Committed | None, prompt: Prompt, max_new_tokens: int,
              stop: Sequence[str], on_piece: Callable[[str], None] | None, cancelled: Callable[[], bool] | None,
              fix: str, sampling: SamplingParams = GREEDY, logprobs: int | None = None,
              on_tokens: OnTokens | None = None) -> tuple[Output, Committed | None]:
        """`_run`, keeping the rows `prompt` shares with `committed` while `owner`'s rows are the backend's; the
        answer, and what the backend then holds."""
        codec = self.session.codec
        prompt = _prompt(prompt)
        if self._scheduler is not None:  # each batch slot keeps its rows for the prompt sharing most of them
            return self._run(prompt, max_new_tokens, stop, on_piece=on_piece, cancelled=cancelled, fix=fix,
                             sampling=sampling, logprobs=logprobs, on_tokens=on_tokens), None
        keep = shared_rows(committed if self._owner is owner else None, prompt, codec.image_token_id, codec.merge_size)
        out = self._run(prompt, max_new_tokens, stop, keep=keep, on_piece=on_piece, cancelled=cancelled, fix=fix,
                        sampling=sampling, logprobs=logprobs, on_tokens=on_tokens)
        rows = self.session.backend.start
        self._owner = owner
        return out, Committed(np.concatenate([prompt.input_ids, np.asarray(out.token_ids, np.int64)])[:rows],
                              tuple(image_runs(prompt, codec.image_token_id, codec.merge_size)))

    def _stats(self, result: DecodeResult, cfg: DecodeConfig, prompt: Prompt, keep: int, kept: list[int],
               reason: str) -> dict[str, Any]:
        return {**result.stats(), "tokens": len(kept), "prompt_tokens": prompt.length,
                "prefill_tokens": prompt.length - keep, "ms": round(result.total_ms, 3),
                "tokens_per_s": round(1e3 / result.ms_per_token, 2) if result.ms_per_token else None,
                "backend": self.session.backend.name, "speculative": cfg.speculative,
                "budget": AUTO if cfg.auto else cfg.budget if cfg.speculative else 0, "finish": reason}

    @staticmethod
    def _pieces(work: Callable[[Callable[[str], None], threading.Event], T]) -> Generator[str, None, T]:
        """Run `work` on a worker thread and yield the pieces it emits, as it emits them; then return its result."""
        pieces: queue.Queue = queue.Queue()
        cancel = threading.Event()
        done = object()
        failure: list[BaseException] = []
        result: list[T] = []

        def target() -> None:
            try:
                result.append(work(pieces.put, cancel))
            except BaseException as exc:  # handed to the consumer's thread, raised there
                failure.append(exc)
            finally:
                pieces.put(done)

        worker = threading.Thread(target=target, name="glance-stream", daemon=True)
        worker.start()
        try:
            while (item := pieces.get()) is not done:
                yield item
        finally:
            cancel.set()
            worker.join()
        if failure:
            raise failure[0]
        return result[0]


class Stream(Iterator[str]):
    """An answer's text in pieces as rounds commit. Once the pieces are exhausted, `output` holds the finished
    Output (text, tau, stats["finish"], ...); until then, and after closing the stream early, it is None."""

    def __init__(self, pieces: Generator[str, None, Output]):
        self._pieces = pieces
        self.output: Output | None = None

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration as end:
            if end.value is not None:
                self.output = end.value
            raise

    def close(self) -> None:
        """End decoding after the current round and release the model."""
        self._pieces.close()


class Chat:
    """A conversation on one Model: the history, and the rows of it the backend has committed."""

    def __init__(self, model: Model, system: str | None = None):
        self._model, self._system = model, system
        self.reset()

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The history, OpenAI-style (system first when given, then user and assistant turns)."""
        return [dict(m) for m in self._messages]

    def reset(self) -> None:
        """Start over: no history, nothing kept."""
        self._messages: list[dict[str, Any]] = [] if self._system is None else [
            {"role": "system", "content": self._system}]
        self._committed: Committed | None = None

    def send(self, text: str, images: Sequence[ImageLike] | None = None, *, max_new_tokens: int = MAX_NEW_TOKENS,
             stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
             videos: Sequence[VideoLike] | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, min_p: float = 0.0, seed: int | None = None, logprobs: int | None = None) -> Output:
        """One user turn (with any number of images and videos) and its answer; prefills only what the
        conversation has not committed yet. A turn that would overflow the context is refused and leaves the
        history as it was."""
        sampling, count = sampling_params(temperature, top_p, top_k, min_p, seed), logprob_count(logprobs)
        with self._model._busy():
            turn, prompt = self._turn(text, images, videos)
            return self._record(turn, self._answer(prompt, max_new_tokens, stop, on_text, None, sampling, count))

    def stream(self, text: str, images: Sequence[ImageLike] | None = None, *, max_new_tokens: int = MAX_NEW_TOKENS,
               stop: Sequence[str] = (), videos: Sequence[VideoLike] | None = None, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
               logprobs: int | None = None) -> Stream:
        """`send`'s answer in pieces as rounds commit; once they are exhausted the stream's `output` is `send`'s
        Output and the turn is in the history. A stream closed before then ends decoding after the current round
        and leaves the history as it was."""
        sampling, count = sampling_params(temperature, top_p, top_k, min_p, seed), logprob_count(logprobs)
        return Stream(self._streamed(text, images, max_new_tokens, stop, videos, sampling, count))

    def _streamed(self, text, images, max_new_tokens, stop, videos,
                  sampling: SamplingParams, logprobs: int | None) -> Generator[str, None, Output]:
        with self._model._busy():
            turn, prompt = self._turn(text, images, videos)
            out = yield from Model._pieces(lambda on_piece, cancel: self._answer(prompt, max_new_tokens, stop,
                                                                                 on_piece, cancel.is_set, sampling,
                                                                                 logprobs))
            return self._record(turn, out)

    def _turn(self, text: str, images: Sequence[ImageLike] | None,
              videos: Sequence[VideoLike] | None) -> tuple[dict[str, Any], Prompt]:
        if not isinstance(text, str):
            raise InputError(f"the message must be a string, got {type(text).__name__}")
        turn = user_turn(text, images, videos)
        return turn, self._model.build(messages=[*self._messages, turn])

    def _answer(self, prompt: Prompt, max_new_tokens: int, stop: Sequence[str], on_text: Callable[[str], None] | None,
                cancelled: Callable[[], bool] | None, sampling: SamplingParams, logprobs: int | None) -> Output:
        """Decode a turn's prompt, keeping what the backend then holds (whether or not the turn is recorded)."""
        out, self._committed = self._model._kept(
            self, self._committed, prompt, max_new_tokens, stop, on_text, cancelled,
            "start over with chat.reset(), lower max_new_tokens, or load with a larger max_context", sampling,
            logprobs)
        return out

    def _record(self, turn: dict[str, Any], out: Output) -> Output:
        self._messages += [turn, {"role": "assistant", "content": out.text}]
        return out


class Reuse:
    """Decodes prompts made with `Model.build`, each keeping the rows it shares with the one decoded before
    through this handle (while no other call has changed them): for callers whose clients resend a whole
    conversation each turn, so a turn that extends the last one prefills only what is new. The answers are
    token-identical to fresh decodes. Not thread-safe, like its Model."""

    def __init__(self, model: Model):
        self._model = model
        self._committed: Committed | None = None

    def decode(self, prompt: Prompt, *, max_new_tokens: int = MAX_NEW_TOKENS, stop: Sequence[str] = (),
               on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None,
               sampling: SamplingParams = GREEDY, logprobs: int | None = None,
               on_tokens: OnTokens | None = None) -> Output:
        """Answer `prompt`; `on_text` sees the text as rounds commit, `cancelled` is asked after each round and
        a True ends the decode there (stats["finish"] is then "cancelled"; the rows stay consistent); `logprobs`
        and `on_tokens` as `Model.submit`'s."""
        model = self._model
        with model._busy():
            out, self._committed = model._kept(self, self._committed, prompt, max_new_tokens, stop, on_text, cancelled,
                                               ROOM_FIX, sampling, logprob_count(logprobs), on_tokens)
            return out


def load(artifacts: str | Path | None = None, *, engines: str | Path | None = None, model: str | Path | None = None,
         head: str | Path | None = None, backend: str | None = None, provider: str | Sequence[str] | None = None,
         budget: int | str | None = None, branch_k: int = BRANCH_K, speculative: bool = True,
         max_context: int | None = None, max_tree: int | None = None, threads: int | None = None,
         remeasure: bool = False, progress: Callable[[str], None] | None = None, max_batch: int = 1) -> Model:
    """Open a model as `glance-run` would with the same flags: with nothing given, the embedded default on
    ONNX Runtime where installed. `budget`: "auto", a node count, or None for the command's default;
    `remeasure`: auto's cost profile for this device is measured again, not read. Both are for speculative
    decoding, and `remeasure` for auto's budget only: a contradiction is refused, as the command refuses it.
    `max_batch`: requests decoded together (ONNX Runtime or TensorRT, from graphs exported with batched
    graphs); 1 decodes one call at a time."""
    max_batch = whole("max_batch", max_batch, 1)
    check_settings(threads=threads, budget=budget, branch_k=branch_k, max_context=max_context, max_tree=max_tree)
    threads, branch_k, max_context, max_tree = (None if v is None else int(v)  # numpy integers as plain ints
                                                for v in (threads, branch_k, max_context, max_tree))
    budget = budget if budget is None or isinstance(budget, str) else int(budget)
    if backend is not None and backend not in BACKENDS:
        raise InputError(f"backend {reprlib.repr(backend)} is not one of {', '.join(BACKENDS)}; pass one of them or "
                         "None")
    for name, flag in (("speculative", speculative), ("remeasure", remeasure)):
        if not isinstance(flag, bool):
            raise InputError(f"{name} must be True or False, got {reprlib.repr(flag)}")
    check_speculation(budget, speculative, remeasure)
    if provider is not None and not (isinstance(provider, str) or (
            isinstance(provider, (list, tuple)) and all(isinstance(p, str) for p in provider))):
        raise InputError("provider must be a string or a list of strings (ONNX Runtime execution providers)")
    if progress is not None and not callable(progress):
        raise InputError("progress must be a callable taking one line of text, or None")
    paths = {"model": model, "head": head, "artifacts": artifacts, "engines": engines}
    for name, value in paths.items():
        if value is not None and not isinstance(value, (str, Path)):
            raise InputError(f"{name} must be a path (str or Path), got {type(value).__name__}")
    paths = {k: Path(v) if v is not None else None for k, v in paths.items()}
    for name, path in paths.items():
        if path is not None and not path.is_dir():
            state = "is not a directory" if path.exists() else "does not exist"
            raise InputError(f"{name}={str(path)!r} {state}; pass an existing directory")
    if paths["engines"] is not None and backend is None:
        backend = "tensorrt"  # engines are only ever served by TensorRT
    if backend != "torch" and (paths["artifacts"] or paths["engines"]) and (paths["model"] or paths["head"]):
        raise InputError("artifacts and engines already hold the model and its head, so model= and head= would be "
                         "ignored; pass either model=/head= (exported on first use) or artifacts/engines")
    model_dir, head_dir, artifacts_dir, backend = resolve(paths["model"], paths["head"], paths["artifacts"], backend)
    if speculative and head_dir is None and backend == "torch":
        raise InputError("speculative decoding needs head=DIR (or pass speculative=False for plain greedy decoding)")
    source = Source(backend, model=model_dir, head=head_dir, artifacts=artifacts_dir, engines=paths["engines"],
                    providers=[provider] if isinstance(provider, str) else provider, threads=threads,
                    max_context=max_context, max_tree=max_tree, max_batch=max_batch)
    settings = Settings(budget=budget, branch_k=branch_k, speculative=speculative, remeasure=remeasure)
    return Model(open_session(source, settings, progress or (lambda _: None)), max_batch)
