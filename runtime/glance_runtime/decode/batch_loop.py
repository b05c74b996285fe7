"""In-flight batching: the decode loop for several requests at once, each answered token for token as alone.

A request joins between rounds: its prefill runs in a free slot of the KV pool (the others wait for that
prefill, never for each other's answers) and from the next round on it takes part in every round. A round
plans each sequence's draft as `loop.decode` would (`draft_depth`), drafts all of them in one head pass, builds
each tree, verifies every tree in one target pass, then walks, commits and records per sequence with the single
loop's own functions. A sequence leaves at a round boundary (stop token, token limit, its caller's stop, a
cancellation) and frees its slot; the others' rows stay where they are.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .loop import DecodeConfig, DecodeResult, block_tree, draft_depth, first_tokens, record_round
from .tree import Tree, visibility, walk
from ..errors import GlanceError

if TYPE_CHECKING:
    from ..backends.batch_rounds import BatchRounds


@dataclass(eq=False)
class Request:
    """One sequence of a batch: what `loop.decode` takes, and where it stands."""
    prompt: object
    cfg: DecodeConfig
    stop_ids: Sequence[int] = ()
    on_commit: Callable[[list[int]], bool | None] | None = None
    keep: int = 0  # committed rows of the slot the prompt starts with (a conversation's earlier turns)
    result: DecodeResult = field(default_factory=lambda: DecodeResult(tokens=[]))
    slot: int | None = None
    done: bool = False
    anchor: int = 0
    surprisal: float | None = None
    started: float = 0.0

    @property
    def stops(self) -> frozenset[int]:
        return frozenset(int(s) for s in self.stop_ids)

    def _left(self) -> int:
        return self.cfg.max_new_tokens - len(self.result.tokens)


class BatchLoop:
    """Requests decoded together over a `BatchRounds`; `step` runs one round for every sequence in it."""

    def __init__(self, rounds: "BatchRounds"):
        self.rounds = rounds
        self.active: dict[int, Request] = {}

    @property
    def capacity(self) -> int:
        return self.rounds.capacity

    def free_slots(self) -> list[int]:
        return [s for s in range(self.capacity) if s not in self.active]

    def join(self, request: Request, slot: int | None = None) -> Request:
        """Prefill `request` into `slot` (default: the lowest free one); it takes part from the next round on,
        unless its first token already ends it (then it is done and holds no slot)."""
        free = self.free_slots()
        if not free:
            raise GlanceError(f"all {self.capacity} batch slots are busy; wait for one to free or raise --max-batch")
        if slot is None:
            slot = free[0]
        elif slot not in free:
            raise ValueError(f"slot {slot} is busy")
        request.slot, request.started = slot, time.perf_counter()
        first, _ = self.rounds.prefill(slot, request.prompt, request.keep)
        out = request.result
        out.prefill_ms = (time.perf_counter() - request.started) * 1e3
        new = first_tokens(out, first, request.cfg, request.stops)
        request.anchor, request.surprisal = first, None
        ended = bool(request.on_commit and request.on_commit(new))
        self.active[slot] = request
        if ended or out.stopped_on is not None or request._left() <= 0:
            self._finish(request)
        return request

    def cancel(self, request: Request) -> None:
        """Take `request` out at this round boundary; its slot is free for the next join."""
        if request.slot in self.active and self.active[request.slot] is request:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        request.done = True
        request.result.total_ms = (time.perf_counter() - request.started) * 1e3
        del self.active[request.slot]
        if request.cfg.auto:
            request.cfg.auto.settle()

    def step(self) -> list[Request]:
        """One round for every active sequence; returns those it finished."""
        requests = list(self.active.values())
        if not requests:
            return []
        rounds = self.rounds
        r0 = time.perf_counter()
        depths = {r.slot: draft_depth(rounds.slots[r.slot], r.cfg, r.surprisal, r._left()) for r in requests}
        drafting = [r for r in requests if depths[r.slot] is not None]
        drafts = rounds.draft([(r.slot, r.anchor, r.cfg.branch_k, depths[r.slot]) for r in drafting])
        drafted = {r.slot: d for r, d in zip(drafting, drafts)}
        trees: list[Tree] = []
        for r in requests:
            if r.slot in drafted:
                ids, logp = drafted[r.slot]
                trees.append(block_tree(rounds.slots[r.slot], r.anchor, r.cfg, r.surprisal, ids, logp, r.stops))
            else:
                trees.append(Tree.root(r.anchor))
        r1 = time.perf_counter()
        verified = rounds.verify([(r.slot, t.tokens, t.depths, visibility(t.parents)) for r, t in zip(requests, trees)])
        r2 = time.perf_counter()
        walks = [walk(t, v.argmax) for t, v in zip(trees, verified)]
        rounds.commit([(r.slot, np.concatenate([[0], path]).astype(np.int64)) for r, (path, _) in zip(requests, walks)])
        r3 = time.perf_counter()
        times = ((r1 - r0) * 1e3, (r2 - r1) * 1e3, (r3 - r0) * 1e3)
        finished = []
        for r, tree, v, (path, bonus) in zip(requests, trees, verified, walks):
            new, r.anchor, r.surprisal = record_round(r.result, r.cfg, r.stops, tree, r.slot in drafted, path,
                                                      bonus, v, r.surprisal, times)
            ended = bool(r.on_commit and r.on_commit(new))
            if ended or r.result.stopped_on is not None or r._left() <= 0:
                self._finish(r)
                finished.append(r)
        return finished

    def run(self, requests: list[Request]) -> list[DecodeResult]:
        """Decode `requests` as one batch, joining each as a slot frees; results in the given order."""
        waiting = list(requests)
        while waiting or self.active:
            while waiting and self.free_slots():
                self.join(waiting.pop(0))
            self.step()
        return [r.result for r in requests]

