"""Many requests decoded together: one thread owns the batched loop, callers on any thread submit and wait.

A request waits until a slot of the KV pool is free, then joins the running batch at a round boundary. At most
one prefill runs per boundary while others are decoding, so a newcomer holds the running sequences up by one
prefill at most (recorded as the request's `prefill_ms`). Each round commits tokens for every sequence; a
request's text leaves in pieces as its tokens commit, and it ends at its stop token, its token limit, a stop
string or a cancellation, freeing its slot at that boundary. Each slot remembers the rows it holds after its
last request, and a newcomer is given the free slot sharing the most rows with its prompt (a conversation's
next turn prefills only what is new). Every answer is token for token what the request decodes alone: the
batched loop's guarantee; nothing here chooses tokens.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .decode.batch_loop import BatchLoop, Request
from .decode.loop import DecodeConfig, DecodeResult, OnCommit
from .decode.sampling import TokenLogprob
from .errors import GlanceError
from .prompt.codec import PromptCodec
from .prompt.prefix_reuse import Committed, image_runs, shared_rows
from .prompt.prompt_builder import Prompt
from .prompt.text_stream import TextStream

log = logging.getLogger("glance.batching")
OnTokens = Callable[[list[int], list[TokenLogprob]], None]  # an answer's kept tokens of a round and their reports


class Answer:
    """The text side of one decode: committed tokens become text pieces, a stop string or the caller's
    cancellation ends it (the same rules for a request decoded alone or in a batch)."""

    def __init__(self, tokenizer, stops: Sequence[str], on_piece: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None, on_tokens: OnTokens | None = None):
        self.text = TextStream(tokenizer, stops)
        self.on_piece, self.cancelled, self.on_tokens = on_piece, cancelled, on_tokens
        self.pieces: list[str] = []
        self.kept: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per kept token where the decode reports them
        self.by_caller = False

    def emit(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            if self.on_piece is not None:
                self.on_piece(piece)

    def on_commit(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> bool:
        """The loop's callback (`loop.OnCommit`): True ends the decode after this round. The tokens kept, up to the
        one completing a stop string, and their reports reach `on_tokens` after their text reached `on_piece`."""
        taken = 0
        for token in new:
            self.kept.append(token)
            taken += 1
            self.emit(self.text.push(token))
            if self.text.stopped:
                break
        if logprobs is not None:
            self.logprobs += logprobs[:taken]
            if self.on_tokens is not None and taken:
                self.on_tokens(new[:taken], logprobs[:taken])
        if self.text.stopped:
            return True
        self.by_caller = self.cancelled is not None and self.cancelled()
        return self.by_caller

    def finish(self, result: DecodeResult) -> str:
        """Flush the held text; the finish reason."""
        self.emit(self.text.finish())
        return "stop" if self.text.stopped else "cancelled" if self.by_caller else \
            "eos" if result.stopped_on is not None else "length"

    @property
    def joined(self) -> str:
        return "".join(self.pieces)


@dataclass
class Done:
    """A finished request: the loop's result, its text side, the rows its prompt kept, and its reason."""
    result: DecodeResult
    answer: Answer
    keep: int
    reason: str
    queue_ms: float  # submitted to joined a slot


