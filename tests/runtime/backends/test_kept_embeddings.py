"""Seeded drafts cost a round what a head's own drafts cost: no vocab run for their embeddings."""
from __future__ import annotations

import numpy as np
import pytest

from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.decode.loop import DecodeConfig, decode


def _counted(backend) -> list[int]:
    """Counts the vocab graph's runs (the real graph still runs)."""
    graph, runs = backend.graphs["vocab"], [0]
    real = graph.run

    def run(inputs, outputs):
        runs[0] += 1
        real(inputs, outputs)

    graph.run = run
    return runs


@pytest.mark.parametrize("seeded", [False, True])
def test_a_round_runs_the_vocab_graph_twice(ort_exported, seeded):
    """Prefill: the prompt's embeddings and its projection; then per round the draft's and the verify pass's
    projections, whether the drafts are the head's own or seeded from the oracle (a round with one token
    left drafts nothing: the verify pass's projection alone)."""
    ex = ort_exported("qwen2")
    prompt = ex.prompt(None)
    truth = ex.oracle(prompt)
    drafter = SeededDrafter(ex.backend, truth, prompt.length, lambda d: 0 if d <= 3 else None) if seeded \
        else ex.backend
    runs = _counted(ex.backend)
    try:
        result = decode(drafter, prompt, DecodeConfig(max_new_tokens=24, budget=7, branch_k=4))
    finally:
        del ex.backend.graphs["vocab"].run
    assert result.tokens == truth[:len(result.tokens)]
    if seeded:
        assert result.tau > 2  # the seeded chain is accepted, so its tokens reached the target's passes
    assert runs[0] == 2 + sum(2 if r.drafted else 1 for r in result.rounds)


def test_kept_rows_are_the_embeddings(ort_exported):
    """Each distinct token once, in id order, holding the target's embedding row."""
    ex = ort_exported("qwen2")
    backend = ex.backend
    backend.keep_embeddings([17, 5, 17, 3])
    kept = backend.device.download(backend._kept_rows.rows(3))
    table = ex.model.get_input_embeddings().weight.detach().numpy()
    np.testing.assert_array_equal(kept, table[[3, 5, 17]])
    backend.keep_embeddings([])
    assert backend._kept_rows is None
