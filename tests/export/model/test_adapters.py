"""Model adapters: every family loads from a snapshot directory and builds prompts; bad input fails clearly."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from glance_export.model.adapters import Snapshot
from glance_runtime.prompt.images import load_image
from glance_runtime.errors import GlanceError
from support import ALL_FAMILIES, VL_FAMILIES


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_family_resolves_and_prompt_uses_chat_template(snapshot_dir, family):
    snap = Snapshot(snapshot_dir(family))
    assert snap.family == family and snap.is_vl == (family in VL_FAMILIES)
    prompt = snap.build_prompt("Describe the image.")
    text = snap.tokenizer.decode(prompt.input_ids.tolist())
    assert text == "<|im_start|>user\nDescribe the image.<|im_end|>\n<|im_start|>assistant\n"
    assert snap.tokenizer.convert_tokens_to_ids("<|im_end|>") in snap.stop_token_ids


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("name", ["wide", "tall", "square", "large"])
def test_image_placeholder_expands_to_the_processor_grid(snapshot_dir, images, family, name):
    snap = Snapshot(snapshot_dir(family))
    prompt = snap.build_prompt("What is this?", images[name])
    n_image = int((prompt.input_ids == snap.image_token_id).sum())
    merge = snap.image_processor.merge_size
    assert n_image == int(prompt.image_grid_thw.prod()) // merge**2 > 0
    assert prompt.pixel_values.shape[0] == int(prompt.image_grid_thw.prod())


def test_unknown_family_is_refused(snapshot_dir, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(snapshot_dir("qwen2"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(GlanceError, match="unsupported model family 'gpt2'"):
        Snapshot(bad)


@pytest.mark.parametrize("missing,message", [("config.json", "config.json is missing"),
                                             ("model.safetensors", "no \\*.safetensors"),
                                             ("preprocessor_config.json", "no preprocessor_config.json")])
def test_missing_files_are_named(snapshot_dir, tmp_path, missing, message):
    bad = tmp_path / "m"
    shutil.copytree(snapshot_dir("qwen2_vl"), bad)
    (bad / missing).unlink()
    with pytest.raises(GlanceError, match=message):
        Snapshot(bad)


@pytest.mark.edge
def test_missing_directory(tmp_path):
    with pytest.raises(GlanceError, match="does not exist"):
        Snapshot(tmp_path / "nowhere")


@pytest.mark.edge
def test_bad_images(tmp_path):
    with pytest.raises(GlanceError, match="does not exist"):
        load_image(tmp_path / "none.png")
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"not an image at all")
    with pytest.raises(GlanceError, match="cannot be decoded"):
        load_image(junk)
    huge = tmp_path / "huge.png"
    Image.new("1", (9000, 8000)).save(huge)
    with pytest.raises(GlanceError, match="larger than|absurdly large"):
        load_image(huge)
    ok = tmp_path / "ok.png"
    Image.fromarray(np.zeros((10, 20, 4), np.uint8)).save(ok)
    assert load_image(ok).mode == "RGB"


def test_image_for_text_model_is_refused(snapshot_dir, images):
    with pytest.raises(GlanceError, match="text-only"):
        Snapshot(snapshot_dir("llama")).build_prompt("hi", images["wide"])
