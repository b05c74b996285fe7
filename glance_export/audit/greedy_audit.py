"""Losslessness audit: every task decoded by the greedy oracle twice and by GLANCE once.

The oracle's second run is the self-consistency control: a backend whose own greedy decode is not
repeatable cannot be asked to match it more often than it matches itself. Where GLANCE and the oracle part,
the report gives the oracle's top-2 logit margin at the first differing token when the oracle is the
backend's own greedy decode on graphs (a near tie that a tree pass may round the other way: fp16, or int8
activations); `int8_activations` says whether the graphs compute that way. A sampled audit (`--temperature`)
holds GLANCE's sampled answers against the backend's own plain sampling with the same seeds, likewise.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from glance_runtime.defaults import AUTO
from glance_runtime.formats.draft_ids import graph_ids
from glance_runtime.formats.graphs import DRAFT_VOCAB_GRAPH
from glance_runtime.formats.tasks import Task
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.decode.sampling import GREEDY, SamplingParams, derived
from glance_runtime.decode.session import Session
from glance_runtime.decode.tree import Tree, visibility


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def budget_of(cfg: DecodeConfig) -> int | str:
    """The budget a report records: auto where each round chose its own tree (cfg.budget is then its largest)."""
    return AUTO if cfg.auto else cfg.budget


def divergence_margin(session: Session, prompt, tokens: list[int], index: int) -> float | None:
    """The backend's own top-2 log-prob gap where its greedy decode chose `tokens[index]` (replayed one row at
    a time); None where the backend cannot tell (the torch reference) or the token came from the prefill."""
    backend = session.backend
    if index is None or index == 0 or index >= len(tokens) or not hasattr(backend, "margins"):
        return None
    backend.prefill(prompt)
    for j in range(1, index + 1):
        root = Tree.root(tokens[j - 1])
        backend.verify(root.tokens, root.depths, visibility(root.parents))
        if j == index:
            return round(float(backend.margins(1)[0]), 6)
        backend.commit(np.zeros(1, np.int64))
    return None


def draft_vocabulary(session: Session) -> np.ndarray | None:
    """The target ids a reduced draft vocabulary holds, read from its graph (None: the head scores every token, or
    the backend runs without the graph beside it)."""
    manifest = session.backend.info.manifest
    if manifest is None or not manifest.draft_vocab_size or not (manifest.path / DRAFT_VOCAB_GRAPH).is_file():
        return None
    return graph_ids(manifest.path / DRAFT_VOCAB_GRAPH)


def _plain_sampling(session: Session, prompt, params: SamplingParams) -> list[int]:
    """The backend's own plain sampling with `params` (no draft): what a sampled GLANCE answer must equal."""
    plain = DecodeConfig(max_new_tokens=session.config.max_new_tokens, speculative=False, sampling=params)
    return decode(session.backend, prompt, plain, session.stop_ids).tokens


def audit(session: Session, tasks: list[Task], progress: Callable[[str], None] = lambda _: None,
          sampling: SamplingParams = GREEDY) -> dict:
    """Decode every task three times and report parity, self-consistency, pooled tau and, for a reduced draft
    vocabulary, how many of the greedy answers' tokens it holds (a token outside it can never be drafted).
    With `sampling` (seeded), task i is sampled with the seed + i and compared with the backend's own plain
    sampling with that seed (the torch greedy oracle has no sampling)."""
    cfg = session.config  # resolved (and refused where the backend cannot serve it) before any decoding
    vocabulary = draft_vocabulary(session)
    covered = answered = 0
    rows, accepted, rounds = [], 0, 0
    for i, task in enumerate(tasks, 1):
        prompt = session.prompt(task.prompt, task.image)
        if sampling.greedy:
            ref, again, spec = session.reference(prompt), session.reference(prompt), session.decode(prompt)
        else:
            params = derived(sampling, i - 1)
            ref, again = _plain_sampling(session, prompt, params), _plain_sampling(session, prompt, params)
            spec = session.decode(prompt, config=replace(cfg, sampling=params))
        accepted += sum(r.accepted for r in spec.rounds)
        rounds += len(spec.rounds)
        if vocabulary is not None:
            covered += int(np.isin(ref, vocabulary).sum())
            answered += len(ref)
        div = first_divergence(spec.tokens, ref)
        margin = None if div is None or session.oracle is not None or not sampling.greedy else \
            divergence_margin(session, prompt, ref, div)
        rows.append({"prompt": task.prompt, "image": str(task.image) if task.image else None,
                     "identical": div is None, "self_consistent": again == ref, "first_divergence": div,
                     "margin": margin, "tokens": len(spec.tokens), "rounds": len(spec.rounds),
                     "tau": round(spec.tau, 4)})
        parted = "" if div is None else f" (parts at token {div}, margin {margin})"
        progress(f"[{i}/{len(tasks)}] identical={div is None}{parted} tau={spec.tau:.2f} tokens={len(spec.tokens)}")
    identical = sum(r["identical"] for r in rows)
    consistent = sum(r["self_consistent"] for r in rows)
    quantization = session.backend.info.manifest.quantization if session.backend.info.manifest else None
    return {"backend": session.backend.name, "n": len(rows), "identical": identical, "self_consistent": consistent,
            "int8_activations": bool(quantization and quantization.int8_activations),
            "first_divergence": [r["first_divergence"] for r in rows],
            "divergences": [{"prompt": r["prompt"], "token": r["first_divergence"], "margin": r["margin"]}
                            for r in rows if not r["identical"]],
            "tau": round(accepted / rounds, 4) if rounds else 0.0, "rounds": rounds,
            "budget": budget_of(cfg), "branch_k": cfg.branch_k, "max_new_tokens": cfg.max_new_tokens,
            "sampling": None if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                                      "top_k": sampling.top_k, "min_p": sampling.min_p,
                                                      "seed": sampling.seed},
            "passed": bool(rows) and identical >= consistent,
            "draft_vocab": None if vocabulary is None else {
                "size": len(vocabulary), "coverage": round(covered / answered, 4) if answered else None},
            "prompts": rows}
