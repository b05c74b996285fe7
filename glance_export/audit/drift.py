"""Quantization drift: how far a quantized export's greedy output is from the fp32 export's, prompt by prompt.

GLANCE is lossless against the model that is deployed (the quantized target's own greedy output: the
audit checks that). What quantization itself costs is a separate question, answered here with plain
greedy decoding on both exports, so users see the quality cost apart from the speculation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from glance_runtime.errors import GlanceError
from glance_runtime.formats import artifacts as artifacts_format
from glance_runtime.formats.tasks import read as read_tasks
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.session import Settings

from .greedy_audit import first_divergence


def compare(tokens: list[int], reference: list[int]) -> dict[str, Any]:
    """One prompt: where the outputs first differ and how much of the reference they share."""
    div = first_divergence(tokens, reference)
    same_prefix = len(reference) if div is None else min(div, len(reference))
    positions = max(len(tokens), len(reference))
    return {"identical": div is None, "first_divergence": div, "tokens": len(tokens), "reference_tokens": len(reference),
            "prefix_tokens": same_prefix,
            "position_agreement": round(sum(a == b for a, b in zip(tokens, reference)) / positions, 4) if positions
            else 1.0}


def drift(quantized: Path, reference: Path, task_file: Path, max_new_tokens: int,
          providers: Sequence[str] | None = None) -> dict[str, Any]:
    """Greedy tokens of `quantized` against `reference` (an fp32 export of the same target) on every task."""
    q_manifest, r_manifest = (artifacts_format.read(a) for a in (quantized, reference))
    if q_manifest.source != r_manifest.source:
        raise GlanceError(f"{quantized} and {reference} were exported from different targets; drift compares "
                          f"two exports of one model")
    if r_manifest.quantization:
        raise GlanceError(f"{reference} is itself quantized; pass the fp32 export with --drift-from")
    tasks = read_tasks(task_file)
    plain = Settings(max_new_tokens=max_new_tokens, speculative=False)
    sessions = [open_session(Source("onnxruntime", artifacts=Path(a), providers=providers), plain)
                for a in (quantized, reference)]
    rows = []
    for task in tasks:
        outs = [s.greedy(s.prompt(task.prompt, task.image)) for s in sessions]
        rows.append({"prompt": task.prompt, **compare(*outs)})
    ref_tokens = sum(r["reference_tokens"] for r in rows)
    q = q_manifest.quantization
    return {"quantized": str(quantized), "reference": str(reference), "scheme": q.scheme if q else "none",
            "group_size": q.group_size if q else None, "n": len(rows), "identical": sum(r["identical"] for r in rows),
            "prefix_agreement": round(sum(r["prefix_tokens"] for r in rows) / ref_tokens, 4) if ref_tokens else 1.0,
            "max_new_tokens": max_new_tokens, "prompts": rows}


def drift_lines(report: dict[str, Any]) -> list[str]:
    """The report as text: one line per prompt, then the totals."""
    lines = [f"{'first divergence':>16}  {'agreement':>9}  prompt"]
    for row in report["prompts"]:
        div = "-" if row["first_divergence"] is None else str(row["first_divergence"])
        lines.append(f"{div:>16}  {row['position_agreement']:>9.0%}  {row['prompt'][:60]}")
    lines.append(f"{report['scheme']} (group {report['group_size']}) vs fp32: {report['identical']}/{report['n']} "
                 f"identical, {report['prefix_agreement']:.1%} of fp32 tokens before the first divergence")
    return lines
