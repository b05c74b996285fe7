"""Video input (a list of frames) on every vision family: the torch-free processor against transformers' video
processors, the M-RoPE positions against each family's `get_rope_index`, and the tokens of the torch reference
and of ONNX Runtime against transformers' greedy `generate` given the same video; a video beside an image, an
odd frame count, another frame rate, a refusal on a text family, and a conversation that keeps a video's KV."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import glance_runtime as gr
from glance_export.model.adapters import Snapshot
from glance_export.model.torch_backend import TorchBackend, greedy_reference
from glance_export.train.tokenizer import CHAT_TEMPLATE
from glance_runtime.errors import InputError
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.messages import user_turn
from glance_runtime.prompt.prefix_reuse import Committed, image_runs, shared_rows
from glance_runtime.prompt.rope_index import rope_index, video_grids
from glance_runtime.prompt.video import (DEFAULT_FPS, Video, VideoProcessorConfig, frame_size, process_video,
                                         resize_frame)
from support import VL_FAMILIES, Exported, make_snapshot

MAX_NEW = 16
VIDEO_BRANCH = "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def video_snapshot(root: Path, family: str) -> Path:
    """A tiny snapshot whose template renders video parts as the Qwen-VL templates do, with a small video
    processor config (the class defaults would upscale every frame to ~130k pixels)."""
    path = make_snapshot(root / family, family)
    template = CHAT_TEMPLATE.replace("<|vision_end|>{% else %}", f"<|vision_end|>{VIDEO_BRANCH}{{% else %}}")
    assert template != CHAT_TEMPLATE
    (path / "chat_template.jinja").write_text(template)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    if "chat_template" in tok_cfg:
        tok_cfg["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    patch = 16 if family == "qwen3_vl" else 14
    unit = patch * 2
    (path / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen3VLVideoProcessor" if family == "qwen3_vl" else "Qwen2VLVideoProcessor",
        "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": unit * unit * 2, "longest_edge": unit * unit * 24},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_sample_frames": False}))
    return path


def frames(count: int, width: int = 90, height: int = 62, seed: int = 0) -> list[np.ndarray]:
    """A square sliding over a textured background, one frame per step, so every frame differs."""
    rng = np.random.default_rng(seed)
    back = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    colour = rng.integers(0, 255, 3, dtype=np.uint8)
    out = []
    for i in range(count):
        frame = back.copy()
        x = (i * width // max(count, 1)) % (width - 20)
        frame[10:30, x:x + 20] = colour
        out.append(frame)
    return out


@pytest.fixture(scope="module")
def snaps(tmp_path_factory) -> dict[str, Snapshot]:
    root = tmp_path_factory.mktemp("video")
    return {f: Snapshot(video_snapshot(root, f)) for f in VL_FAMILIES}


@pytest.fixture(scope="module")
def backends(snaps) -> dict[str, TorchBackend]:
    from glance_export.model.head import head_config_for, init_head, pick_mask_token

    return {f: TorchBackend(s, init_head(head_config_for(s, 1, 8, pick_mask_token(s)), seed=8)) for f, s in snaps.items()}


@pytest.fixture(scope="module")
def exported(snaps, tmp_path_factory):
    built: dict[str, Exported] = {}

    def get(family: str) -> Exported:
        if family not in built:
            built[family] = Exported(tmp_path_factory.mktemp(f"video_ort_{family}"), snaps[family].path, 8)
        return built[family]

    return get


def cases(images) -> dict[str, list[dict]]:
    """A video of an odd frame count alone; a video beside an image; a video at another frame rate."""
    return {"odd": [user_turn("What moves?", videos=[frames(3)])],
            "with_image": [{"role": "user", "content": [
                {"type": "image", "image": images["wide"]}, {"type": "video", "video": frames(4, seed=1)},
                {"type": "text", "text": "What changed?"}]}],
            "slow": [{"role": "user", "content": [{"type": "video", "video": frames(5, seed=2), "fps": 0.5},
                                                  {"type": "text", "text": "Describe the image."}]}]}


def generate(backend: TorchBackend, prompt) -> list[int]:
    """transformers' greedy `generate`, handed the prompt's ids, pixels, grids, seconds and token types."""
    from glance_export.model.torch_backend import vision_inputs

    model, snap = backend.model, backend.snapshot
    model.model.rope_deltas = None  # cached by the model per prompt
    ids = torch.from_numpy(prompt.input_ids)[None]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         **vision_inputs(snap, prompt, ids, torch.device("cpu"), torch.float32),
                         do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=list(snap.stop_token_ids),
                         pad_token_id=snap.stop_token_ids[0])
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' video processors need torchvision: the CPU build for "
                    "torch 2.13.0 is on PyTorch's own index only (PyPI's is a CUDA build that fails to import beside "
                    "the CPU torch); test_processor_resizes_as_the_kernels_transformers_calls_do checks the resize")
@pytest.mark.parametrize("family", VL_FAMILIES)
def test_processor_matches_transformers(snaps, images, family):
    """Pixels, grid and prompt ids bit for bit as transformers' own processor gives them, resize included."""
    import transformers

    snap = snaps[family]
    video_cls = transformers.Qwen3VLVideoProcessor if family == "qwen3_vl" else transformers.Qwen2VLVideoProcessor
    processor_cls = {"qwen2_vl": transformers.Qwen2VLProcessor, "qwen2_5_vl": transformers.Qwen2_5_VLProcessor,
                     "qwen3_vl": transformers.Qwen3VLProcessor}[family]
    processor = processor_cls(image_processor=snap.image_processor, tokenizer=snap.tokenizer,
                              video_processor=video_cls.from_pretrained(snap.path),
                              chat_template=snap.tokenizer.chat_template)
    for name, messages in cases(images).items():
        ours = snap.build_messages(messages)
        part = next(p for p in messages[0]["content"] if p["type"] == "video")
        fps, clip = part.get("fps", DEFAULT_FPS), np.stack(part["video"])
        image = [Image.open(p["image"]).convert("RGB") for p in messages[0]["content"] if p["type"] == "image"]
        text = snap.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": p["type"]} if p["type"] != "text" else p
                                          for p in messages[0]["content"]]}], add_generation_prompt=True, tokenize=False)
        ref = processor(text=[text], images=image or None, videos=[clip], return_tensors="np", do_sample_frames=False,
                        video_metadata=[{"fps": fps, "total_num_frames": len(clip), "frames_indices": list(range(len(clip)))}])
        np.testing.assert_array_equal(ours.input_ids, ref["input_ids"][0], err_msg=name)
        np.testing.assert_array_equal(ours.pixel_values_videos, ref["pixel_values_videos"], err_msg=name)
        np.testing.assert_array_equal(ours.video_grid_thw, ref["video_grid_thw"], err_msg=name)
        if family == "qwen2_5_vl":
            np.testing.assert_allclose(ours.second_per_grid_ts, ref["second_per_grid_ts"], err_msg=name)
    for size, count, cap in (((62, 90), 3, False), ((200, 37), 3, False), ((33, 250), 3, False),
                             ((300, 420), 9, True)):  # down, up and mixed scales; the per-frame pixel cap
        clip = np.stack(frames(count, width=size[1], height=size[0]))
        ref = video_cls.from_pretrained(snap.path, cap_pixels_per_frame=cap, max_video_tokens=40)(
            videos=[clip], return_tensors="np", do_sample_frames=False)
        cfg = replace(VideoProcessorConfig.from_dir(snap.path, family), cap_pixels_per_frame=cap, max_video_tokens=40)
        pixels, grid = process_video(Video([Image.fromarray(f) for f in clip]), cfg)
        np.testing.assert_array_equal(grid, ref["video_grid_thw"], err_msg=str(size))
        np.testing.assert_array_equal(pixels, ref["pixel_values_videos"])


