"""OrtBackend on exported tiny models: token parity with the torch greedy oracle, no torch at run time.

Artifacts are built with the real exporter from the shared tiny snapshots. Prompts come from the
backend's own torch-free builder and are handed unchanged to the oracle, so any divergence is the
graphs', the caches' or the loop's, never the tokenizer's.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import glance_runtime.backends.ort_backend as ort_backend
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.backends.ort_backend import OrtBackend
from glance_export.model.head import load_head
from glance_export.model.torch_backend import TorchBackend
from glance_runtime.decode.auto_budget import AutoBudget
from glance_runtime.decode.backend import block_rows
from glance_runtime.decode.calibration import PRIOR
from glance_runtime.decode.cost_profile import measure
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.codec import exported_codec
from support import (ALL_FAMILIES, BLOCK_TRAINING_STACK, VL_FAMILIES, ORACLE_TOKENS, check_mixed, config, cutting,
                     median_surprisal, shallow, skipping)

MAX_NEW = ORACLE_TOKENS  # as long as the oracle answers
BUDGETS = {"chain": (7, 1), "b8": (8, 8), "b31": (31, 8), "b63": (63, 8)}
TEXT = "What colour is the square?"


def _cases():
    for family in ALL_FAMILIES:
        for image in (["wide", "tall", None] if family in VL_FAMILIES else [None]):
            yield family, image


def _cfg(budget: str, block_size: int = 8) -> DecodeConfig:
    nodes, k = BUDGETS[budget]
    return DecodeConfig(max_new_tokens=MAX_NEW, budget=min(nodes, block_size - 1) if k == 1 else nodes, branch_k=k)


@pytest.mark.parametrize("family,image", list(_cases()))
def test_random_head_matches_oracle(ort_exported, images, family, image):
    ex = ort_exported(family)
    prompt = ex.prompt(images[image] if image else None)
    truth = ex.oracle(prompt)
    assert decode(ex.backend, prompt, DecodeConfig(max_new_tokens=MAX_NEW, speculative=False)).tokens == truth
    for budget in BUDGETS:
        assert decode(ex.backend, prompt, _cfg(budget)).tokens == truth, budget


def test_block_16_head(ort_exported, images):
    ex = ort_exported("qwen3_vl", 16)
    prompt = ex.prompt(images["large"])
    truth = ex.oracle(prompt)
    for budget in ("chain", "b63"):
        assert decode(ex.backend, prompt, _cfg(budget, 16)).tokens == truth


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "llama"])
def test_opset_23_attention_graphs(ort_exported, images, family):
    """Graphs using the ONNX Attention op (opset 23) run through the same backend, token for token."""
    ex = ort_exported(family, opset=23)
    prompt = ex.prompt(images["tall"] if family in VL_FAMILIES else None)
    truth = ex.oracle(prompt)
    for budget in ("chain", "b31"):
        assert decode(ex.backend, prompt, _cfg(budget)).tokens == truth
    assert decode(SeededDrafter(ex.backend, truth, prompt.length, lambda d: 0), prompt, _cfg("b31")).tokens == truth


def test_fp16_artifacts(ort_exported, images):
    """fp16 graphs run with fp16 caches; on these wide-margin tiny models speculative output equals the
    same backend's AR output (the fp16 gate in general is the self-consistency control: at least as many identical answers as
    the backend's own greedy decode gets against the fp32 reference)."""
    ex = ort_exported("qwen2_5_vl", dtype="fp16")
    assert ex.backend.kv.buffer.dtype == np.float16
    prompt = ex.prompt(images["wide"])
    ar = decode(ex.backend, prompt, DecodeConfig(max_new_tokens=MAX_NEW, speculative=False)).tokens
    for budget in ("chain", "b31"):
        assert decode(ex.backend, prompt, _cfg(budget)).tokens == ar
    seeded = decode(SeededDrafter(ex.backend, ar, prompt.length, lambda d: 0), prompt, _cfg("b31"))
    assert seeded.tokens == ar and seeded.tau > 2


