"""EAGLE-3 heads on ONNX Runtime: a random head exported with each family's tiny target decodes exactly what the
greedy oracle does, with its own drafts and with seeded ones (full, partial, zero acceptance), also across turns
that keep earlier rows; and the backend's draft_root/draft_step give what the torch head computes from scratch
over the same committed stream (taps of the torch target, positions, masks, parents' hidden rows)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import eagle3_config_for, init_eagle3, log_softmax_top, rows_mask, save_eagle3
from glance_export.model.torch_backend import greedy_reference
from glance_export.onnx import export_artifacts
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.decode.sampling import SamplingParams
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime.prompt.codec import exported_codec
from glance_runtime.prompt.messages import user_turn
from glance_runtime.prompt.prefix_reuse import Committed, image_runs, shared_rows
from support import ALL_FAMILIES, ORACLE_TOKENS, SEEDS, VL_FAMILIES

SETTINGS = [(budget, k) for budget in (1, 7, 63) for k in (1, 8)]
TEXT = "What colour is the square?"


class Eagle3Export:
    """A family's tiny snapshot with a random EAGLE-3 head (wide init, so its drafts vary), exported and opened."""

    def __init__(self, root: Path, snapshot_path: Path):
        self.snapshot = Snapshot(snapshot_path)
        self.model = self.snapshot.load_model()
        self.head = init_eagle3(eagle3_config_for(self.snapshot), seed=1, std=0.3)
        head_dir = save_eagle3(self.head, root / "head")
        self.artifacts = export_artifacts(snapshot_path, head_dir, root / "artifacts", max_tree=64, max_context=512,
                                          progress=lambda _: None)
        self.backend = OrtBackend(self.artifacts)
        self.codec = exported_codec(self.backend.manifest)
        self._truth: dict[bytes, list[int]] = {}

    def oracle(self, prompt) -> list[int]:
        key = prompt.input_ids.tobytes()
        if key not in self._truth:
            self._truth[key] = greedy_reference(self.model, self.snapshot, prompt, ORACLE_TOKENS, ())
        return self._truth[key]


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    built: dict[str, Eagle3Export] = {}

    def get(family: str) -> Eagle3Export:
        if family not in built:
            built[family] = Eagle3Export(tmp_path_factory.mktemp(f"eagle3_{family}"), snapshot_dir(family))
        return built[family]

    return get


def _prompt(ex: Eagle3Export, images, family: str):
    return ex.codec.turn(TEXT, images["wide"] if family in VL_FAMILIES else None)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_random_head_matches_oracle(exported, images, family):
    ex = exported(family)
    assert ex.backend.info.limits.drafter == "steps" and ex.backend.block_size == EAGLE3_DEPTH + 1
    prompt = _prompt(ex, images, family)
    truth = ex.oracle(prompt)
    for budget, k in SETTINGS:
        result = decode(ex.backend, prompt, DecodeConfig(max_new_tokens=ORACLE_TOKENS, budget=budget, branch_k=k))
        assert result.tokens == truth, (budget, k)


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("seed", list(SEEDS))
def test_seeded_drafts_match_oracle(exported, images, family, seed):
    ex = exported(family)
    prompt = _prompt(ex, images, family)
    truth = ex.oracle(prompt)
    seeded = SeededDrafter(ex.backend, truth, prompt.length, SEEDS[seed])
    result = decode(seeded, prompt, DecodeConfig(max_new_tokens=ORACLE_TOKENS, budget=63, branch_k=8))
    assert result.tokens == truth
    if seed == "zero":
        assert all(r.accepted == 1 for r in result.rounds)
    else:
        assert result.tau > 1 and max(r.accepted for r in result.rounds) > 2


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_follow_up_turns_keep_rows_and_match_fresh_decodes(exported, images, family):
    """Each turn prefills only the rows after the shared prefix; the head recomputes its row before them (whose
    next token changed) from the taps it kept."""
    ex = exported(family)
    m = ex.backend.manifest
    token, merge = (m.image_token_id, m.spatial_merge_size) if m.is_vl else (None, 1)
    messages, committed = [], None
    turns = [user_turn(TEXT, [images["wide"]] if m.is_vl else []), user_turn("Describe the image."),
             user_turn("How many circles are there?")]
    for i, turn in enumerate(turns):
        messages.append(turn)
        prompt = ex.codec.encode(messages)
        keep = shared_rows(committed, prompt, token, merge)
        assert (keep > 10) == (i > 0)
        truth = ex.oracle(prompt)[:16]
        seeded = SeededDrafter(ex.backend, truth, prompt.length, SEEDS["full" if i % 2 else "partial"])
        result = decode(seeded, prompt, DecodeConfig(max_new_tokens=16, budget=31, branch_k=8), keep=keep)
        assert result.tokens == truth and result.tau > 1
        committed = Committed(np.concatenate([prompt.input_ids, np.asarray(result.tokens, np.int64)])[:ex.backend.start],
                              tuple(image_runs(prompt, token, merge)))
        messages.append({"role": "assistant", "content": ex.codec.decode(result.tokens)})


