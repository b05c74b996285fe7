"""Conversations keep their KV: a turn that prefills only the rows after the shared prefix decodes exactly
what a fresh decode of the whole conversation does, on every family, on the torch reference and on ONNX
Runtime, with seeded drafts accepting everything, part, or nothing (so multi-token commits, the head's
queued context and the compaction all meet reused rows)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token
from glance_export.model.torch_backend import TorchBackend, greedy_reference
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.messages import user_turn
from glance_runtime.prompt.prefix_reuse import Committed, image_runs, shared_rows
from support import ALL_FAMILIES, SEEDS, VL_FAMILIES, converse

MAX_NEW = 16
# One vision and one text family in the default run; the other four in the slow run.
FAMILIES = [f if f in ("qwen2_5_vl", "qwen3") else pytest.param(f, marks=pytest.mark.slow) for f in ALL_FAMILIES]


def _turns(images, family: str) -> list[dict]:
    """Three user turns: an image, a follow-up about it, and (on vision families) a second image."""
    vl = family in VL_FAMILIES
    return [user_turn("What colour is the square?", [images["wide"]] if vl else []),
            user_turn("Describe the image."),
            user_turn("How many circles are there?", [images["tall"]] if vl else [])]


@pytest.fixture(scope="module")
def torch_backend(snapshot_dir):
    cache: dict[str, TorchBackend] = {}

    def get(family: str) -> TorchBackend:
        if family not in cache:
            snap = Snapshot(snapshot_dir(family))
            cache[family] = TorchBackend(snap, init_head(head_config_for(snap, 1, 8, pick_mask_token(snap)), seed=8))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", list(SEEDS))
def test_torch_follow_ups_equal_fresh_decodes(torch_backend, images, family, seed):
    backend = torch_backend(family)
    snap = backend.snapshot
    kept = converse(backend, snap.build_messages,
                    lambda ids: snap.tokenizer.decode(ids, skip_special_tokens=True),
                    lambda p: greedy_reference(backend.model, snap, p, MAX_NEW, ()), _turns(images, family), seed,
                    snap.image_token_id if snap.is_vl else None,
                    snap.config.get("vision_config", {}).get("spatial_merge_size", 1))
    assert kept[0] == 0 and all(k > 10 for k in kept[1:])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", list(SEEDS))
def test_onnxruntime_follow_ups_equal_fresh_decodes(ort_exported, images, family, seed):
    ex = ort_exported(family)
    m = ex.backend.manifest
    kept = converse(ex.backend, ex.codec.encode, ex.codec.decode,
                    lambda p: greedy_reference(ex.model, ex.snapshot, p, MAX_NEW, ()), _turns(images, family), seed,
                    m.image_token_id if m.is_vl else None, m.spatial_merge_size if m.is_vl else 1)
    assert kept[0] == 0 and all(k > 10 for k in kept[1:])


def test_a_changed_image_is_not_reused(ort_exported, images):
    """Image tokens are one id repeated: a different picture of the same size must not share its rows."""
    ex = ort_exported("qwen2_vl")
    build, m = ex.codec.encode, ex.backend.manifest
    first = build([user_turn("Hi", [images["wide"]])])
    committed = Committed(first.input_ids, tuple(image_runs(first, m.image_token_id, m.spatial_merge_size)))
    same = build([user_turn("Hi", [Image.open(images["wide"])])])
    assert shared_rows(committed, same, m.image_token_id, m.spatial_merge_size) == first.length - 1
    flipped = np.ascontiguousarray(np.asarray(Image.open(images["wide"]).convert("RGB"))[::-1])
    other = build([user_turn("Hi", [flipped])])
    assert np.array_equal(other.input_ids, first.input_ids)
    runs = image_runs(other, m.image_token_id, m.spatial_merge_size)
    assert shared_rows(committed, other, m.image_token_id, m.spatial_merge_size) == runs[0].start > 0


def _draft_after_reuse_equals_fresh(backend, build, detokenize, oracle, turns, image_token_id, merge: int) -> None:
    """The head's context too: after a turn, the next prompt's reused prefill drafts what a fresh one does
    (tokens alone cannot show it: the loop is lossless whatever the head proposes). The next prompt either
    extends every committed row (the head's queued taps are kept and appended to) or, re-rendered by the
    template, shares fewer rows than the head has already projected (its cache is cut back)."""
    from glance_runtime.prompt.prompt_builder import Prompt

    for variant in ("extends", "template"):
        first = build(turns[:1])
        truth = oracle(first)
        result = decode(SeededDrafter(backend, truth, first.length, SEEDS["partial"]), first,
                        DecodeConfig(max_new_tokens=MAX_NEW, budget=31, branch_k=8))
        rows, projected = backend.start, backend.pending_from  # committed rows; those in the head's cache
        said = np.concatenate([first.input_ids, np.asarray(result.tokens, np.int64)])
        committed = Committed(said[:rows], tuple(image_runs(first, image_token_id, merge)))
        if variant == "extends":
            second = Prompt(np.concatenate([said, first.input_ids[-4:]]), first.pixel_values, first.image_grid_thw)
        else:
            second = build([turns[0], {"role": "assistant", "content": detokenize(result.tokens)}, turns[2]])
        keep = shared_rows(committed, second, image_token_id, merge)
        assert (keep == rows > projected) if variant == "extends" else (0 < keep < projected), (variant, keep)
        anchor = backend.prefill(second, keep=keep).first
        reused = backend.draft(anchor, 8)
        assert backend.prefill(second)[0] == anchor
        fresh = backend.draft(anchor, 8)
        np.testing.assert_array_equal(reused[0], fresh[0])
        np.testing.assert_allclose(reused[1], fresh[1], atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_context_after_reuse(torch_backend, ort_exported, images, family):
    backend = torch_backend(family)
    snap = backend.snapshot
    vl = (snap.image_token_id if snap.is_vl else None, snap.config.get("vision_config", {}).get("spatial_merge_size", 1))
    _draft_after_reuse_equals_fresh(backend, snap.build_messages,
                                    lambda ids: snap.tokenizer.decode(ids, skip_special_tokens=True),
                                    lambda p: greedy_reference(backend.model, snap, p, MAX_NEW, ()),
                                    _turns(images, family), *vl)
    ex = ort_exported(family)
    _draft_after_reuse_equals_fresh(ex.backend, ex.codec.encode, ex.codec.decode,
                                    lambda p: greedy_reference(ex.model, ex.snapshot, p, MAX_NEW, ()),
                                    _turns(images, family), *vl)
