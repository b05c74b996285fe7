"""Log-probs with speculation: each answered token's report (its log-prob and the best alternatives at its position)
is the one plain decoding reports, greedy or sampled, whatever the budget, the drafts or auto's choices; it is the
target's own log-softmax at that position (checked against one forward over the prompt and the answer); and
ONNX Runtime's fp32 graphs report what the torch reference reports, alone, row by row along the walk, and in a
batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from glance_export.model.torch_backend import TorchBackend
from glance_runtime.backends import graph_backend
from glance_runtime.backends.batch_rounds import BatchRounds
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.decode.batch_loop import BatchLoop, Request
from glance_runtime.decode.loop import DecodeConfig, DecodeResult, decode
from glance_runtime.decode.sampling import GREEDY, SamplingParams, logprobs
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.prompt.codec import exported_codec
from glance_runtime.prompt.messages import user_turn
from support import RECEIPT, REPO, VL_FAMILIES, config, cutting, median_surprisal, shallow

DEFAULT = REPO / "models" / "glance-vl-tiny-onnx"

MAX_NEW = 20
TOP = 5
TOL = 2e-4  # the same rows in passes of other shapes round differently (torch: up to about 5e-5 seen)
ACROSS = 3e-3  # ONNX Runtime's kernels against torch's over a 20-token answer (up to about 7e-4 seen)
SETTINGS = [GREEDY, SamplingParams(temperature=1.3, top_p=0.9, seed=2), SamplingParams(temperature=0.7, top_k=5, seed=3)]


def _cfg(params: SamplingParams, top: int | None = TOP, **kw) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=MAX_NEW, sampling=params, logprobs=top, **kw)


def _same_reports(got: DecodeResult, want: DecodeResult, what: object, tol: float = TOL) -> None:
    assert got.tokens == want.tokens, what
    assert len(got.logprobs) == len(want.logprobs) == (len(got.tokens) if want.logprobs else 0), what
    for i, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
        assert [t for t, _ in g.top] == [t for t, _ in w.top], (what, i)
        assert np.allclose([g.logprob, *(v for _, v in g.top)], [w.logprob, *(v for _, v in w.top)], rtol=tol, atol=tol), (what, i)


def test_every_way_of_decoding_reports_what_plain_decoding_does(backend_for, images):
    backend = backend_for("qwen2_5_vl")
    prompt = backend.snapshot.build_prompt("Describe the picture.", images["wide"])
    split = median_surprisal(backend, prompt, MAX_NEW)
    for params in SETTINGS:
        plain = decode(backend, prompt, _cfg(params, speculative=False))
        seeded = SeededDrafter(backend, plain.tokens, prompt.length, lambda d: 0 if d % 3 else 1)
        runs = {"b3": (backend, _cfg(params, budget=3, branch_k=8)), "b15": (backend, _cfg(params, budget=15, branch_k=8)),
                "seeded": (seeded, _cfg(params, budget=31, branch_k=8))}
        for policy in (cutting, shallow):
            auto = config(policy(split, backend.block_size), MAX_NEW)
            runs[policy.__name__] = (seeded, _cfg(params, budget=auto.budget, branch_k=8, auto=auto.auto))
        for name, (drafter, cfg) in runs.items():
            result = decode(drafter, prompt, cfg)
            _same_reports(result, plain, (name, params))
            if name == "seeded":
                assert max(r.accepted for r in result.rounds) > 2, "no round accepted the seeded answer"


def test_reports_are_the_targets_log_softmax_at_each_answered_position(backend_for):
    """One teacher-forced forward over prompt + answer gives each answered token's row: the reports are its
    log-softmax (a report read off the wrong row, one off along the path, would differ)."""
    backend = backend_for("qwen3")
    prompt = backend.snapshot.build_prompt("Name three colours.", None)
    for params in SETTINGS[:2]:
        seeded_truth = decode(backend, prompt, _cfg(params, speculative=False)).tokens
        seeded = SeededDrafter(backend, seeded_truth, prompt.length, lambda d: 0)
        result = decode(seeded, prompt, _cfg(params, budget=15, branch_k=8))
        ids = np.concatenate([prompt.input_ids, result.tokens[:-1]])
        with torch.no_grad():
            logits = backend.model(input_ids=torch.tensor(ids)[None]).logits[0, prompt.length - 1:].float().numpy()
        want = logprobs(logits, np.array(result.tokens), TOP)
        assert np.allclose([r.logprob for r in result.logprobs], want.chosen, atol=1e-4)
        assert [[t for t, _ in r.top] for r in result.logprobs] == want.top_ids.tolist()
        assert np.allclose([[v for _, v in r.top] for r in result.logprobs], want.top, atol=1e-4)


def test_no_report_is_made_unless_asked_and_zero_alternatives_is_the_token_alone(backend_for):
    backend = backend_for("qwen3")
    prompt = backend.snapshot.build_prompt("Name three colours.", None)
    quiet = decode(backend, prompt, _cfg(GREEDY, None, budget=7))
    alone = decode(backend, prompt, _cfg(GREEDY, 0, budget=7))
    assert quiet.logprobs == [] and alone.tokens == quiet.tokens
    assert len(alone.logprobs) == len(alone.tokens) and all(r.top == () and r.logprob <= 0 for r in alone.logprobs)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_onnx_runtime_reports_what_the_reference_reports(ort_exported, images, family, monkeypatch):
    """fp32 graphs against the torch reference: plain and speculative, with every row reported at once and (a
    vocabulary too large for that) row by row along the walk."""
    ex = ort_exported(family)
    prompt = ex.prompt(images["wide"] if family in VL_FAMILIES else None)
    reference = TorchBackend(ex.snapshot, model=ex.model)
    for params in SETTINGS:
        want = decode(ex.backend, prompt, _cfg(params, speculative=False))
        _same_reports(want, decode(reference, prompt, _cfg(params, speculative=False)), params, ACROSS)
        seeded = SeededDrafter(ex.backend, want.tokens, prompt.length, lambda d: 0 if d % 2 else 1)
        for eager in (graph_backend.EAGER_SAMPLING, 0):
            monkeypatch.setattr(graph_backend, "EAGER_SAMPLING", eager)
            _same_reports(decode(seeded, prompt, _cfg(params, budget=31, branch_k=8)), want, (params, eager))


def test_a_batch_reports_each_request_as_alone():
    """Requests of one batch on the shipped default, with their own settings and alternatives (or none): each
    request's tokens and reports are its own decoded alone."""
    single, batched = OrtBackend(DEFAULT, threads=1), OrtBackend(DEFAULT, threads=1, max_batch=3)
    codec = exported_codec(single.manifest)
    prompts = [codec.encode([user_turn(text, [])]) for text in ("Say something long.", "Count to five.", "Why?")]
    prompts.append(codec.encode([user_turn("What is the total?", [str(RECEIPT)])]))
    asks = [(GREEDY, TOP), (SETTINGS[1], 0), (SETTINGS[2], None), (SamplingParams(temperature=2.0, seed=9), 2)]
    try:
        alone = [decode(single, p, _cfg(params, top, budget=7)) for p, (params, top) in zip(prompts, asks)]
        got = BatchLoop(BatchRounds(batched)).run([Request(p, _cfg(params, top, budget=7))
                                                   for p, (params, top) in zip(prompts, asks)])
        for result, want, ask in zip(got, alone, asks):
            _same_reports(result, want, ask)
    finally:
        single.close()
        batched.close()
