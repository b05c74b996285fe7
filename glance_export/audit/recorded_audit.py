"""Audit a backend against a recorded fp32 reference, so a device without torch can check its engines.

Every task is decoded on the backend twice, with GLANCE and with its own greedy (AR) loop, and both are
compared with the fp32 PyTorch greedy tokens recorded on a workstation. Where they differ, the recorded
fp32 top-2 margin at the first differing token shows the divergence to be a near-tie flip (expected in
fp16/bf16, where tree and single-token passes reduce in different orders) or not.

Gate: an fp32 backend matches the reference on every prompt; a reduced-precision one
matches it on at least as many prompts as its own greedy decode does (the self-consistency control).
Torch-free: the device side imports this module.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from glance_runtime.errors import GlanceError
from glance_runtime.formats.recorded_reference import RECORD, RecordedTask, Reference
from glance_runtime.formats.tasks import Task
from glance_runtime.decode.session import Session

from .greedy_audit import budget_of, first_divergence
from .reference_match import array_sha256, ids_sha256

def _difference(tokens: list[int], rec: RecordedTask) -> dict[str, Any]:
    """First token where `tokens` leaves the reference, the two tokens there and the fp32 margin there."""
    at = first_divergence(tokens, rec.tokens)
    if at is None:
        return {"identical": True, "first_divergence": None, "token": None, "reference_token": None,
                "fp32_margin": None}
    return {"identical": False, "first_divergence": at, "token": tokens[at] if at < len(tokens) else None,
            "reference_token": rec.tokens[at] if at < len(rec.tokens) else None,
            "fp32_margin": rec.margins[at] if at < len(rec.margins) else None}


def _between(glance: list[int], own: list[int], g: dict[str, Any], a: dict[str, Any],
             rec: RecordedTask) -> dict[str, Any]:
    """GLANCE against the backend's own greedy. The fp32 margin applies only where both still follow the
    reference up to that token (else the reference never saw that context)."""
    at = first_divergence(glance, own)
    firsts = [x["first_divergence"] for x in (g, a) if not x["identical"]]
    left = min(firsts) if firsts else None
    margin = rec.margins[at] if at is not None and at == left and at < len(rec.margins) else None
    return {"identical": at is None, "first_divergence": at, "fp32_margin": margin}


def _gate(precision: str, identical: int, own_identical: int, n: int) -> tuple[str, bool]:
    """fp32 is identical everywhere; reduced precision does at least as well as its own greedy."""
    if precision == "fp32":
        return f"fp32: identical to the reference on every prompt ({identical}/{n})", n > 0 and identical == n
    return (f"{precision}: identical to the reference on at least as many prompts as the backend's own greedy "
            f"({identical} vs {own_identical})", n > 0 and identical >= own_identical)


def _check_prompts(prompts: Sequence[Any], ref: Reference, path: Path) -> None:
    for i, (prompt, rec) in enumerate(zip(prompts, ref.tasks), 1):
        if ids_sha256(prompt.input_ids) != rec.input_ids_sha256:
            raise GlanceError(f"prompt {i} becomes other token ids on this install than when reference {path} "
                              f"was recorded (tokenizer or chat template differ); use artifacts exported from the "
                              f"recorded model, or {RECORD}")


def audit_against_reference(session: Session, ref: Reference, path: Path, tasks: Sequence[Task],
                            progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Decode every task with GLANCE and with the backend's own greedy; compare both with the reference."""
    precision, cfg = session.backend.info.precision, session.config
    prompts = [session.prompt(t.prompt, t.image) for t in tasks]
    _check_prompts(prompts, ref, path)
    rows, accepted, rounds = [], 0, 0
    for i, (task, prompt, rec) in enumerate(zip(tasks, prompts, ref.tasks), 1):
        spec = session.decode(prompt)
        own = session.greedy(prompt)
        accepted += sum(r.accepted for r in spec.rounds)
        rounds += len(spec.rounds)
        g, a = _difference(spec.tokens, rec), _difference(own, rec)
        rows.append({"prompt": task.prompt, "image": str(task.image) if task.image else None, **g,
                     "own_greedy": a, "glance_vs_own_greedy": _between(spec.tokens, own, g, a, rec),
                     "same_pixels": array_sha256(prompt.pixel_values) == rec.pixels_sha256,
                     "tokens": len(spec.tokens), "rounds": len(spec.rounds), "tau": round(spec.tau, 4)})
        progress(f"[{i}/{len(tasks)}] identical={g['identical']} own greedy identical={a['identical']} "
                 f"tau={spec.tau:.2f}")
    identical = sum(r["identical"] for r in rows)
    own_identical = sum(r["own_greedy"]["identical"] for r in rows)
    gate, passed = _gate(precision, identical, own_identical, len(rows))
    margins = [m for rec in ref.tasks for m in rec.margins]
    return {"mode": "reference", "reference": str(path), "recorded_with": ref.recorded_with,
            "backend": session.backend.name, "precision": precision, "n": len(rows), "identical": identical,
            "own_greedy_identical": own_identical,
            "identical_to_own_greedy": sum(r["glance_vs_own_greedy"]["identical"] for r in rows),
            "first_divergence": [r["first_divergence"] for r in rows],
            "median_fp32_margin": statistics.median(margins) if margins else None,
            "tau": round(accepted / rounds, 4) if rounds else 0.0, "rounds": rounds, "budget": budget_of(cfg),
            "branch_k": cfg.branch_k, "max_new_tokens": cfg.max_new_tokens, "gate": gate,
            "passed": passed, "prompts": rows}


def _where(diff: dict[str, Any]) -> str:
    margin = "n/a" if diff["fp32_margin"] is None else f"{diff['fp32_margin']:.4g}"
    picked = f", {diff['token']} instead of {diff['reference_token']}" if diff.get("reference_token") is not None \
        else ""
    return f"token {diff['first_divergence']} (fp32 top-2 margin {margin}{picked})"


def summary(report: dict[str, Any]) -> list[str]:
    """The readable report: totals, one line per prompt that differs anywhere, the verdict."""
    n = report["n"]
    lines = [f"{report['backend']} {report['precision']} vs fp32 reference {report['reference']}: GLANCE identical "
             f"{report['identical']}/{n}, own greedy identical {report['own_greedy_identical']}/{n}, GLANCE = own "
             f"greedy {report['identical_to_own_greedy']}/{n}; tau {report['tau']:.2f} over {report['rounds']} rounds"]
    for i, row in enumerate(report["prompts"], 1):
        own, both = row["own_greedy"], row["glance_vs_own_greedy"]
        if row["identical"] and own["identical"] and both["identical"]:
            continue
        parts = [f"GLANCE differs from the reference at {_where(row)}" if not row["identical"] else "GLANCE identical",
                 f"own greedy at {_where(own)}" if not own["identical"] else "own greedy identical"]
        if not both["identical"]:
            parts.append(f"GLANCE vs own greedy at {_where(both)}")
        pixels = "" if row["same_pixels"] else " [pixels differ from the recorded ones]"
        lines.append(f"  prompt {i} {row['prompt'][:40]!r}: " + "; ".join(parts) + pixels)
    if len(lines) > 1 and report["median_fp32_margin"] is not None:
        lines.append(f"  (median fp32 top-2 margin over the reference: {report['median_fp32_margin']:.4g})")
    lines.append(f"{'PASS' if report['passed'] else 'FAIL'} ({report['gate']})")
    return lines
