"""The torch-free prompt path against transformers: same ids, same pixels, same M-RoPE positions."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from glance_export.model.adapters import Snapshot
from glance_runtime.errors import GlanceError
from glance_runtime.prompt.codec import PromptCodec
from glance_runtime.prompt.images import load_image, smart_resize
from glance_runtime.prompt.messages import user_turn
from glance_runtime.prompt.prompt_builder import ImageProcessorConfig, Prompt, PromptBuilder, process_image
from glance_runtime.prompt.rope_index import rope_index
from support import ALL_FAMILIES, VL_FAMILIES, make_image, make_snapshot, runtime_prompt_builder

SIZES = [(64, 64), (200, 100), (37, 300), (300, 37), (1000, 800), (20, 20), (113, 97)]
TEXTS = ["What colour is the square?", "", "Read the total: 42.17 — ünïcødé ✓ <|im_end|> not special?"]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> dict[str, Snapshot]:
    root = tmp_path_factory.mktemp("snaps")
    return {f: Snapshot(make_snapshot(root / f, f, layers=2)) for f in ALL_FAMILIES}


def _turn(builder: PromptBuilder, text: str, image=None) -> Prompt:
    """One user turn through the runtime's builder (as the codec's `turn` sends it)."""
    return builder.build_messages([user_turn(text, [image] if image is not None else [])])


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("text", TEXTS)
def test_text_prompt_ids_match(snapshots, family, text):
    snap = snapshots[family]
    ours, ref = _turn(runtime_prompt_builder(snap), text), snap.build_prompt(text)
    assert ours.input_ids.dtype == np.int64
    np.testing.assert_array_equal(ours.input_ids, ref.input_ids)
    assert ours.pixel_values is None and ours.image_grid_thw is None


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("size", SIZES)
def test_image_prompt_matches_processor(snapshots, family, size, tmp_path):
    snap = snapshots[family]
    image = make_image(tmp_path / "img.png", *size, seed=sum(size))
    ours = _turn(runtime_prompt_builder(snap), "Describe the image.", image)
    ref = snap.build_prompt("Describe the image.", image)
    np.testing.assert_array_equal(ours.input_ids, ref.input_ids)
    np.testing.assert_array_equal(ours.image_grid_thw, ref.image_grid_thw)
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == ref.pixel_values.shape
    np.testing.assert_array_equal(ours.pixel_values, ref.pixel_values)  # bit-exact


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_non_rgb_images_match(snapshots, mode):
    snap = snapshots["qwen2_5_vl"]
    rgb = Image.fromarray(np.random.default_rng(1).integers(0, 255, (90, 130, 3), dtype=np.uint8))
    image = rgb.convert(mode)
    ours, ref = _turn(runtime_prompt_builder(snap), "Hi", image), snap.build_prompt("Hi", image)
    np.testing.assert_array_equal(ours.input_ids, ref.input_ids)
    np.testing.assert_array_equal(ours.pixel_values, ref.pixel_values)  # bit-exact


@pytest.mark.parametrize("flags", [{"do_normalize": False}, {"do_rescale": False}, {"do_resize": False}])
def test_processor_flags_match(snapshots, flags, tmp_path):
    """do_resize / do_rescale / do_normalize switched off in preprocessor_config.json, as transformers honours them."""
    from transformers import AutoImageProcessor

    snap = snapshots["qwen2_vl"]
    builder = runtime_prompt_builder(snap)
    raw = json.loads((builder.path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**raw, **flags}))
    ours = ImageProcessorConfig.from_json({**raw, **flags})
    image = Image.fromarray(np.random.default_rng(4).integers(0, 255, (112, 168, 3), dtype=np.uint8))
    ref = AutoImageProcessor.from_pretrained(tmp_path)(images=[image], return_tensors="np")
    pixels, grid = process_image(image, ours)
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


def test_smart_resize_bounds():
    for h, w in [(10, 10), (4000, 3000), (28, 5000), (333, 777)]:
        rh, rw = smart_resize(h, w, 28, 56 * 56, 28 * 28 * 256)
        assert rh % 28 == 0 and rw % 28 == 0 and 56 * 56 <= rh * rw <= 28 * 28 * 256
    with pytest.raises(GlanceError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 56 * 56, 28 * 28 * 256)


@pytest.fixture(scope="module")
def models(snapshots):
    return {f: snapshots[f].load_model() for f in VL_FAMILIES}


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("size", [(64, 64), (200, 100), (37, 300), (1000, 800)])
def test_rope_index_matches_model(snapshots, models, family, size, tmp_path):
    snap, model = snapshots[family], models[family]
    prompt = _turn(runtime_prompt_builder(snap), "Describe it.", make_image(tmp_path / "i.png", *size, seed=3))
    ids = torch.from_numpy(prompt.input_ids)[None]
    ref_pos, ref_delta = model.model.get_rope_index(
        input_ids=ids, mm_token_type_ids=(ids == snap.image_token_id).int(),
        image_grid_thw=torch.from_numpy(prompt.image_grid_thw), attention_mask=torch.ones_like(ids))
    pos, delta = rope_index(prompt.input_ids, snap.image_token_id, prompt.image_grid_thw,
                            snap.config["vision_config"]["spatial_merge_size"])
    np.testing.assert_array_equal(pos, ref_pos.numpy())
    assert delta == int(ref_delta.reshape(-1)[0])
    if prompt.image_grid_thw[0, 1:].min() > 2:  # a merged grid with more than one row and column
        assert delta < 0


def test_rope_index_text_only():
    pos, delta = rope_index(np.arange(7), image_token_id=99, image_grid_thw=None, spatial_merge_size=2)
    assert pos.shape == (3, 1, 7) and delta == 0
    np.testing.assert_array_equal(pos[1, 0], np.arange(7))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_decode_matches_tokenizer(snapshots, family):
    snap = snapshots[family]
    builder = runtime_prompt_builder(snap)
    codec = PromptCodec(builder.build_messages, builder.tokenizer, (), None, 1)
    for text in TEXTS:
        ids = codec.turn(text).input_ids.tolist()
        assert codec.decode(ids) == snap.tokenizer.decode(ids, skip_special_tokens=True)


# Exercises what real Qwen templates rely on: block whitespace trimming, namespace, loop controls,
# tojson, special-token variables and a default system turn.
RICH_TEMPLATE = """{% set ns = namespace(images=0) %}
{% if messages[0]['role'] != 'system' %}
<|im_start|>system
You are helpful.{{ eos_token }}
{% endif %}
{% for m in messages %}
    {% if m['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role') }}{% endif %}