def test_the_backend_declares_what_it_serves_and_times_its_own_graphs(images):
    """info names the served directory, limits and precision; time_graphs installs one clock that counts
    every run of a decode; close releases the graphs and may be called again."""
    backend = OrtBackend(DEFAULT_ARTIFACTS, max_tree=16, threads=1)
    info = backend.info
    assert info.home == DEFAULT_ARTIFACTS and info.manifest.path == DEFAULT_ARTIFACTS
    assert info.limits.max_tree == 16 and info.limits.max_branch_k == info.manifest.branch_k and info.limits.exported
    assert info.precision == "fp32" and info.providers == ("CPUExecutionProvider",) and info.threads == 1
    clock = backend.time_graphs()
    assert backend.time_graphs() is clock
    prompt = exported_codec(info.manifest).turn("What is shown?", images["wide"])
    result = decode(backend, prompt, DecodeConfig(max_new_tokens=6, budget=15), info.manifest.stop_token_ids)
    runs = clock.runs()
    assert runs["vision"] == 1 and runs["target"] == 1 + len(result.rounds) and sum(clock.reading().values()) > 0
    verified = backend.verify(np.array([result.tokens[-1]]), np.zeros(1, np.int64), np.ones((1, 1), bool))
    assert verified.argmax.shape == verified.confidence.shape == (1,) and isinstance(verified.entropy, float)
    backend.close()
    backend.close()


@pytest.mark.parametrize("speculative", [True, False])
def test_a_round_is_at_most_four_graph_runs(ort_exported, images, speculative):
    """draft, vocab (project the block), target (verify), vocab (project the tree): the embeddings the
    next pass needs come back with each projection, so no round runs the vocab graph a third time."""
    ex = ort_exported("qwen2_5_vl")
    backend = OrtBackend(ex.artifacts)
    clock = backend.time_graphs()
    prompt = ex.prompt(images["wide"])
    result = decode(backend, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=31, speculative=speculative))
    rounds = len(result.rounds)
    assert result.tokens == ex.oracle(prompt) and rounds > 3
    prefill = Counter(vision=1, target=1, vocab=2)  # embed the prompt, project its last row
    drafted = sum(r.drafted for r in result.rounds)  # every round but one left a single token (a plain step)
    assert drafted >= rounds - 1 if speculative else drafted == 0
    assert Counter(clock.runs()) == prefill + Counter(draft=drafted, vocab=rounds + drafted, target=rounds)


class _Metered(SeededDrafter):
    """Records the device traffic of each round (from one commit to the next)."""

    def __init__(self, backend, truth, prompt_len):
        super().__init__(backend, truth, prompt_len, lambda d: 0)
        self.rounds: list[tuple[int, int, int]] = []

    def prefill(self, prompt):
        out = super().prefill(prompt)
        self.inner.device.traffic.reset()
        return out

    def commit(self, rows):
        super().commit(rows)
        t = self.inner.device.traffic
        self.rounds.append((t.h2d_bytes, t.d2h_bytes, t.calls))
        t.reset()


def test_vocabulary_graphs_open_first_and_sessions_plan_no_memory_patterns(ort_exported, monkeypatch):
    """For the peak resident set: a quantized LM head's session holds its stored blocks beside their repacked copy
    while it starts, so that happens before the target is resident; and a decode's shapes change every step, so
    memory patterns would plan a block per run that the arena keeps."""
    ex = ort_exported("qwen2_5_vl")
    opened: list[str] = []
    real = ort_backend.open_cached

    def recording(ort, source, digest, providers, options):
        session = real(ort, source, digest, providers, options)
        opened.append(Path(source).stem)
        assert session.get_session_options().enable_mem_pattern is False
        return session

    monkeypatch.setattr(ort_backend, "open_cached", recording)
    backend = OrtBackend(ex.artifacts)
    assert opened[0] == "vocab" and sorted(opened) == sorted(backend.graphs)
    assert list(backend.graphs)[:3] == ["target", "draft", "vocab"]


def test_kv_never_crosses_the_host(ort_exported):
    """Per round the host sends the tree and reads top-k rows: the same bytes and the same number of device
    calls whether 20 or 300 rows of context sit in the cache, and far less than the cache itself."""
    ex = ort_exported("qwen2")
    backend = OrtBackend(ex.artifacts)
    per_round = []
    for text in (TEXT, TEXT + " Describe nothing." * 24):
        prompt = ex.prompt(None, text)
        metered = _Metered(backend, ex.oracle(prompt), prompt.length)
        result = decode(metered, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=31))
        assert result.tokens == ex.oracle(prompt) and result.tau > 3
        # the first round's draft still takes in the prompt's rows; the last may be cut by max_new_tokens
        per_round.append(metered.rounds[1:-1])
    short, long = per_round
    assert long[:len(short)] == short[:len(long)] and len(short) >= 2
    kv_bytes = backend.kv.length * backend.kv.slots * backend.kv.row_bytes
    assert backend.kv.length > 250 and max(h2d + d2h for h2d, d2h, _ in long) < kv_bytes / 8


