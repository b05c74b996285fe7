"""A batched model (max_batch > 1) under failure: a caller's callback that raises (`cancelled`, `on_text` run on the
batch thread, `on_text` run on the caller's) fails its own request only, with its own error, while the requests
decoded beside it answer exactly as alone, and later calls are served as before; a batch thread stopped by an
internal error fails every waiting and every later call at once, in one line, instead of leaving them blocked.
Every wait is bounded (`within`), so a regression fails here rather than hanging the run."""
from __future__ import annotations

import threading

import pytest

import glance_runtime as gr
from glance_runtime.errors import GlanceError
from support import within

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

WAIT_S = 120  # far above any decode here: only a blocked call reaches it
MAX_TOKENS = 24
OTHERS = ["What is the total?", "Name a colour.", "Hello"]
FAILING = "Describe this."


class CallerFailure(Exception):
    """What the caller's callback raises: the failing request's caller must get exactly this."""


class Raising:
    """A callback that answers normally `calls_before` times, then raises (at once, or mid-batch)."""

    def __init__(self, calls_before: int, answer: object = None):
        self.calls_before, self.answer, self.calls = calls_before, answer, 0

    def __call__(self, *args: object) -> object:
        self.calls += 1
        if self.calls > self.calls_before:
            raise CallerFailure(f"callback failed on call {self.calls}")
        return self.answer


@pytest.fixture(scope="module")
def alone() -> dict[str, gr.Output]:
    with gr.load(threads=1) as model:
        return {p: model.generate(p, max_new_tokens=MAX_TOKENS) for p in [*OTHERS, FAILING]}


@pytest.fixture(scope="module")
def batched():
    with gr.load(threads=1, max_batch=4) as model:
        yield model


def _failing_call(model: gr.Model, how: str, calls_before: int):
    """The failing request as the caller makes it: a callable that blocks until it answers (or raises)."""
    if how == "cancelled":  # asked while the request waits for a slot, as it joins, and each round
        future = model.submit(model.build(FAILING), max_new_tokens=MAX_TOKENS, cancelled=Raising(calls_before, False))
        return lambda: future.result(WAIT_S)
    if how == "on_piece":  # submit's on_text runs on the batch thread
        future = model.submit(model.build(FAILING), max_new_tokens=MAX_TOKENS, on_text=Raising(calls_before))
        return lambda: future.result(WAIT_S)
    if how == "on_text":  # generate's on_text runs on the caller's thread
        return lambda: model.generate(FAILING, max_new_tokens=MAX_TOKENS, on_text=Raising(calls_before))
    if how == "reuse_cancelled":
        return lambda: model.reuse().decode(model.build(FAILING), max_new_tokens=MAX_TOKENS,
                                            cancelled=Raising(calls_before, False))
    raise AssertionError(how)


@pytest.mark.parametrize("calls_before", [0, 1, 3])
@pytest.mark.parametrize("how", ["cancelled", "on_piece", "on_text", "reuse_cancelled"])
def test_a_raising_callback_fails_its_own_request_and_the_batch_goes_on(batched, alone, how, calls_before):
    barrier = threading.Barrier(2)
    others: list = []

    def submit_others() -> None:
        barrier.wait()
        others.extend(batched.submit(batched.build(p), max_new_tokens=MAX_TOKENS) for p in OTHERS)

    submitter = threading.Thread(target=submit_others, daemon=True)
    submitter.start()
    barrier.wait()
    failing = _failing_call(batched, how, calls_before)
    with pytest.raises(CallerFailure, match=f"callback failed on call {calls_before + 1}"):
        within(WAIT_S, failing)
    submitter.join(WAIT_S)
    got = [within(WAIT_S, lambda f=f: f.result(WAIT_S)) for f in others]
    assert [(o.text, o.token_ids) for o in got] == [(alone[p].text, alone[p].token_ids) for p in OTHERS]
    later = within(WAIT_S, lambda: batched.generate(FAILING, max_new_tokens=MAX_TOKENS))
    assert later.token_ids == alone[FAILING].token_ids
    streamed = within(WAIT_S, lambda: list(batched.stream(OTHERS[0], max_new_tokens=MAX_TOKENS)))
    assert "".join(streamed) == alone[OTHERS[0]].text


def test_a_stopped_batch_thread_fails_waiting_and_later_calls_at_once_in_one_line():
    """The batch thread stopped by an error of its own (here its per-round metrics hook raising, as a server's
    could): every request it held or queued fails with one line naming the stop and its reason, and so does
    every later call, at once; the model still closes."""
    model = gr.load(threads=1, max_batch=2)
    try:
        model.scheduler.on_round = Raising(0)
        futures = [model.submit(model.build(p), max_new_tokens=MAX_TOKENS) for p in [*OTHERS, FAILING]]
        for future in futures:  # two decoding, two waiting for a slot
            with pytest.raises(GlanceError) as caught:
                within(WAIT_S, lambda f=future: f.result(WAIT_S))
            _stopped(caught.value)
        for later in (lambda: model.generate(FAILING, max_new_tokens=MAX_TOKENS),
                      lambda: list(model.stream(FAILING, max_new_tokens=MAX_TOKENS)),
                      lambda: model.submit(model.build(FAILING), max_new_tokens=MAX_TOKENS).result(WAIT_S),
                      lambda: model.reuse().decode(model.build(FAILING), max_new_tokens=MAX_TOKENS),
                      lambda: model.chat().send("Hello", max_new_tokens=MAX_TOKENS)):
            with pytest.raises(GlanceError) as caught:
                within(WAIT_S, later)
            _stopped(caught.value)
    finally:
        within(WAIT_S, model.close)


def _stopped(exc: GlanceError) -> None:
    message = str(exc)
    assert "\n" not in message and "batch thread stopped" in message and "callback failed on call 1" in message, \
        message
    assert "glance_runtime.load" in message, message