<|im_start|>{{ m['role'] }}
{% for c in m['content'] %}
    {% if c['type'] == 'image' %}{% set ns.images = ns.images + 1 %}Picture {{ ns.images }}: <|vision_start|><|image_pad|><|vision_end|>
    {% elif c['type'] == 'text' %}{{ c['text'] }}{% else %}{% continue %}{% endif %}
{% endfor %}
{{ {'n': ns.images, 'pad': pad_token} | tojson }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_rich_template_renders_like_transformers(snapshots, tmp_path):
    snap = snapshots["qwen2_5_vl"]
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(snap.path / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(RICH_TEMPLATE)
    ref_tok = snap.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi \"there\" ü"}]}]
    ref = ref_tok.apply_chat_template(messages, chat_template=RICH_TEMPLATE, add_generation_prompt=True,
                                      tokenize=False)
    assert PromptBuilder(tmp_path, snap.image_token_id).template.render(messages) == ref
    with pytest.raises(GlanceError, match="chat template rejected the prompt: bad role"):
        PromptBuilder(tmp_path, snap.image_token_id).template.render([{"role": "tool", "content": []}])


def test_image_errors(snapshots, tmp_path):
    builder = runtime_prompt_builder(snapshots["qwen2_vl"])
    with pytest.raises(GlanceError, match="does not exist"):
        _turn(builder, "x", tmp_path / "missing.png")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    with pytest.raises(GlanceError, match="cannot be decoded"):
        _turn(builder, "x", bad)
    huge = tmp_path / "huge.png"
    Image.new("1", (9000, 8000)).save(huge)
    with pytest.raises(GlanceError, match="larger than") as err:
        load_image(huge)
    assert "\n" not in str(err.value)
    with pytest.raises(GlanceError, match="text-only"):
        _turn(runtime_prompt_builder(snapshots["qwen2"]), "x", make_image(tmp_path / "ok.png", 32, 32, 0))


def test_missing_files(snapshots, tmp_path):
    with pytest.raises(GlanceError, match="tokenizer.json"):
        PromptBuilder(tmp_path)
    (tmp_path / "tokenizer.json").write_text((snapshots["qwen2"].path / "tokenizer.json").read_text())
    with pytest.raises(GlanceError, match="chat template"):
        PromptBuilder(tmp_path)
    with pytest.raises(GlanceError, match="preprocessor_config"):
        PromptBuilder(tmp_path, image_token_id=5)