# Frame sizes scaled down, up and both ways at once, and one the per-frame pixel cap shrinks: (height, width, count).
RESIZED = ((62, 90, 3), (200, 37, 3), (33, 250, 3), (300, 420, 9))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_processor_resizes_as_the_kernels_transformers_calls_do(snaps, family):
    """Without torchvision, the parts of transformers' video processor it supplies, from the code it calls: the
    frame size from transformers' own `smart_resize` (the Qwen2-VL video processor's copy of it) and the pixels
    from torch's native uint8 antialiased bicubic interpolate, which torchvision's resize runs on a CPU."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    cfg = VideoProcessorConfig.from_dir(snaps[family].path, family)
    factor = cfg.patch_size * cfg.merge_size
    for height, width, count in RESIZED:
        clip = frames(count, width=width, height=height)
        for cap in (False, True):
            size = frame_size(replace(cfg, cap_pixels_per_frame=cap, max_video_tokens=40), count, height, width)
            if not cap:
                assert size == smart_resize(height, width, factor, cfg.min_pixels, cfg.max_pixels), (height, width)
            for frame in clip[:2]:
                batch = torch.from_numpy(frame).permute(2, 0, 1)[None].contiguous()
                kernel = torch.nn.functional.interpolate(batch, size=list(size), mode="bicubic", antialias=True,
                                                         align_corners=False)
                np.testing.assert_array_equal(resize_frame(frame, *size), kernel[0].permute(1, 2, 0).numpy())


def test_resize_is_torchvision_bicubic_on_a_known_case():
    """A pinned case of the fixed-point antialiased resize (values from torchvision 0.28 on x86), so the
    kernel stays checked where torchvision is not installed."""
    frame = ((np.arange(9 * 13 * 3).reshape(9, 13, 3) * 97) % 256).astype(np.uint8)
    out = resize_frame(frame, 6, 5)
    assert out.shape == (6, 5, 3)
    np.testing.assert_array_equal(out[:, :, 0], [[75, 94, 192, 83, 105], [182, 114, 104, 164, 85],
                                                   [101, 172, 82, 112, 199], [82, 99, 185, 110, 107],
                                                   [181, 117, 112, 172, 84], [106, 194, 82, 119, 185]])


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_positions_match_get_rope_index(snaps, backends, images, family):
    snap, model = snaps[family], backends[family].model
    tokens_per_second = snap.config["vision_config"].get("tokens_per_second", 4)
    for name, messages in cases(images).items():
        prompt = snap.build_messages(messages)
        ids = torch.from_numpy(prompt.input_ids)[None]
        from glance_export.model.torch_backend import vision_inputs

        extra = vision_inputs(snap, prompt, ids, torch.device("cpu"), torch.float32)
        ref_pos, ref_delta = model.model.get_rope_index(
            input_ids=ids, mm_token_type_ids=extra["mm_token_type_ids"], image_grid_thw=extra.get("image_grid_thw"),
            video_grid_thw=extra["video_grid_thw"], second_per_grid_ts=extra.get("second_per_grid_ts"),
            attention_mask=torch.ones_like(ids))
        grids, steps = video_grids(family, prompt.video_grid_thw, prompt.second_per_grid_ts, tokens_per_second)
        pos, delta = rope_index(prompt.input_ids, snap.image_token_id, prompt.image_grid_thw,
                                snap.config["vision_config"]["spatial_merge_size"], prompt.video_token_id, grids, steps)
        np.testing.assert_array_equal(pos, ref_pos.numpy(), err_msg=name)
        assert delta == int(ref_pos[0, 0, -1]) + 1 - prompt.length, name  # where generate continues
        if family == "qwen2_5_vl" and name == "slow":  # its temporal positions pass the prompt's last one
            assert delta < int(ref_delta.reshape(-1)[0])
        assert int(prompt.video_grid_thw[0, 0]) > 1  # several temporal patches: the case still images never reach


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_torch_and_onnxruntime_match_generate(backends, exported, images, family):
    """Both backends decode transformers' greedy tokens, with and without the draft tree; ONNX Runtime's own
    torch-free prompt is the reference's, bit for bit."""
    backend, ex = backends[family], exported(family)
    for name, messages in cases(images).items():
        prompt = backend.snapshot.build_messages(messages)
        truth = generate(backend, prompt)
        assert greedy_reference(backend.model, backend.snapshot, prompt, MAX_NEW, backend.snapshot.stop_token_ids) == truth
        ort_prompt = ex.codec.encode(messages)
        for field in ("input_ids", "pixel_values", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
            np.testing.assert_array_equal(getattr(ort_prompt, field), getattr(prompt, field), err_msg=f"{name} {field}")
        for budget, k in ((31, 8), (0, 1)):
            cfg = DecodeConfig(max_new_tokens=MAX_NEW, budget=budget, branch_k=k)
            assert decode(backend, prompt, cfg, backend.snapshot.stop_token_ids).tokens == truth, (name, budget)
            assert decode(ex.backend, ort_prompt, cfg, ex.codec.stop_ids).tokens == truth, (name, budget)


def test_the_video_changes_the_answer(backends):
    """Guards the suite: the answer depends on the frames, their order and their rate."""
    backend = backends["qwen2_5_vl"]
    build = backend.snapshot.build_messages
    clip = frames(4, seed=3)
    answers = {tuple(generate(backend, build([{"role": "user", "content": [
        {"type": "video", "video": v, "fps": fps}, {"type": "text", "text": "What moves?"}]}])))
        for v, fps in ((clip, 2.0), (clip[::-1], 2.0), (clip, 0.25))}
    assert len(answers) == 3


def test_follow_up_about_a_video_keeps_its_kv(exported, snaps):
    """A second turn about the same video prefills only the new turn and answers as a fresh decode does, on
    ONNX Runtime and on the torch reference; another frame rate of the same frames is not reused."""
    ex = exported("qwen3_vl")
    clip = frames(4, seed=4)
    for model in (gr.load(artifacts=ex.artifacts), gr.load(backend="torch", model=snaps["qwen3_vl"].path,
                                                             head=ex.artifacts.parent / "head")):
        with model:
            chat = model.chat()
            first = chat.send("What moves?", videos=[clip], max_new_tokens=8)
            assert first.stats["prefill_tokens"] == first.stats["prompt_tokens"]
            second = chat.send("Describe the image.", max_new_tokens=8)
            assert second.stats["prefill_tokens"] < second.stats["prompt_tokens"] // 2
            assert second.token_ids == model.generate(messages=chat.messages[:-1], max_new_tokens=8).token_ids
    build = ex.codec.encode
    side = (ex.backend.manifest.image_token_id, ex.backend.manifest.spatial_merge_size)
    seen = build([user_turn("What moves?", videos=[clip])])
    committed = Committed(seen.input_ids, tuple(image_runs(seen, *side)))
    slower = build([{"role": "user", "content": [{"type": "video", "video": clip, "fps": 1.0},
                                                 {"type": "text", "text": "What moves?"}]}])
    video = image_runs(slower, *side)[0]
    assert video.video and shared_rows(committed, slower, *side) <= video.start


def test_refusals(snaps, tmp_path, images):
    text_only = Snapshot(make_snapshot(tmp_path / "qwen2", "qwen2", layers=1))
    with pytest.raises(InputError, match="text-only .* drop the videos") as info:
        text_only.build_messages([user_turn("Hi", videos=[frames(2)])])
    assert "\n" not in str(info.value)
    with gr.load(backend="torch", model=text_only.path, speculative=False) as model:
        with pytest.raises(gr.InputError, match="text-only"):
            model.generate("Hi", videos=[frames(2)])
    build = snaps["qwen3_vl"].build_messages
    with pytest.raises(InputError, match="at least 2 frames"):
        build([user_turn("Hi", videos=[frames(1)])])
    with pytest.raises(InputError, match="one size"):
        build([user_turn("Hi", videos=[[*frames(2), frames(1, width=64)[0]]])])
    with pytest.raises(InputError, match=r"\[T, H, W, 3\]"):
        build([user_turn("Hi", videos=[np.zeros((4, 4, 3), np.uint8)])])


def test_glance_run_video_flags(exported, tmp_path, capsys):
    """`--video FRAME ...` (repeatable) and `--fps` give the API's tokens for the same video and rate."""
    from glance_runtime.cli import run as cli

    ex = exported("qwen2_5_vl")
    paths = []
    for i, frame in enumerate(frames(3, seed=5)):
        Image.fromarray(frame).save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    assert cli.main(["--json", "--artifacts", str(ex.artifacts), "--prompt", "What moves?", "--video", *paths,
                     "--fps", "0.5", "--max-new-tokens", "8"]) == 0
    ran = json.loads(capsys.readouterr().out)
    with gr.load(artifacts=ex.artifacts) as model:
        out = model.generate("What moves?", videos=[{"video": paths, "fps": 0.5}], max_new_tokens=8)
        assert ran["token_ids"] == out.token_ids and ran["prompt_tokens"] == out.stats["prompt_tokens"]
        assert out.token_ids != model.generate("What moves?", videos=[paths], max_new_tokens=8).token_ids
    assert cli.main(["--artifacts", str(ex.artifacts), "--prompt", "Hi", "--video", str(tmp_path / "none.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("seed", ["full", "partial", "zero"])
def test_follow_ups_about_videos_equal_fresh_decodes(backends, exported, images, family, seed):
    """Turns that keep a video's rows (and then add an image and another video) decode what fresh decodes of
    the whole conversation do, on both backends, with seeded drafts accepting everything, part, or nothing."""
    from glance_export.model.torch_backend import greedy_reference
    from support import converse

    turns = [user_turn("What moves?", videos=[frames(3, seed=6)]), user_turn("Describe the image."),
             user_turn("What changed?", [images["tall"]], [{"video": frames(4, seed=7), "fps": 1.0}])]
    backend, ex = backends[family], exported(family)
    snap = backend.snapshot
    merge = snap.config["vision_config"]["spatial_merge_size"]
    for runner, build, detokenize, model in (
            (backend, snap.build_messages, lambda ids: snap.tokenizer.decode(ids, skip_special_tokens=True), backend.model),
            (ex.backend, ex.codec.encode, ex.codec.decode, ex.model)):
        kept = converse(runner, build, detokenize, lambda p: greedy_reference(model, snap, p, MAX_NEW, ()), turns, seed,
                        snap.image_token_id, merge)
        assert kept[0] == 0 and all(k > 10 for k in kept[1:])
