"""Answers generated in padded batches are the target's own greedy answers, prompt by prompt."""
from __future__ import annotations

import pytest

from glance_export.model.adapters import Snapshot
from glance_export.model.torch_backend import greedy_reference
from glance_export.train.answers import generate_answers


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2"])
def test_batched_answers_equal_greedy_one_prompt_at_a_time(snapshot_dir, images, family):
    snap = Snapshot(snapshot_dir(family))
    model = snap.load_model()
    vl = snap.is_vl
    convs = [[{"role": "user", "content": [*([{"type": "image", "image": str(images["wide"])}] if vl else []),
                                           {"type": "text", "text": "What is shown?"}]}],
             [{"role": "user", "content": [*([{"type": "image", "image": str(images["tall"])},
                                              {"type": "image", "image": str(images["square"])}] if vl else []),
                                           {"type": "text", "text": "Compare the two pictures, please."}]}],
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "Say more."}]]
    prompts = [snap.build_messages(c) for c in convs]
    assert len({p.length for p in prompts}) == 3  # padding is exercised
    expected = [greedy_reference(model, snap, p, 16, snap.stop_token_ids) for p in prompts]
    assert generate_answers(model, snap, prompts, 16, batch=3) == expected
    assert generate_answers(model, snap, prompts, 16, batch=2) == expected