SEEDS = {"full": lambda d: 0, "partial": lambda d: 0 if d <= 2 else None, "zero": lambda d: None,
         "second_branch": lambda d: 1 if d == 1 else 0}


SEEDED_CASES = [(seed, budget) for seed in SEEDS for budget in ("chain", "b31")
                if (seed, budget) != ("second_branch", "chain")]  # a chain has no second branch


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("seed,budget", SEEDED_CASES)
def test_seeded_acceptance_matches_oracle(ort_exported, images, family, seed, budget):
    """Drafts that are right at chosen offsets: full, partial, zero and off-first-branch acceptance,
    so multi-row commits compact the KV caches and the head context grows by several rows."""
    ex = ort_exported(family)
    prompt = ex.prompt(images["wide"] if family in VL_FAMILIES else None)
    truth = ex.oracle(prompt)
    result = decode(SeededDrafter(ex.backend, truth, prompt.length, SEEDS[seed]), prompt, _cfg(budget))
    assert result.tokens == truth
    taus = [r.accepted for r in result.rounds[:-1]]
    if seed == "zero":
        assert all(t == 1 for t in taus)
    else:
        assert taus and all(t >= 2 for t in taus)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_auto_matches_oracle(ort_exported, images, family):
    """Lossless whatever auto decides, on the graphs: rounds that skip the draft and cuts of any size (random
    head and seeded drafts, on constructed costs, so what each policy forces is checked), then a profile measured
    here with the prior, as `--budget auto` runs by default, and with a law that makes some of its rounds skip:
    those choices come from timings taken during the test, so only their tokens and bounds are checked."""
    ex = ort_exported(family)
    prompt = ex.prompt(images["wide"] if family in VL_FAMILIES else None)
    truth = ex.oracle(prompt)
    split = median_surprisal(ex.backend, prompt, MAX_NEW)
    seeded = SeededDrafter(ex.backend, truth, prompt.length, SEEDS["partial"])
    for policy in (skipping, cutting, shallow):
        for drafter in (ex.backend, seeded):
            result = decode(drafter, prompt, config(policy(split, 8), MAX_NEW))
            assert result.tokens == truth, (policy.__name__, drafter is seeded)
            check_mixed(result, policy.__name__, seeded=drafter is seeded)
    measured = measure(ex.backend, prompt, max_rows=64, branch_k=8, seconds=0.2)
    assert measured.rows == (1, 2, 4, 8, 16, 32, 64) and measured.draft_ms > 0
    assert measured.draft_depths == (1, 2, 4, 7) and measured.draft_share[-1] == 1.0
    assert all(0 < share <= 1 for share in measured.draft_share)
    for drafter, policy in ((seeded, AutoBudget(measured, PRIOR, 63, 8)),
                            (ex.backend, skipping(split, 8, cost=measured))):
        result = decode(drafter, prompt, config(policy, MAX_NEW))
        assert result.tokens == truth
        assert all(1 <= r.tree_size <= 64 and r.accepted <= r.tree_size for r in result.rounds)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_generated_image_token_is_a_plain_token(ort_exported, images, family):
    """A pass holding one image-token id (the model may generate it) must embed it as a token, as the
    HF model does without pixels, not substitute an image row."""
    ex = ort_exported(family)
    prompt = ex.prompt(images["wide"])
    reference = TorchBackend(ex.snapshot, model=ex.model)
    token = ex.snapshot.image_token_id
    tree = (np.array([token, 7, 9]), np.array([0, 1, 1]), np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool))
    for backend in (ex.backend, reference):
        backend.prefill(prompt)
    ours, ref = ex.backend.verify(*tree), reference.verify(*tree)
    np.testing.assert_array_equal(ours[0], ref[0])
    assert abs(ours[1] - ref[1]) < 1e-3
    np.testing.assert_allclose(ours[2], ref[2], atol=1e-3)  # each row's confidence in its argmax
    assert ours[2].shape == (3,) and np.all(ours[2] <= 0)


def test_stop_token_and_stop_ids(ort_exported, images):
    ex = ort_exported("qwen2_5_vl")
    assert ex.codec.stop_ids == ex.snapshot.stop_token_ids
    prompt = ex.prompt(images["wide"])
    truth = ex.oracle(prompt)
    stop = truth[5]
    expected = ex.oracle(prompt, stops=(stop,))
    result = decode(SeededDrafter(ex.backend, truth, prompt.length, lambda d: 0), prompt, _cfg("chain"),
                    stop_ids=(stop,))
    assert result.tokens == expected and result.stopped_on == stop


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_prompt_matches_adapter(ort_exported, images, family):
    ex = ort_exported(family)
    for image in (images["wide"], None):
        ours, ref = ex.prompt(image), ex.snapshot.build_prompt(TEXT, image)
        np.testing.assert_array_equal(ours.input_ids, ref.input_ids)
        if image is not None:
            np.testing.assert_array_equal(ours.pixel_values, ref.pixel_values)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_text_prompt_matches_adapter(ort_exported, family):
    """Includes digits: transformers splits them one by one for qwen2, so the export must ship that tokenizer."""
    ex = ort_exported(family)
    for text in (TEXT, "Read the total: 42.17", ""):
        np.testing.assert_array_equal(ex.prompt(None, text).input_ids, ex.snapshot.build_prompt(text).input_ids)


