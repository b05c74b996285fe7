"""The GLANCE decode loop: draft once, build the tree, verify once, walk, commit.

`speculative=False` runs the same loop with a tree of the anchor alone, which is exactly
autoregressive decoding on the same backend (the `--no-spec` path and the AR baseline).
With `auto` (see `auto_budget`), each round may skip the draft or cut the tree; tokens are unchanged.
With `sampling` (temperature > 0, see `sampling`), the target's token after every row is the one sampled
at that row's answer position with noise keyed by the seed and that position, so the walk accepts a node
exactly where plain sampling would have produced it: the tokens are plain sampling's, draft on or off.
With `logprobs`, each answered token comes with its log-prob and the best alternatives at its position, read off
the row it was taken from (the prefill's last, or the verify row before it on the accepted path).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from .backend import STEP_DRAFTERS, Backend, Prefilled, Verified
from .dynamic_tree import grow_dynamic
from .sampling import GREEDY, Draw, LogProbs, SamplingParams, TokenLogprob
from ..defaults import BRANCH_K, BUDGET, DECODE_MAX_NEW_TOKENS
from ..errors import GlanceError
from .tree import Tree, build_tree, fit, visibility, walk


class BudgetPolicy(Protocol):
    """Per-round choices of `--budget auto` (glance_runtime.decode.auto_budget.AutoBudget)."""

    depth_wanted: int | None  # how deep the round `should_draft` passed is to draft (None: the full depth)

    def should_draft(self, surprisal: float | None) -> bool: ...

    def grow(self, anchor: int, topk_ids: np.ndarray, topk_logprobs: np.ndarray, branch_k: int,
             surprisal: float | None, leaves: frozenset[int] = frozenset()) -> Tree: ...

    def deeper(self, surprisal: float | None) -> Callable[[list[float], list[int], list[int]], bool]:
        """For a step drafter's growth: whether one more head pass is worth its cost (see `grow_dynamic`)."""

    def cut(self, tree: Tree, surprisal: float | None) -> Tree:
        """The best prefix of a tree a step drafter grew (its draft already spent)."""

    def observe(self, round_log: "RoundLog") -> None:
        """Each round's log once it is committed (its timings may correct the costs the policy weighs)."""

    def settle(self) -> None:
        """The decode has ended, its time taken: the policy may refit and store what it learned, off the clock."""


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = DECODE_MAX_NEW_TOKENS
    budget: int = BUDGET  # tree nodes besides the anchor (with `auto`: the most it may keep)
    branch_k: int = BRANCH_K  # top-k per offset; 1 with budget <= B-1 is the chain ablation
    speculative: bool = True
    auto: BudgetPolicy | None = None  # chooses each round's tree size (and whether to draft at all)
    sampling: SamplingParams = GREEDY  # temperature 0: greedy; else seeded (`SamplingParams.seeded`)
    logprobs: int | None = None  # None: no log-probs; n: each token's and the n best (`sampling.logprob_count`)

    def draw(self, first: int) -> Draw | None:
        """The sampling and reporting of a pass whose first row predicts answer position `first` (None: greedy,
        reporting nothing: what every backend did before either)."""
        if self.sampling.greedy and self.logprobs is None:
            return None
        return Draw(self.sampling, first, self.logprobs)


@dataclass
class RoundLog:
    entropy: float  # target's next-token entropy (nats) at the anchor
    accepted: int  # tokens this round added to the answer: accepted drafted tokens + the bonus (none after a stop)
    tree_size: int  # packed rows verified, anchor included
    draft_ms: float
    verify_ms: float
    total_ms: float
    drafted: bool = True  # False: a plain greedy step (AR, budget 0, or auto skipped the draft)
    draft_depth: int | None = None  # offsets the draft was asked for (None: no draft, or not recorded)
    surprisal: float | None = None  # -log p of the anchor under the target; None after prefill
    node_scores: list[float] = field(default_factory=list)  # verified nodes' path scores, packed order
    node_depths: list[int] = field(default_factory=list)  # and their depths
    path: list[int] = field(default_factory=list)  # packed indices of the accepted nodes


