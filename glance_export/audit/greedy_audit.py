"""Losslessness audit: every task decoded by the greedy oracle twice and by GLANCE once.

The oracle's second run is the self-consistency control: a backend whose own greedy decode is not
repeatable cannot be asked to match it more often than it matches itself.
"""
from __future__ import annotations

from typing import Callable

from glance_runtime.defaults import AUTO
from glance_runtime.formats.tasks import Task
from glance_runtime.decode.loop import DecodeConfig
from glance_runtime.decode.session import Session


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def budget_of(cfg: DecodeConfig) -> int | str:
    """The budget a report records: auto where each round chose its own tree (cfg.budget is then its largest)."""
    return AUTO if cfg.auto else cfg.budget


def audit(session: Session, tasks: list[Task], progress: Callable[[str], None] = lambda _: None) -> dict:
    """Decode every task three times and report parity, self-consistency and pooled tau."""
    cfg = session.config  # resolved (and refused where the backend cannot serve it) before any decoding
    rows, accepted, rounds = [], 0, 0
    for i, task in enumerate(tasks, 1):
        prompt = session.prompt(task.prompt, task.image)
        ref = session.reference(prompt)
        again = session.reference(prompt)
        spec = session.decode(prompt)
        accepted += sum(r.accepted for r in spec.rounds)
        rounds += len(spec.rounds)
        div = first_divergence(spec.tokens, ref)
        rows.append({"prompt": task.prompt, "image": str(task.image) if task.image else None,
                     "identical": div is None, "self_consistent": again == ref, "first_divergence": div,
                     "tokens": len(spec.tokens), "rounds": len(spec.rounds), "tau": round(spec.tau, 4)})
        progress(f"[{i}/{len(tasks)}] identical={div is None} tau={spec.tau:.2f} tokens={len(spec.tokens)}")
    identical = sum(r["identical"] for r in rows)
    consistent = sum(r["self_consistent"] for r in rows)
    return {"backend": session.backend.name, "n": len(rows), "identical": identical, "self_consistent": consistent,
            "first_divergence": [r["first_divergence"] for r in rows],
            "tau": round(accepted / rounds, 4) if rounds else 0.0, "rounds": rounds,
            "budget": budget_of(cfg), "branch_k": cfg.branch_k, "max_new_tokens": cfg.max_new_tokens,
            "passed": bool(rows) and identical >= consistent, "prompts": rows}