def test_committed_kv_matches_fresh_prefill(ort_exported, images):
    """After multi-token rounds the compacted cache equals a fresh prefill over the committed tokens."""
    ex = ort_exported("qwen2_5_vl")
    prompt = ex.prompt(images["wide"])
    truth = ex.oracle(prompt)
    backend = ex.backend
    decode(SeededDrafter(backend, truth, prompt.length, lambda d: 0 if d <= 3 else None), prompt, _cfg("b31"))
    rows = backend.kv.length
    kept = backend.kv.host_view()
    committed = np.concatenate([prompt.input_ids, truth[:rows - prompt.length]])
    fresh = OrtBackend(ex.artifacts)
    fresh.prefill(type(prompt)(committed, prompt.pixel_values, prompt.image_grid_thw))
    assert fresh.kv.length == rows
    for ours, ref in zip(kept, fresh.kv.host_view()):
        np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)


def test_limits_and_provider_errors(ort_exported, images):
    ex = ort_exported("qwen2")
    prompt = ex.prompt(None)
    with pytest.raises(GlanceError, match="prompt longer than --max-context 8"):
        OrtBackend(ex.artifacts, max_context=8).prefill(prompt)
    small = OrtBackend(ex.artifacts, max_context=prompt.length + 10)
    with pytest.raises(GlanceError, match="--max-context"):
        decode(small, prompt, DecodeConfig(max_new_tokens=40, budget=31))
    with pytest.raises(GlanceError, match="--max-tree 8"):
        decode(OrtBackend(ex.artifacts, max_tree=8), prompt, DecodeConfig(max_new_tokens=4, budget=31))
    with pytest.raises(GlanceError, match="outside 1..64"):
        OrtBackend(ex.artifacts, max_tree=65)
    with pytest.raises(GlanceError, match="branch-k 9"):
        decode(ex.backend, prompt, DecodeConfig(max_new_tokens=4, budget=31, branch_k=9))
    with pytest.raises(GlanceError, match="not available"):
        OrtBackend(ex.artifacts, providers=["tensorrt"])
    assert OrtBackend(ex.artifacts, providers="cpu").info.providers == ("CPUExecutionProvider",)
    with pytest.raises(GlanceError, match="text-only"):
        ex.codec.turn("hi", images["wide"])


def test_corrupt_graph_fails_in_one_line(ort_exported, tmp_path):
    art = Path(shutil.copytree(ort_exported("qwen3").artifacts, tmp_path / "art"))
    (art / "draft.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(GlanceError, match="draft.onnx .*re-export with `glance-export onnx`") as err:
        OrtBackend(art)
    assert "\n" not in str(err.value)


BLOCKED_RUN = BLOCK_TRAINING_STACK + """
import json
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.codec import exported_codec

artifacts, image, text, max_new = sys.argv[1:5]
backend = OrtBackend(artifacts)
prompt = exported_codec(backend.manifest).turn(text, image or None)
out = {"ids": prompt.input_ids.tolist()}
for name, cfg in {"ar": DecodeConfig(max_new_tokens=int(max_new), speculative=False),
                  "tree": DecodeConfig(max_new_tokens=int(max_new), budget=31),
                  "chain": DecodeConfig(max_new_tokens=int(max_new), budget=7, branch_k=1)}.items():
    out[name] = decode(backend, prompt, cfg, stop_ids=backend.manifest.stop_token_ids).tokens
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print(json.dumps(out))
"""


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3"])
def test_full_loop_runs_without_torch(ort_exported, images, family):
    ex = ort_exported(family)
    image = images["tall"] if family in VL_FAMILIES else None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3] / "runtime"),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", BLOCKED_RUN, str(ex.artifacts), str(image or ""), TEXT, str(MAX_NEW)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    prompt = ex.prompt(image)
    assert out["ids"] == prompt.input_ids.tolist()
    truth = ex.oracle(prompt, stops=ex.codec.stop_ids)
    assert out["ar"] == out["tree"] == out["chain"] == truth