@dataclass
class DecodeResult:
    tokens: list[int]
    rounds: list[RoundLog] = field(default_factory=list)
    prefill_ms: float = 0.0
    total_ms: float = 0.0
    stopped_on: int | None = None  # the stop token that ended decoding, if any
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token where the config asks for them

    @property
    def tau(self) -> float:
        """Tokens per round pooled over all rounds (not a mean of per-prompt means). The prefill's token is no
        round's, so `tokens` is 1 + tau x rounds."""
        return sum(r.accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def ms_per_token(self) -> float:
        return self.total_ms / max(len(self.tokens), 1)

    @property
    def ms_per_token_decode(self) -> float:
        """Excludes prefill and the token it produced."""
        return (self.total_ms - self.prefill_ms) / max(len(self.tokens) - 1, 1)

    def stats(self) -> dict:
        return {"tokens": len(self.tokens), "rounds": len(self.rounds), "tau": round(self.tau, 4),
                "ms_per_token": round(self.ms_per_token, 3),
                "ms_per_token_decode": round(self.ms_per_token_decode, 3),
                "prefill_ms": round(self.prefill_ms, 3), "total_ms": round(self.total_ms, 3)}


OnCommit = Callable[[list[int], "list[TokenLogprob] | None"], "bool | None"]
"""Sees each round's new tokens and, where the config asks for log-probs, theirs (else None); True ends decoding."""


def _clip(new: list[int], produced: int, cfg: DecodeConfig, stops: Sequence[int]) -> tuple[list[int], int | None]:
    """Cut a round's tokens at the first stop token (kept) and at max_new_tokens."""
    new = new[: cfg.max_new_tokens - produced]
    for i, tok in enumerate(new):
        if tok in stops:
            return new[: i + 1], tok
    return new, None


def room_left(backend: Backend) -> int | None:
    """Rows a verify pass can still add: the backend's context limit less its committed rows (None: no limit)."""
    limit = backend.info.limits.max_context
    return None if limit is None else limit - backend.start


def draft_depth(backend: Backend, cfg: DecodeConfig, surprisal: float | None, left: int) -> int | None:
    """How deep this round's draft goes, or None for a plain greedy step: no draft where speculation is off,
    where at most one token is left to produce or one row to fill, or where auto skips it; no deeper than auto
    wants. Nothing past the answer's end is drafted: `left` tokens may still be produced, the bonus one of them."""
    room = room_left(backend)
    if (not cfg.speculative or cfg.budget == 0 or left <= 1 or (room is not None and room <= 1)
            or (cfg.auto and not cfg.auto.should_draft(surprisal))):
        return None
    wanted = cfg.auto.depth_wanted if cfg.auto else None
    return min(cfg.budget, left - 1, cfg.budget if wanted is None else wanted)


def block_tree(backend: Backend, anchor: int, cfg: DecodeConfig, surprisal: float | None, ids: np.ndarray,
               logp: np.ndarray, stops: frozenset[int]) -> Tree:
    """The tree a block draft gives (auto may cut it), cut to the room left in the context, so a round near its
    end is a smaller tree, then a plain greedy step, and the tokens stay greedy's. A stop token's node has no
    children."""
    if cfg.auto:
        tree = cfg.auto.grow(anchor, ids, logp, cfg.branch_k, surprisal, leaves=stops)
    else:
        tree = build_tree(anchor, ids, logp, cfg.budget, leaves=stops)
    room = room_left(backend)
    return tree if room is None else fit(tree, room)


def round_tree(backend: Backend, anchor: int, cfg: DecodeConfig, surprisal: float | None, left: int,
          stops: frozenset[int]) -> tuple[Tree, int | None]:
    """This round's tree and how deep its draft went (None: no draft pass made it)."""
    depth = draft_depth(backend, cfg, surprisal, left)
    if depth is None:
        return Tree.root(anchor), None
    if backend.info.limits.drafter in STEP_DRAFTERS:
        deepest = min(backend.block_size - 1, depth)
        tree = grow_dynamic(anchor, backend, cfg.budget, cfg.branch_k, deepest,
                            leaves=stops, deeper=cfg.auto.deeper(surprisal) if cfg.auto else None)
        if cfg.auto:
            tree = cfg.auto.cut(tree, surprisal)
        room = room_left(backend)
        return (tree if room is None else fit(tree, room)), deepest
    ids, logp = backend.draft(anchor, cfg.branch_k, depth)
    return block_tree(backend, anchor, cfg, surprisal, ids, logp, stops), len(ids)


def _reported(out: DecodeResult, cfg: DecodeConfig, logprobs: LogProbs | None, rows: np.ndarray) -> None:
    """The reports of the rows the new tokens were taken from, where the config asks for them."""
    if cfg.logprobs is not None:
        if logprobs is None:
            raise GlanceError("the backend reported no log-probs for a pass that asked for them; this is a bug in "
                              "the backend, please report it")
        out.logprobs += logprobs.records(rows)


def new_logprobs(out: DecodeResult, new: list[int], cfg: DecodeConfig) -> list[TokenLogprob] | None:
    """The reports of a round's `new` tokens (the last of `out`), for `OnCommit`."""
    return None if cfg.logprobs is None else out.logprobs[len(out.logprobs) - len(new):]


def record_round(out: DecodeResult, cfg: DecodeConfig, stops: frozenset[int], tree: Tree, depth: int | None,
                 path: np.ndarray, bonus: int, verified: Verified, surprisal: float | None,
                 times: tuple[float, float, float]) -> tuple[list[int], int, float]:
    """A committed round into `out` (tokens cut at a stop or the limit, its log, auto told); `depth`: its draft's
    (None: a plain step). Returns the new tokens, the next anchor and its surprisal."""
    new, out.stopped_on = _clip([int(t) for t in tree.tokens[path]] + [int(bonus)], len(out.tokens), cfg, stops)
    out.tokens += new
    _reported(out, cfg, verified.logprobs, np.concatenate([[0], path])[:len(new)])  # token i: row before it
    draft_ms, verify_ms, total_ms = times
    # What the round added, not len(path) + 1: after a stop token the bonus is the target's guess past the
    # answer's end, never committed, and counting it made tau depend on whether the stop was drafted.
    out.rounds.append(RoundLog(entropy=float(verified.entropy), accepted=len(new), tree_size=tree.size,
                               draft_ms=draft_ms, verify_ms=verify_ms, total_ms=total_ms,
                               drafted=depth is not None, draft_depth=depth,
                               surprisal=surprisal, node_scores=tree.scores[1:].tolist(),
                               node_depths=tree.depths[1:].tolist(), path=path.tolist()))
    if cfg.auto:
        cfg.auto.observe(out.rounds[-1])
    return new, int(bonus), -float(verified.confidence[path[-1] if len(path) else 0])


def one_round(backend: Backend, out: DecodeResult, anchor: int, surprisal: float | None, cfg: DecodeConfig,
              stops: frozenset[int]) -> tuple[list[int], int, float]:
    """One round on one backend (draft, tree, verify, walk, commit), recorded into `out`: the new tokens, the next
    anchor and its surprisal."""
    r0 = time.perf_counter()
    draw = cfg.draw(len(out.tokens))
    tree, depth = round_tree(backend, anchor, cfg, surprisal, cfg.max_new_tokens - len(out.tokens), stops)
    r1 = time.perf_counter()
    sampled = {} if draw is None else {"draw": draw}  # a greedy pass reporting nothing asks backends for nothing new
    verified = backend.verify(tree.tokens, tree.depths, visibility(tree.parents), **sampled)
    r2 = time.perf_counter()
    path, bonus = walk(tree, verified.argmax)
    backend.commit(np.concatenate([[0], path]).astype(np.int64))
    r3 = time.perf_counter()
    return record_round(out, cfg, stops, tree, depth, path, bonus, verified, surprisal,
                        ((r1 - r0) * 1e3, (r2 - r1) * 1e3, (r3 - r0) * 1e3))


def first_tokens(out: DecodeResult, prefilled: Prefilled, cfg: DecodeConfig, stops: frozenset[int]) -> list[int]:
    """The prefill's token into `out` (cut by a stop token or a limit of zero new tokens)."""
    new, out.stopped_on = _clip([prefilled.first], 0, cfg, stops)
    out.tokens += new
    _reported(out, cfg, prefilled.logprobs, np.zeros(len(new), np.int64))
    return new


def decode(backend: Backend, prompt, cfg: DecodeConfig, stop_ids: Sequence[int] = (),
           on_commit: OnCommit | None = None, keep: int = 0) -> DecodeResult:
    """Decode with GLANCE (or plain AR), greedily or sampling as `cfg` says; `on_commit` sees each round's new
    tokens (streaming) and returns True to end decoding there (a stop string was seen; the committed KV stays
    consistent). `keep`: committed rows the prompt starts with, kept by the prefill (a conversation's earlier
    turns)."""
    stops = frozenset(int(s) for s in stop_ids)
    t0 = time.perf_counter()
    draw = cfg.draw(0)
    if not cfg.sampling.greedy and cfg.sampling.seed is None:
        raise ValueError("sampling needs its seed fixed for the whole answer: pass SamplingParams.seeded()")
    asked = ({"keep": keep} if keep else {}) | ({} if draw is None else {"draw": draw})
    prefilled = backend.prefill(prompt, **asked)
    out = DecodeResult(tokens=[], prefill_ms=(time.perf_counter() - t0) * 1e3)
    new = first_tokens(out, prefilled, cfg, stops)
    ended = bool(on_commit and on_commit(new, new_logprobs(out, new, cfg)))
    anchor, surprisal = prefilled.first, None
    while not ended and out.stopped_on is None and len(out.tokens) < cfg.max_new_tokens:
        new, anchor, surprisal = one_round(backend, out, anchor, surprisal, cfg, stops)
        ended = bool(on_commit and on_commit(new, new_logprobs(out, new, cfg)))
    out.total_ms = (time.perf_counter() - t0) * 1e3
    if cfg.auto:
        cfg.auto.settle()
    return out