# ---- the backend's steps against the torch head, from scratch -------------------------------------------------

def _torch_root(ex: Eagle3Export, stream: list[int], anchor: int, k: int):
    """The head over committed rows 0..s-1 of a text-only stream (taps of the torch target), causal: top-k of the
    last row, its pre-norm rows and K/V."""
    head, ids = ex.head, torch.tensor([stream])
    with torch.no_grad():
        states = ex.model(input_ids=ids, output_hidden_states=True).hidden_states
        layers = len(states) - 1
        taps = torch.cat([states[t + 1][0] for t in head.config.taps(layers)], dim=-1)
        embed = ex.model.get_input_embeddings()
        nexts = torch.tensor([stream[1:] + [anchor]])
        positions = torch.arange(len(stream))[None, None].expand(3, 1, -1)
        normed, prenorm, kv = head(embed(nexts), head.fuse(taps)[None], positions)
        top, logp = log_softmax_top(head.logits(normed[0, -1:]), k)
    return head.target_ids(top[0]).numpy(), logp[0].numpy(), prenorm[0], kv


def _torch_step(ex: Eagle3Export, tokens, hidden, depth_pos: int, past, visible):
    """Nodes at one position over the committed rows and earlier nodes (`visible` [n, past + n])."""
    head = ex.head
    with torch.no_grad():
        embeds = ex.model.get_input_embeddings()(torch.tensor([tokens]))
        positions = torch.full((3, 1, len(tokens)), depth_pos)
        normed, prenorm, kv = head(embeds, hidden[None], positions, past, rows_mask(torch.as_tensor(visible), embeds.dtype))
        top, logp = log_softmax_top(head.logits(normed[0]), ex.backend.manifest.branch_k)
    return head.target_ids(top).numpy(), logp.numpy(), prenorm[0], kv


def _check_round(ex: Eagle3Export, stream: list[int], anchor: int) -> None:
    """draft_root and two draft steps (the second below nodes 0 and 2 of the first) against torch."""
    b, k, s = ex.backend, ex.backend.manifest.branch_k, len(stream)
    assert b.start == s
    ids, logp = b.draft_root(anchor, k)
    t_ids, t_logp, prenorm, kv = _torch_root(ex, stream, anchor, k)
    assert np.array_equal(ids, t_ids) and np.abs(logp - t_logp).max() < 1e-4
    first = [int(t) for t in ids[:3]]
    ids1, logp1 = b.draft_step(np.array(first), np.array([-1, -1, -1]), k)
    visible = np.concatenate([np.ones((3, s), bool), np.eye(3, dtype=bool)], axis=1)
    t_ids1, t_logp1, prenorm1, kv1 = _torch_step(ex, first, prenorm[-1:].expand(3, -1), s, kv, visible)
    assert np.array_equal(ids1, t_ids1) and np.abs(logp1 - t_logp1).max() < 1e-4
    second = [int(ids1[0, 0]), int(ids1[2, 1])]
    ids2, logp2 = b.draft_step(np.array(second), np.array([0, 2]), k)
    past = [(torch.cat([a, c], dim=2), torch.cat([v, w], dim=2)) for (a, v), (c, w) in zip(kv, kv1)]
    visible = np.zeros((2, s + 5), bool)
    visible[:, :s] = True
    visible[0, s], visible[1, s + 2], visible[0, s + 3], visible[1, s + 4] = True, True, True, True
    t_ids2, t_logp2, _, _ = _torch_step(ex, second, prenorm1[[0, 2]], s + 1, past, visible)
    assert np.array_equal(ids2, t_ids2) and np.abs(logp2 - t_logp2).max() < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "qwen2_vl", "llama"])
def test_steps_equal_the_torch_head_from_scratch(exported, family):
    """After a prefill, and after rounds that committed several rows each (taps queued from verify passes)."""
    ex = exported(family)
    prompt = ex.codec.turn(TEXT)
    first = ex.backend.prefill(prompt).first
    _check_round(ex, prompt.input_ids.tolist(), first)
    truth = ex.oracle(prompt)
    result = decode(SeededDrafter(ex.backend, truth, prompt.length, SEEDS["full"]), prompt,
                    DecodeConfig(max_new_tokens=12, budget=31, branch_k=8))
    assert max(r.accepted for r in result.rounds) > 2
    _check_round(ex, prompt.input_ids.tolist() + result.tokens[:-1], result.tokens[-1])