def _outcome(drafter, prompt, cfg: DecodeConfig) -> tuple[list[int], str | None]:
    """The tokens streamed and the refusal, if any: what a user of `glance-run` sees."""
    streamed: list[int] = []
    try:
        decode(drafter, prompt, cfg, on_commit=lambda new, _reports: streamed.extend(new))
    except GlanceError as exc:
        return streamed, str(exc)
    return streamed, None


@pytest.mark.parametrize("family", [f if f == "qwen2_vl" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in ALL_FAMILIES])
def test_context_end_matches_greedy(ort_exported, images, family):
    """At every --max-context from the prompt length to past the answer, GLANCE streams exactly what greedy
    streams and stops (or is refused) where greedy is: each round's tree is cut to the rows left."""
    ex = ort_exported(family)
    prompt = ex.prompt(images["wide"] if family in VL_FAMILIES else None)
    truth = ex.oracle(prompt)
    split = median_surprisal(ex.backend, prompt, MAX_NEW)
    for limit in range(prompt.length, prompt.length + len(truth) + 1):
        backend = OrtBackend(ex.artifacts, max_context=limit)
        seeded = SeededDrafter(backend, truth, prompt.length, SEEDS["full"])
        greedy = _outcome(backend, prompt, DecodeConfig(max_new_tokens=MAX_NEW, speculative=False))
        fits = min(len(truth), 1 + limit - prompt.length)  # greedy commits one row a token
        assert greedy[0] == truth[:fits] and (greedy[1] is None) == (fits == len(truth)), (limit, greedy)
        for drafter, cfg in ((backend, _cfg("b31")), (seeded, _cfg("b31")), (seeded, _cfg("chain")),
                             (seeded, config(cutting(split, 8), MAX_NEW))):
            assert _outcome(drafter, prompt, cfg) == greedy, (limit, cfg)


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("names", [("wide", "tall"), ("square", "wide", "tall")])
def test_several_images_match_oracle(ort_exported, images, family, names):
    """The vision graph runs once per image; the rows (and Qwen3-VL's deepstack rows) are concatenated."""
    from glance_runtime.prompt.messages import user_turn

    ex = ort_exported(family)
    prompt = ex.codec.encode([user_turn(TEXT, [images[n] for n in names])])
    assert len(prompt.image_grid_thw) == len(names)
    truth = ex.oracle(prompt)
    assert truth != ex.oracle(ex.prompt(images[names[0]]))
    for budget in ("b31", "chain"):
        assert decode(ex.backend, prompt, _cfg(budget)).tokens == truth


def test_a_shallow_round_drafts_a_short_block_as_the_torch_head_does(ort_exported, images):
    """A draft for d depths runs the head over the anchor, d masks and a few more (`block_rows`), not the whole
    block: the graphs' drafts at each depth are the torch reference's at that depth, and a shallow one is not the
    whole block's first rows (the head's rows see each other)."""
    ex = ort_exported("qwen2_5_vl")
    prompt = ex.prompt(images["wide"])
    reference = TorchBackend(ex.snapshot, load_head(ex.artifacts.parent / "head"), model=ex.model)
    anchor = ex.backend.prefill(prompt)[0]
    assert reference.prefill(prompt)[0] == anchor and ex.backend.manifest.short_blocks
    drafts = {}
    for depth in (1, 2, 4, None):
        (ids, logp), (ref_ids, ref_logp) = ex.backend.draft(anchor, 8, depth), reference.draft(anchor, 8, depth)
        np.testing.assert_allclose(logp, ref_logp, atol=1e-4)
        gaps = np.abs(np.diff(ref_logp, axis=1))
        clear = np.concatenate([gaps, np.full_like(gaps[:, :1], np.inf)], 1) > 1e-3
        clear &= np.concatenate([np.full_like(gaps[:, :1], np.inf), gaps], 1) > 1e-3
        assert (ids[clear] == ref_ids[clear]).all() and clear.any()
        drafts[depth] = logp
    assert block_rows(8, 1) < 8 and np.abs(drafts[1][0] - drafts[None][0]).max() > 1e-3
    manifest = ex.backend.manifest  # an export from before short blocks (no Bk axis) drafts whole blocks
    ex.backend.manifest = dataclasses.replace(manifest, axes={k: v for k, v in manifest.axes.items() if k != "Bk"})
    try:
        np.testing.assert_allclose(ex.backend.draft(anchor, 8, 1)[1], drafts[None][:1], atol=1e-6)
    finally:
        ex.backend.manifest = manifest
