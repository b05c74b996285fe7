"""Interleaved measurement of one prompt in every mode, in one process on one backend.

Per prompt, sample 0 runs AR first (its tokens are the reference every other run must reproduce)
and is then dropped as a warm-up with the rest of sample 0; later samples rotate the mode order so
no mode always runs first. Each kept run records its rounds with the graphs' own time where the
backend exposes its graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from ..decode.loop import decode
from ..decode.sampling import GREEDY, SamplingParams
from .modes import Mode
from .seeding import ConfidentSeeds
from .task_prompts import BenchTask
from ..backends.graph_clock import GRAPH_NAMES, GraphClock


@dataclass
class Run:
    """One kept decode of one prompt in one mode."""
    mode: str
    sample: int
    tokens: int
    prefill_ms: float
    total_ms: float
    identical: bool  # same tokens as the prompt's AR reference
    rounds: list[dict] = field(default_factory=list)

    @property
    def decode_ms(self) -> float:
        return self.total_ms - self.prefill_ms

    @property
    def decode_tokens(self) -> int:
        """Tokens from rounds: all but the one prefill produced."""
        return max(self.tokens - 1, 0)


@dataclass
class PromptResult:
    task: BenchTask
    prompt_tokens: int
    new_tokens: int
    runs: list[Run] = field(default_factory=list)

    def of(self, mode: str) -> list[Run]:
        return [r for r in self.runs if r.mode == mode]


def _decode(backend, prompt, mode: Mode, max_new_tokens: int, stops: Sequence[int], clock: GraphClock | None,
            block_size: int, sampling: SamplingParams = GREEDY):
    """Decode once; per-round dicts carry RoundLog's fields plus each graph's ms when a clock is attached."""
    readings: list[dict[str, float]] = []
    result = decode(backend, prompt, replace(mode.config(max_new_tokens), sampling=sampling), stops,
                    on_commit=(lambda _new, _reports: readings.append(clock.reading())) if clock else None)
    rounds = []
    for i, r in enumerate(result.rounds):
        row = {"entropy": r.entropy, "accepted": r.accepted, "tree_size": r.tree_size, "cap": mode.cap(block_size),
               "draft_ms": r.draft_ms, "verify_ms": r.verify_ms, "total_ms": r.total_ms,
               "final": i == len(result.rounds) - 1,  # the answer's end (stop or max tokens) cut this round
               "drafted": r.drafted, "draft_depth": r.draft_depth, "surprisal": r.surprisal,
               "node_scores": r.node_scores,
               "node_depths": r.node_depths, "path": r.path}
        if clock:
            before, after = readings[i], readings[i + 1]
            graph = {name: after[name] - before[name] for name in GRAPH_NAMES}
            row.update({f"{name}_graph_ms": ms for name, ms in graph.items()})
            row["outside_ms"] = r.total_ms - sum(graph.values())
        else:
            row["outside_ms"] = r.total_ms - r.draft_ms - r.verify_ms
        rounds.append(row)
    return result, rounds


def measure_prompt(backend, task: BenchTask, build_prompt, stops: Sequence[int], modes: list[Mode], samples: int,
                   max_new_tokens: int, clock: GraphClock | None, seed_drafts: str = "none",
                   sampling: SamplingParams = GREEDY) -> PromptResult:
    """`samples` runs of every mode (the first dropped); a run that differs from AR is recorded, not raised. With
    `sampling`, every mode samples with the same seed, so AR is plain sampling and each mode must match it."""
    prompt = build_prompt(task.prompt, task.image)
    block = backend.block_size
    truth: list[int] | None = None
    drafter = backend
    out: PromptResult | None = None
    for s in range(samples):
        order = modes[s % len(modes):] + modes[:s % len(modes)]
        for mode in order:
            runner = drafter if mode.kind != "ar" else backend
            result, rounds = _decode(runner, prompt, mode, max_new_tokens, stops, clock, block, sampling)
            if truth is None:
                truth = result.tokens
                out = PromptResult(task, int(prompt.length), len(truth))
                if seed_drafts != "none":
                    drafter = ConfidentSeeds(backend, truth, prompt.length, seed_drafts)
            if s == 0:
                continue
            out.runs.append(Run(mode.name, s, len(result.tokens), result.prefill_ms, result.total_ms,
                                result.tokens == truth, rounds))
    return out