def test_kept_rows_recompute_the_row_before_them(exported):
    """A follow-up turn that keeps rows: the head's root run equals the torch head over the new stream."""
    ex = exported("qwen3")
    messages = [user_turn(TEXT)]
    prompt = ex.codec.encode(messages)
    result = decode(SeededDrafter(ex.backend, ex.oracle(prompt), prompt.length, SEEDS["full"]), prompt,
                    DecodeConfig(max_new_tokens=8, budget=31, branch_k=8))
    committed = Committed(np.concatenate([prompt.input_ids, np.asarray(result.tokens, np.int64)])[:ex.backend.start], ())
    messages += [{"role": "assistant", "content": ex.codec.decode(result.tokens)}, user_turn("Why?")]
    follow = ex.codec.encode(messages)
    keep = shared_rows(committed, follow, None, 1)
    assert keep > 10
    anchor = ex.backend.prefill(follow, keep).first
    _check_round(ex, follow.input_ids.tolist(), anchor)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_steps_equal_the_torch_reference_on_image_prompts(snapshot_dir, tmp_path, images, family):
    """A two-layer head rotating with the target's M-RoPE axes, on an image prompt (positions from the rope index)
    and after rounds that committed several rows: the ONNX Runtime steps equal the torch reference backend's."""
    from glance_export.model.eagle3 import load_eagle3
    from glance_export.model.torch_backend import TorchBackend
    from support import tiny_eagle3_head

    snapshot = snapshot_dir(family)
    head_dir = tiny_eagle3_head(snapshot, tmp_path / "head", mrope=True, layers=2, draft_vocab=64)
    ort_backend = OrtBackend(export_artifacts(snapshot, head_dir, tmp_path / "out", max_tree=32, max_context=256,
                                              progress=lambda _: None))
    assert ort_backend.manifest.head_mrope and ort_backend.manifest.head.num_layers == 2
    reference = TorchBackend(Snapshot(snapshot), load_eagle3(head_dir))
    prompt = exported_codec(ort_backend.manifest).turn(TEXT, images["tall"])
    truth = decode(ort_backend, prompt, DecodeConfig(max_new_tokens=12, speculative=False)).tokens
    cfg = DecodeConfig(max_new_tokens=9, budget=31, branch_k=8)
    results = [decode(SeededDrafter(b, truth, prompt.length, SEEDS["full"]), prompt, cfg) for b in (ort_backend, reference)]
    assert results[0].tokens == results[1].tokens == truth[:9] and results[0].tau > 1
    assert ort_backend.start == reference.start
    anchor, k = results[0].tokens[-1], 8
    (ids, logp), (t_ids, t_logp) = (b.draft_root(anchor, k) for b in (ort_backend, reference))
    assert np.array_equal(ids, t_ids) and np.abs(logp - t_logp).max() < 1e-4
    nodes, parents = ids[:4], np.array([-1, -1, -1, -1])
    (ids, logp), (t_ids, t_logp) = (b.draft_step(nodes, parents, k) for b in (ort_backend, reference))
    assert np.array_equal(ids, t_ids) and np.abs(logp - t_logp).max() < 1e-4
    nodes, parents = np.array([ids[1, 0], ids[3, 2], ids[3, 0]]), np.array([1, 3, 3])
    (ids, logp), (t_ids, t_logp) = (b.draft_step(nodes, parents, k) for b in (ort_backend, reference))
    assert np.array_equal(ids, t_ids) and np.abs(logp - t_logp).max() < 1e-4


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_sampled_answers_are_plain_samplings_with_an_eagle3_head(exported, images, family):
    """A head that drafts a depth a pass samples exactly too: its own drafts and seeded ones give plain sampling's
    tokens for the seed, at every budget, and each token's reported log-probs are plain decoding's."""
    ex = exported(family)
    prompt = _prompt(ex, images, family)
    for params in (SamplingParams(temperature=1.2, top_p=0.95, seed=4), SamplingParams(temperature=0.6, seed=5)):
        plain = decode(ex.backend, prompt, DecodeConfig(max_new_tokens=ORACLE_TOKENS, speculative=False,
                                                        sampling=params, logprobs=2))
        seeded = SeededDrafter(ex.backend, plain.tokens, prompt.length, SEEDS["full"])
        for budget, k in SETTINGS:
            cfg = DecodeConfig(max_new_tokens=ORACLE_TOKENS, budget=budget, branch_k=k, sampling=params, logprobs=2)
            assert decode(ex.backend, prompt, cfg).tokens == plain.tokens, (params, budget, k)
            drafted = decode(seeded, prompt, cfg)
            assert drafted.tokens == plain.tokens, (params, budget, k, "seeded")
            assert [[t for t, _ in r.top] for r in drafted.logprobs] == [[t for t, _ in r.top] for r in plain.logprobs]
            assert np.allclose([r.logprob for r in drafted.logprobs], [r.logprob for r in plain.logprobs], atol=2e-4)
