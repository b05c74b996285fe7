"""Several images per message: both prompt builders, the M-RoPE positions and the torch backend's tokens
against transformers' own greedy `generate` on every vision family."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token
from glance_export.model.torch_backend import TorchBackend
from glance_runtime.errors import GlanceError, InputError
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.messages import user_turn
from glance_runtime.prompt.rope_index import rope_index
from test_preprocess import _builder
from support import VL_FAMILIES, make_snapshot

MAX_NEW = 20
IMAGE_SETS = {"two": ("wide", "tall"), "three": ("square", "wide", "tall")}


def conversation(paths) -> list[dict]:
    """A system message, an earlier exchange about the first image, then a turn with the rest."""
    first, *rest = paths
    return [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "The square is red."},
            {"role": "user", "content": [*({"type": "image", "image": p} for p in rest),
                                         {"type": "text", "text": "What changed?"}]}]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> dict[str, Snapshot]:
    root = tmp_path_factory.mktemp("multi")
    return {f: Snapshot(make_snapshot(root / f, f)) for f in VL_FAMILIES}


@pytest.fixture(scope="module")
def backends(snapshots) -> dict[str, TorchBackend]:
    out = {}
    for family, snap in snapshots.items():
        head = init_head(head_config_for(snap, 1, 8, pick_mask_token(snap)), seed=8)
        out[family] = TorchBackend(snap, head)
    return out


def generate(backend: TorchBackend, prompt) -> list[int]:
    """transformers' greedy `generate`, handed the prompt's ids, pixels, grids and token types."""
    model, snap = backend.model, backend.snapshot
    model.model.rope_deltas = None  # cached by the model per prompt
    ids = torch.from_numpy(prompt.input_ids)[None]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         pixel_values=torch.from_numpy(prompt.pixel_values),
                         image_grid_thw=torch.from_numpy(prompt.image_grid_thw),
                         mm_token_type_ids=(ids == snap.image_token_id).int(),
                         do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=list(snap.stop_token_ids),
                         pad_token_id=snap.stop_token_ids[0])
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("count", list(IMAGE_SETS))
def test_builders_and_positions_agree(snapshots, backends, images, family, count):
    snap = snapshots[family]
    messages = conversation([images[n] for n in IMAGE_SETS[count]])
    ours, ref = _builder(snap).build_messages(messages), snap.build_messages(messages)
    np.testing.assert_array_equal(ours.input_ids, ref.input_ids)
    np.testing.assert_array_equal(ours.image_grid_thw, ref.image_grid_thw)
    np.testing.assert_array_equal(ours.pixel_values, ref.pixel_values)
    assert len(ref.image_grid_thw) == len(IMAGE_SETS[count])
    ids = torch.from_numpy(ref.input_ids)[None]
    ref_pos, ref_delta = backends[family].model.model.get_rope_index(
        input_ids=ids, mm_token_type_ids=(ids == snap.image_token_id).int(),
        image_grid_thw=torch.from_numpy(ref.image_grid_thw), attention_mask=torch.ones_like(ids))
    pos, delta = rope_index(ours.input_ids, snap.image_token_id, ours.image_grid_thw,
                            snap.config["vision_config"]["spatial_merge_size"])
    np.testing.assert_array_equal(pos, ref_pos.numpy())
    assert delta == int(ref_delta.reshape(-1)[0])


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("count", list(IMAGE_SETS))
def test_decode_matches_generate(backends, images, family, count):
    backend = backends[family]
    prompt = backend.snapshot.build_messages(conversation([images[n] for n in IMAGE_SETS[count]]))
    truth = generate(backend, prompt)
    for budget, k in ((31, 8), (0, 1)):
        cfg = DecodeConfig(max_new_tokens=MAX_NEW, budget=budget, branch_k=k)
        assert decode(backend, prompt, cfg, backend.snapshot.stop_token_ids).tokens == truth


def test_images_change_the_answer(backends, images):
    """Guards the suite: the answer depends on which images are shown and in which order."""
    backend = backends["qwen2_5_vl"]
    answers = {tuple(generate(backend, backend.snapshot.build_messages([user_turn("What changed?", [images[a], images[b]])])))
               for a, b in (("wide", "tall"), ("tall", "wide"), ("wide", "square"))}
    assert len(answers) == 3


def test_image_kinds_give_one_prompt(snapshots, images):
    snap = snapshots["qwen3_vl"]
    builder = _builder(snap)
    path = images["wide"]
    pil = Image.open(path)
    kinds = [path, str(path), pil, np.asarray(pil.convert("RGB")), np.asarray(pil.convert("RGBA")), path.read_bytes()]
    prompts = [builder.build_messages([user_turn("Hi", [k])]) for k in kinds]
    for p in prompts[1:]:
        np.testing.assert_array_equal(p.input_ids, prompts[0].input_ids)
        np.testing.assert_array_equal(p.pixel_values, prompts[0].pixel_values)
    jpeg = io.BytesIO()
    pil.convert("RGB").save(jpeg, format="JPEG")
    assert builder.build_messages([user_turn("Hi", [jpeg.getvalue()])]).image_grid_thw.shape == (1, 3)


def test_bad_messages_are_refused(snapshots, images):
    builder = _builder(snapshots["qwen2_vl"])
    bad = [([{"role": "user", "content": [{"type": "video", "video": [images["wide"]]}]}], "give it a video branch"),
           ([{"role": "user", "content": [{"type": "video", "video": []}]}], "at least one frame"),
           ([{"role": "user", "content": [{"type": "video", "video": [images["wide"]], "fps": 0}]}], "positive number"),
           ([{"role": "robot", "content": "hi"}], "role one of"),
           ([{"role": "user", "content": [{"type": "audio"}]}], "has a part"),
           ([{"role": "assistant", "content": "hi"}], "no user message"),
           ([user_turn("Hi", [np.zeros((4, 4, 2), np.uint8)])], "uint8 HxW"),
           ([user_turn("Hi", [b"not an image"])], "cannot be decoded"),
           ([user_turn("Hi", [3.5])], "path, PIL.Image")]
    for messages, message in bad:
        with pytest.raises(InputError, match=message):
            builder.build_messages(messages)
    text_only = _builder(Snapshot(make_snapshot(snapshots["qwen2_vl"].path.parent / "qwen2", "qwen2", layers=1)))
    with pytest.raises(GlanceError, match="text-only"):
        text_only.build_messages([user_turn("Hi", [images["wide"]])])
