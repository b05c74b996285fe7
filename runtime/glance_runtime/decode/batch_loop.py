"""In-flight batching: the decode loop for several requests at once, each answered token for token as alone.

A request joins between rounds: its prefill runs in a free slot of the KV pool (the others wait for that
prefill, never for each other's answers) and from the next round on it takes part in every round. A round
plans each sequence's draft as `loop.decode` would (`draft_depth`; with auto, the batch's policy decides,
`batch_budget`), drafts all of them in one head pass, builds each tree, verifies every tree in one target pass,
then walks, commits and records per sequence with the single loop's own functions. A sequence leaves at a round
boundary (stop token, token limit, its caller's stop, a cancellation) and frees its slot; the others' rows stay
where they are. While one sequence is alone, its rounds are the single loop's, on its slot (`one_round`): the
single-sequence graphs and, with auto, the batch's `alone` policy, which decides on the stored single-sequence
costs as one request's auto does but neither learns costs from these rounds nor stores any. They run between
batched passes, on caches those left cold, so their times are not the steady decode the profile stands for: stored
from them, three batched glance-serve runs took the default's one-row cost from 0.82 ms to 0.054.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from .backend import Backend, Prefilled, Verified
from .batch_budget import BatchBudget
from .loop import (BudgetPolicy, DecodeConfig, DecodeResult, OnCommit, draft_depth, first_tokens, new_logprobs,
                   one_round, record_round)
from .sampling import Draw
from .tree import Tree, build_tree, fit, visibility, walk
from ..errors import GlanceError

class Rounds(Protocol):
    """What the loop asks of the batched passes (`backends.batch_rounds.BatchRounds`)."""

    slots: list[Backend]  # each slot as a backend of its own (its start, limits; a round alone on it)

    @property
    def capacity(self) -> int: ...

    def prefill(self, slot: int, prompt, keep: int = 0, draw: Draw | None = None) -> Prefilled: ...

    def draft(self, asks: list[tuple[int, int, int, int | None]]) -> list[tuple[np.ndarray, np.ndarray]]: ...

    def verify(self, trees: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
               draws: Sequence[Draw | None] = ()) -> list[Verified]: ...

    def commit(self, kept: list[tuple[int, np.ndarray]]) -> None: ...

    def alone(self, slot: int, anchor: int) -> Backend: ...

    def keep_anchor(self, slot: int, token: int) -> None: ...


@dataclass(eq=False)
class Request:
    """One sequence of a batch: what `loop.decode` takes, and where it stands."""
    prompt: object
    cfg: DecodeConfig
    stop_ids: Sequence[int] = ()
    on_commit: OnCommit | None = None
    keep: int = 0  # committed rows of the slot the prompt starts with (a conversation's earlier turns)
    result: DecodeResult = field(default_factory=lambda: DecodeResult(tokens=[]))
    slot: int | None = None
    done: bool = False
    anchor: int = 0
    surprisal: float | None = None
    started: float = 0.0
    stops: frozenset[int] = field(init=False)  # stop_ids as the loop's functions take them
    batched: DecodeConfig = field(init=False)  # cfg in batched rounds: the request's own auto does not see them
    alone: DecodeConfig = field(init=False)  # cfg in rounds alone (with auto, the loop's `alone` policy once it joins)

    def __post_init__(self) -> None:
        """Worked out once here, not in every round."""
        self.stops = frozenset(int(s) for s in self.stop_ids)
        self.batched = replace(self.cfg, auto=None)
        self.alone = self.cfg

    def _left(self) -> int:
        return self.cfg.max_new_tokens - len(self.result.tokens)


class BatchLoop:
    """Requests decoded together over a `BatchRounds`; `step` runs one round for every sequence in it."""

    def __init__(self, rounds: Rounds, policy: BatchBudget | None = None, alone: BudgetPolicy | None = None):
        """`policy`: the batch's auto (requests with auto then follow it in batched rounds); `alone`: the auto
        requests with auto decide their rounds alone with (see the module; None: their own)."""
        self.rounds, self.policy, self.alone = rounds, policy, alone
        self.active: dict[int, Request] = {}
        self._ended: float | None = None  # when the last batched round ended, while sequences stayed in the batch
        self._joined = 0  # tokens the prefills since then produced

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
        if request.cfg.auto and self.alone is not None:
            request.alone = replace(request.cfg, auto=self.alone)
        prefilled = self.rounds.prefill(slot, request.prompt, request.keep, request.cfg.draw(0))
        out = request.result
        out.prefill_ms = (time.perf_counter() - request.started) * 1e3
        new = first_tokens(out, prefilled, request.cfg, request.stops)
        self._joined += len(new)
        request.anchor, request.surprisal = prefilled.first, None
        ended = bool(request.on_commit and request.on_commit(new, new_logprobs(out, new, request.cfg)))
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
        if request.alone.auto:
            request.alone.auto.settle()

    def step(self) -> list[Request]:
        """One round for every active sequence; returns those it finished."""
        requests = list(self.active.values())
        if not requests:
            return []
        if len(requests) == 1:
            self._ended = None  # the wall time of batched rounds only
            return self._alone(requests[0])
        rounds = self.rounds
        finished: list[Request] = []
        r0 = time.perf_counter()
        caps = [draft_depth(rounds.slots[r.slot], r.batched, r.surprisal, r._left()) for r in requests]
        batched = self.policy is not None and all(r.cfg.auto for r in requests)
        depths = self.policy.plan([r.surprisal for r in requests], caps) if batched else caps
        drafting = [i for i, d in enumerate(depths) if d is not None]
        drafts = dict(zip(drafting, rounds.draft([(requests[i].slot, requests[i].anchor, requests[i].cfg.branch_k,
                                                   depths[i]) for i in drafting])))
        stop = self.policy.growth_stop(len(requests)) if batched and drafting else None
        draws = [r.cfg.draw(len(r.result.tokens)) for r in requests]
        trees = [self._tree(r, drafts.get(i), stop) for i, r in enumerate(requests)]
        if batched:
            trees = self.policy.cut(trees, [r.surprisal for r in requests], len(drafting))
        r1 = time.perf_counter()
        verified = rounds.verify([(r.slot, t.tokens, t.depths, visibility(t.parents)) for r, t in zip(requests, trees)],
                                 draws)
        r2 = time.perf_counter()
        walks = [walk(t, v.argmax) for t, v in zip(trees, verified)]
        rounds.commit([(r.slot, np.concatenate([[0], path]).astype(np.int64)) for r, (path, _) in zip(requests, walks)])
        r3 = time.perf_counter()
        times = ((r1 - r0) * 1e3, (r2 - r1) * 1e3, (r3 - r0) * 1e3)
        if batched:
            self.policy.observe(len(trees), max(t.size for t in trees), sum(t.size for t in trees), len(drafting),
                               times[2])
        produced = self._joined
        for i, (r, tree, v, (path, bonus)) in enumerate(zip(requests, trees, verified, walks)):
            depth = len(drafts[i][0]) if i in drafts else None
            new, r.anchor, r.surprisal = record_round(r.result, r.batched, r.stops, tree, depth, path, bonus, v,
                                                      r.surprisal, times)
            produced += len(new)
            finished += self._after(r, new)
        ended = time.perf_counter()
        if batched and self._ended is not None:
            self.policy.switch.observe(produced, (ended - self._ended) * 1e3)
        self._ended, self._joined = (ended if self.active else None), 0
        return finished

    def _tree(self, request: Request, draft: tuple[np.ndarray, np.ndarray] | None,
              stop: Callable[[int, float], bool] | None) -> Tree:
        """A sequence's tree from its draft (the anchor alone without one), cut to its slot's room; under the
        batch's auto (`stop` given), grown in the calibration's order for the policy's cut, as far as it could
        keep."""
        if draft is None:
            return Tree.root(request.anchor)
        ids, logp = draft
        priority = self.policy.calibration.node_scorer(request.surprisal) if stop is not None else None
        tree = build_tree(request.anchor, ids, logp, request.cfg.budget, priority=priority, stop=stop,
                          leaves=request.stops)
        room = self.rounds.slots[request.slot].info.limits.max_context
        return tree if room is None else fit(tree, room - self.rounds.slots[request.slot].start)

    def _alone(self, request: Request) -> list[Request]:
        """A round of the single loop on the sequence's slot, its draft, verify and commit the slot's own."""
        backend = self.rounds.alone(request.slot, request.anchor)
        new, request.anchor, request.surprisal = one_round(backend, request.result, request.anchor,
                                                           request.surprisal, request.alone, request.stops)
        self.rounds.keep_anchor(request.slot, request.anchor)
        return self._after(request, new)

    def _after(self, request: Request, new: list[int]) -> list[Request]:
        """The caller sees the round's tokens; the request leaves where they end it."""
        ended = bool(request.on_commit and request.on_commit(new, new_logprobs(request.result, new, request.cfg)))
        if ended or request.result.stopped_on is not None or request._left() <= 0:
            self._finish(request)
            return [request]
        return []

    def run(self, requests: list[Request]) -> list[DecodeResult]:
        """Decode `requests` as one batch, joining each as a slot frees; results in the given order."""
        waiting = list(requests)
        while waiting or self.active:
            while waiting and self.free_slots():
                self.join(waiting.pop(0))
            self.step()
        return [r.result for r in requests]