@dataclass(eq=False)
class Ticket:
    """One submitted request: `future` settles with its Done (or its error); `cancel` ends it at the next round
    boundary (or before it joins), with the reason "cancelled"."""
    prompt: Prompt
    cfg: DecodeConfig
    answer: Answer
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    queue_ms: float = 0.0
    keep: int = 0
    request: Request | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.stop.set()

    @property
    def cancelled(self) -> bool:
        """Whether its caller gave it up; a `cancelled` callback that raises ends this request alone, with its
        error (asked on the batch thread, whose end would leave every request blocked)."""
        try:
            return self.answer.cancelled()
        except Exception as exc:
            _settle(self.future, error=exc)
            return True


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class Scheduler:
    """The batch thread over one BatchLoop. `submit` from any thread; `close` ends the thread, failing what is
    left, as does an error that ends it (then in one line naming it, for every later submit too).
    `on_round(sequences)` after each round and `on_prefill(ms)` after a prefill that held running sequences up are
    called on the batch thread (for metrics; set them as attributes)."""

    def __init__(self, loop: BatchLoop, codec: PromptCodec, *, on_round: Callable[[int], None] = lambda n: None,
                 on_prefill: Callable[[float], None] = lambda ms: None):
        self.loop, self.codec = loop, codec
        self.on_round, self.on_prefill = on_round, on_prefill
        self.held: list[Committed | None] = [None] * loop.capacity  # what each slot's rows hold
        self.used = [0] * loop.capacity  # when each slot last took a request (least recently used goes first)
        self.clock = 0
        self.waiting: list[Ticket] = []
        self.joining: list[Ticket] = []  # taken from `waiting` at this boundary, not running yet
        self.running: dict[int, Ticket] = {}  # slot -> ticket
        self.cond = threading.Condition()
        self.closed = False
        self.stopped: GlanceError | None = None  # why the batch thread ended by an error of its own
        self.thread = threading.Thread(target=self._serve, name="glance-batch", daemon=True)
        self.thread.start()

    @property
    def capacity(self) -> int:
        return self.loop.capacity

    @property
    def active(self) -> int:
        """Sequences in the batch now."""
        return len(self.running)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.waiting)

    def submit(self, prompt: Prompt, cfg: DecodeConfig, stops: Sequence[str] = (),
               on_piece: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None,
               on_tokens: OnTokens | None = None) -> Ticket:
        """Queue one request; `on_piece` gets its text and `on_tokens` its tokens' reports as rounds commit, and
        `cancelled` is asked each round, all on the batch thread."""
        stop = threading.Event()
        asked = stop.is_set if cancelled is None else lambda: stop.is_set() or cancelled()
        ticket = Ticket(prompt, cfg, Answer(self.codec.tokenizer, stops, on_piece, asked, on_tokens), stop=stop)
        with self.cond:
            if self.closed:
                raise self.stopped or GlanceError("this model is closed; load another with glance_runtime.load()")
            self.waiting.append(ticket)
            self.cond.notify()
        return ticket

    def close(self) -> None:
        """Stop the thread after its current round; requests still waiting or decoding fail."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    # -- the batch thread ------------------------------------------------------------------------------

    def _serve(self) -> None:
        """The batch thread: rounds until closed. Should it end by an error of its own, every request waiting or
        decoding, and every later submit, fails at once with one line saying so, rather than waiting for good."""
        stopped = None
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, no caller may be left waiting
            reason = str(exc).splitlines()[0] if str(exc).strip() else ""
            stopped = GlanceError(f"the batch thread stopped ({type(exc).__name__}{': ' if reason else ''}{reason}); "
                                  "this model serves no more requests: close it and load it again with "
                                  "glance_runtime.load()")
            log.error("%s", stopped)
        with self.cond:
            self.closed, self.stopped = True, stopped
            left = [*self.waiting, *self.joining, *self.running.values()]
            self.waiting, self.joining, self.running = [], [], {}
        error = stopped or GlanceError("the model was closed before this request finished")
        for ticket in left:
            _settle(ticket.future, error=error)

    def _run(self) -> None:
        """Joins and rounds, until closed."""
        while True:
            with self.cond:
                while not self.closed and not self.waiting and not self.running:
                    self.cond.wait()
                if self.closed:
                    break
                self._drop_cancelled()
                free = len(self.loop.free_slots())
                take = min(free, len(self.waiting) if not self.running else 1)
                self.joining, self.waiting = self.waiting[:take], self.waiting[take:]
            for ticket in self.joining:
                self._join(ticket)
            self.joining = []
            for ticket in [t for t in self.running.values() if t.cancelled]:
                ticket.answer.by_caller = True
                self.loop.cancel(ticket.request)
                self._done(ticket)
            if self.running:
                self._round()

    def _drop_cancelled(self) -> None:
        """Requests given up while they waited leave without a prefill (called under the lock)."""
        for ticket in [t for t in self.waiting if t.cancelled]:
            self.waiting.remove(ticket)
            ticket.answer.by_caller = True
            _settle(ticket.future, Done(DecodeResult(tokens=[]), ticket.answer, 0, "cancelled", self._waited(ticket)))

    @staticmethod
    def _waited(ticket: Ticket) -> float:
        return (time.perf_counter() - ticket.submitted) * 1e3

    def _slot(self, prompt: Prompt) -> tuple[int, int]:
        """The free slot sharing the most rows with `prompt` (ties: the least recently used), and those rows."""
        codec = self.codec
        shares = {s: shared_rows(self.held[s], prompt, codec.image_token_id, codec.merge_size)
                  for s in self.loop.free_slots()}
        slot = max(shares, key=lambda s: (shares[s], -self.used[s]))
        return slot, shares[slot]

    def _join(self, ticket: Ticket) -> None:
        ticket.queue_ms = self._waited(ticket)
        slot, keep = self._slot(ticket.prompt)
        self.clock += 1
        self.used[slot], self.held[slot] = self.clock, None  # its rows change from here on
        ticket.keep = keep
        ticket.request = Request(ticket.prompt, ticket.cfg, self.codec.stop_ids, self._guarded(ticket), keep)
        holding_up = bool(self.running)
        try:
            self.loop.join(ticket.request, slot)
        except Exception as exc:  # this request's prefill failed: only it is answered with the error
            _settle(ticket.future, error=exc)
            return
        if holding_up:
            self.on_prefill(ticket.request.result.prefill_ms)
        self.running[slot] = ticket
        if ticket.request.done:
            self._done(ticket)

    def _guarded(self, ticket: Ticket) -> OnCommit:
        """The request's on_commit; an error in its caller's callback ends that request alone."""
        def on_commit(new: list[int], logprobs: list[TokenLogprob] | None) -> bool:
            try:
                return ticket.answer.on_commit(new, logprobs)
            except Exception as exc:
                _settle(ticket.future, error=exc)
                return True
        return on_commit

    def _round(self) -> None:
        sequences = len(self.running)
        try:
            finished = self.loop.step()
        except Exception as exc:  # the round's sequences are in an unknown state: each of them fails, nothing else
            log.warning("a batched round failed for %d request(s): %s", sequences, exc)
            for ticket in list(self.running.values()):
                self.loop.cancel(ticket.request)
                del self.running[ticket.request.slot]
                self.held[ticket.request.slot] = None
                _settle(ticket.future, error=exc)
            return
        self.on_round(sequences)
        for request in finished:
            self._done(self.running[request.slot])

    def _done(self, ticket: Ticket) -> None:
        """Settle a finished request and remember what its slot now holds."""
        request = ticket.request
        slot = request.slot
        del self.running[slot]
        prompt, codec = ticket.prompt, self.codec
        rows = self.loop.rounds.slots[slot].start
        ids = np.concatenate([prompt.input_ids.reshape(-1), np.asarray(ticket.answer.kept, np.int64)])[:rows]
        self.held[slot] = Committed(ids, tuple(image_runs(prompt, codec.image_token_id, codec.merge_size)))
        if ticket.future.done():  # its callback failed it already
            return
        try:
            reason = ticket.answer.finish(request.result)
        except Exception as exc:
            _settle(ticket.future, error=exc)
            return
        _settle(ticket.future, Done(request.result, ticket.answer, ticket.keep, reason, ticket.queue_ms))
