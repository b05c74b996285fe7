"""What callers may ask of a backend: four passes in numpy with the state kept inside, and what it serves.

The loop owns the algorithm (tree, walk, stop rules, stats); a backend owns the graphs and caches.
That split is what lets the torch reference, ONNX Runtime and TensorRT share one loop, so parity
between them is a property of the backends alone. Everything else a caller reads (limits checks,
cost-profile keys, audit gates, benchmark reports, graph timing) is declared here too, so no caller
probes a backend for attributes or replaces one of its parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from ..defaults import BLOCK_SLACK

from .sampling import LogProbs

if TYPE_CHECKING:
    from ..formats.artifacts import Manifest
    from .sampling import Draw


class Verified(NamedTuple):
    """One verify pass over a packed tree of T rows."""
    argmax: np.ndarray  # [T] the target's token after each row: its argmax, or the one sampled there (a `Draw`)
    entropy: float  # nats of the target's distribution at the anchor row
    confidence: np.ndarray  # [T] log-prob of each row's token (at the last accepted row: of the next anchor)
    logprobs: LogProbs | None = None  # where the Draw reports: at least the rows `tree.walk` reads


class Prefilled(NamedTuple):
    """A prefill's outcome: the first generated token (the first anchor) and the entropy (nats) of the
    distribution it was taken from, and its report where the Draw asks for one (one row)."""
    first: int
    entropy: float
    logprobs: LogProbs | None = None


@dataclass(frozen=True)
class ServeLimits:
    """What a backend can serve; decode flags are checked against it before the first token (`limits`)."""
    block_size: int  # B of the head (1 without one)
    max_branch_k: int  # the largest top-k a draft pass returns
    max_tree: int | None = None  # largest verify pass, anchor included; None where unbounded
    max_context: int | None = None  # KV rows allocated (committed prefix plus a pass); None where unbounded
    exported: bool = False  # graphs sized at export time: a re-export lifts the limits
    drafter: str = "block"  # "block": one head pass drafts every offset (GLANCE/DFlash); "steps": one pass per
    # tree depth over the nodes expanded there (EAGLE-3; the backend is then also a `StepDrafter`)


@dataclass(frozen=True)
class BackendInfo:
    """What a backend serves and where it computes."""
    limits: ServeLimits
    precision: str  # fp32, fp16 or bf16: the parity gate a reference audit applies
    hardware: str  # the processor or GPU it computes on, as cost profiles are keyed
    providers: tuple[str, ...] = ()  # ONNX Runtime execution providers, in priority order
    threads: int | None = None  # intra-op threads asked for; None: the runtime's default
    home: Path | None = None  # the artifacts or engines directory served; None for the torch reference
    manifest: "Manifest | None" = None  # the exported graphs' manifest; None for the torch reference


class GraphTimes(Protocol):
    """What a backend's graph clock tells between rounds (`backends.graph_clock.GraphClock`)."""

    def reading(self) -> dict[str, float]:
        """Cumulative ms per graph so far."""

    def runs(self) -> dict[str, int]:
        """Runs per graph so far."""


def draft_rows(block_size: int, depth: int | None) -> int:
    """Offsets a draft returns for `depth` (see `Backend.draft`): all B-1 when None, else 1..B-1."""
    return block_size - 1 if depth is None else max(1, min(depth, block_size - 1))


def block_rows(block_size: int, depth: int | None, short: bool = True) -> int:
    """Rows the head runs over to draft `depth` offsets: the anchor, those offsets' masks and BLOCK_SLACK more,
    at most the whole block (always the whole block where the graph drafts only whole blocks: `short` False).
    The head's rows see each other, so rows past the deepest returned still shape the drafts; a few of them keep
    a shallow round's acceptance near a whole block's at a fraction of its cost."""
    if not short:
        return block_size
    return min(block_size, draft_rows(block_size, depth) + 1 + BLOCK_SLACK)


STEP_DRAFTERS = ("steps",)


class StepDrafter(Protocol):
    """What a backend with an autoregressive head (EAGLE-3) adds: the tree grows a depth per head pass
    (`decode.dynamic_tree`). A round's nodes are numbered 0, 1, ... in the order `draft_step` receives them;
    the head's rows for them are the round's own and are dropped when the next round starts."""

    def draft_root(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Bring the head's cache up to the committed rows (the anchor is the token after the last) and return the
        top-k ids and log-probs [k] of the token after the anchor."""

    def draft_step(self, tokens: np.ndarray, parents: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One head pass over n new nodes: node i carries `tokens[i]` below `parents[i]` (an earlier node of this
        round, or -1: the anchor) and sees the committed rows and its ancestors. Returns the top-k ids and log-probs
        [n, k] of each node's next token."""


class Backend(Protocol):
    name: str  # torch, onnxruntime or tensorrt
    block_size: int  # B: anchor plus B-1 drafted offsets; 1 when no head is loaded
    info: BackendInfo
    start: int  # stream position of the current anchor (== committed target rows)

    def prefill(self, prompt, keep: int = 0, draw: Draw | None = None) -> Prefilled:
        """Run the prompt; the anchor's stream position is the prompt length.
        `keep` > 0: the prompt starts with the first `keep` committed rows (a conversation's earlier turns),
        which are kept (target and head caches) and only the rest is run, at the full prompt's positions.
        `draw`: where it samples, the first token is sampled (`Draw.choose` at depth 0), not the argmax; where it
        reports, the token's log-probs come with it (`Draw.report`). The loop passes `keep` and `draw` only where
        they are asked for."""

    def draft(self, anchor: int, k: int, depth: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One head pass for block [anchor, MASK x (B-1)]: top-k ids and log-probs of offsets 1..depth (all B-1
        when None or larger), [rows, k] each. A tree of n nodes reaches depth n at most, so a round asks for
        no deeper rows than its budget and the projections it would throw away are never run."""

    def verify(self, tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray, draw: Draw | None = None
               ) -> Verified:
        """One target pass over the packed tree [anchor] + nodes at positions start + depth, each row
        seeing the committed prefix and its visible pack rows. `draw`: where it samples, each row's token is the
        one sampled from the row's logits (`Draw.choose`), not its argmax; where it reports, `logprobs` holds each
        row's report (`Draw.report`). Both at least on every row `tree.walk` reads (a backend may sample or report
        only those, `tree.walked_choices`, and leave the others' argmax)."""

    def commit(self, rows: np.ndarray) -> None:
        """Keep the KV (and head context) of packed rows `rows` ([0] + accepted path, in order);
        drop the rest. The next anchor then sits at position start + len(rows)."""

    def time_graphs(self) -> GraphTimes | None:
        """From now on, time each graph run (waiting for the device after each, so a run is charged its
        own time); None where the backend has no separate graphs to time (the torch reference)."""

    def close(self) -> None:
        """Release graphs and device memory now rather than at garbage collection; idempotent."""
