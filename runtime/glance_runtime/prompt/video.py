"""Torch-free video input: a list of frames to the pixels, grid and placeholder text the Qwen-VL families expect.

transformers' video processors (Qwen2-VL's, used by Qwen2.5-VL too, and Qwen3-VL's) need torchvision, which
the edge install does not have, so this module re-derives them in numpy: the family's resize rule (Qwen3-VL
counts the frames in its pixel budget), torchvision's antialiased bicubic resize of uint8 frames (fixed-point
16-bit weights, width then height, exactly as its CPU kernel rounds), the fused rescale-and-normalise in
float32, padding to a whole temporal patch by repeating the last frame, and the patch layout (temporal
groups, then merge windows). Frames are shown as given: nothing is sampled. `fps` is the rate at which the
given frames were taken; Qwen2.5-VL turns it into temporal positions and Qwen3-VL into the timestamps
written before each frame group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import GlanceError, InputError
from .images import check_aspect, smart_resize, to_rgb
from .processor_values import read_processor_config

DEFAULT_FPS = 2.0  # frames per second of a frame list when the caller does not say (qwen-vl-utils' sampling rate)
VIDEO_PLACEHOLDER = "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
MAX_FRAMES = 768  # the processors' own max_frames


@dataclass
class Video:
    """The frames of one video part (RGB, one size) and the rate they were taken at."""

    frames: list[Image.Image]
    fps: float = DEFAULT_FPS


@dataclass(frozen=True)
class VideoProcessorConfig:
    """The fields of a video processor config that shape pixel_values_videos; defaults are the family's class's."""

    family: str = "qwen2_vl"
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    @classmethod
    def defaults(cls, family: str) -> "VideoProcessorConfig":
        if family == "qwen3_vl":
            return cls(family=family, patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                       image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), max_video_tokens=768)
        return cls(family=family)

    @classmethod
    def from_dir(cls, path: Path, family: str) -> "VideoProcessorConfig":
        """`video_preprocessor_config.json`, else `preprocessor_config.json` (transformers' own fallback), over
        the family's defaults; Qwen2-VL's processor also reads the legacy min_pixels/max_pixels keys."""
        base = cls.defaults(family)
        source = next((p for p in (path / "video_preprocessor_config.json", path / "preprocessor_config.json")
                       if p.is_file()), None)
        raw = read_processor_config(source) if source is not None else {}
        size = raw.get("size") or {}
        min_pixels = size.get("shortest_edge", base.min_pixels)
        max_pixels = size.get("longest_edge", base.max_pixels)
        if family != "qwen3_vl":
            min_pixels, max_pixels = raw.get("min_pixels") or min_pixels, raw.get("max_pixels") or max_pixels
        if int(raw.get("resample", 3)) != 3:
            raise GlanceError(f"{source} asks for resample {raw['resample']}; the runtime resizes video frames "
                              "bicubically only (3), as the Qwen-VL video processors do")
        mean, std = raw.get("image_mean", base.image_mean), raw.get("image_std", base.image_std)
        return replace(base, patch_size=int(raw.get("patch_size", base.patch_size)),
                       temporal_patch_size=int(raw.get("temporal_patch_size", base.temporal_patch_size)),
                       merge_size=int(raw.get("merge_size", base.merge_size)),
                       min_pixels=int(min_pixels), max_pixels=int(max_pixels),
                       image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
                       image_std=tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3,
                       rescale_factor=float(raw.get("rescale_factor", base.rescale_factor)),
                       do_resize=bool(raw.get("do_resize", True)), do_rescale=bool(raw.get("do_rescale", True)),
                       do_normalize=bool(raw.get("do_normalize", True)),
                       cap_pixels_per_frame=bool(raw.get("cap_pixels_per_frame") or False),
                       max_video_tokens=int(raw.get("max_video_tokens", base.max_video_tokens)))


def _round_to(value: float, factor: int) -> int:
    return round(value / factor) * factor


def frame_size(cfg: VideoProcessorConfig, frames: int, height: int, width: int) -> tuple[int, int]:
    """The (height, width) every frame is resized to: the family's smart resize (Qwen3-VL's budget counts
    frames, Qwen2-VL's is per frame), after the optional per-frame pixel cap."""
    factor = cfg.patch_size * cfg.merge_size
    if cfg.family == "qwen3_vl":
        if frames < cfg.temporal_patch_size:
            raise InputError(f"a video needs at least {cfg.temporal_patch_size} frames on {cfg.family}; got {frames}")
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:
            per_frame = max(min(cfg.max_video_tokens * factor * factor, cfg.max_pixels // frames),
                            int(cfg.min_pixels * 1.05))
            max_pixels = per_frame * frames
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        check_aspect(height, width, "video frame", "crop the frames first")
        h, w = _round_to(height, factor), _round_to(width, factor)
        t = _round_to(frames, cfg.temporal_patch_size)
        if t * h * w > max_pixels:
            beta = math.sqrt(frames * height * width / max_pixels)
            return max(factor, math.floor(height / beta / factor) * factor), \
                max(factor, math.floor(width / beta / factor) * factor)
        if t * h * w < cfg.min_pixels:
            beta = math.sqrt(cfg.min_pixels / (frames * height * width))
            return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        total = int(cfg.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total * cfg.temporal_patch_size // frames), int(cfg.min_pixels * 1.05))
    return smart_resize(height, width, factor, cfg.min_pixels, max_pixels)


def _cubic(x: np.ndarray) -> np.ndarray:
    """The antialiasing bicubic kernel (a = -0.5)."""
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _axis_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per output pixel: first input pixel, tap count, int weights, and their fixed-point precision (bits)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(math.ceil(support)) * 2 + 1
    first = np.empty(out_size, np.int64)
    count = np.empty(out_size, np.int64)
    weights = np.zeros((out_size, taps))
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        n = min(int(center + support + 0.5), in_size) - lo
        w = _cubic((np.arange(n) + lo - center + 0.5) * inv)
        total = w.sum()
        weights[i, :n] = w / total if total != 0 else w
        first[i], count[i] = lo, n
    top = weights.max()
    bits = next((b for b in range(22) if int(0.5 + top * (1 << (b + 1))) >= 1 << 15), 22)
    scaled = weights * (1 << bits)
    return first, count, np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64), bits


def _resize_axis(frame: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One pass over one uint8 frame: each output pixel is its taps' integer-weighted sum, rounded at the
    weights' precision and clamped, one tap offset at a time across the whole frame."""
    in_size = frame.shape[axis]
    first, count, weights, bits = _axis_weights(in_size, out_size)
    src = np.moveaxis(frame, axis, 0)
    acc = np.zeros((out_size, *src.shape[1:]), np.int64)
    shape = (out_size,) + (1,) * (src.ndim - 1)
    for tap in range(weights.shape[1]):
        used = tap < count
        if not used.any():
            break
        rows = np.minimum(first + tap, in_size - 1)
        acc += np.where(used, weights[:, tap], 0).reshape(shape) * src[rows]
    out = np.clip((acc + (1 << (bits - 1))) >> bits, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """A uint8 [H, W, C] frame resized as torchvision's antialiased bicubic resize does on the CPU: width,
    then height, each skipped when it does not change."""
    if frame.shape[1] != width:
        frame = _resize_axis(frame, width, 1)
    if frame.shape[0] != height:
        frame = _resize_axis(frame, height, 0)
    return frame


def process_video(video: Video, cfg: VideoProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
    """pixel_values_videos float32 [grid_t*grid_h*grid_w, C*t*p*p] and video_grid_thw int64 [1, 3]."""
    if not video.frames:
        raise InputError("a video needs at least one frame")
    if len(video.frames) > MAX_FRAMES:
        raise InputError(f"a video of {len(video.frames)} frames is over {MAX_FRAMES}; sample fewer frames")
    sizes = {f.size for f in video.frames}
    if len(sizes) > 1:
        raise InputError(f"the frames of a video must all have one size; got {sorted(sizes)}")
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    count, (width, height) = len(video.frames), video.frames[0].size
    if cfg.do_resize:
        height, width = frame_size(cfg, count, height, width)
    elif height % (p * m) or width % (p * m):
        raise GlanceError(f"with do_resize false the frames must be a multiple of {p * m} px; got {width}x{height}")
    # frame by frame, so a long video never holds more than one full-size frame beside the resized ones
    pixels = np.stack([resize_frame(np.asarray(to_rgb(f)), height, width) for f in video.frames]).astype(np.float32)
    if cfg.do_normalize:
        scale = np.float32(1.0 / cfg.rescale_factor) if cfg.do_rescale else np.float32(1)
        mean = np.asarray(cfg.image_mean, np.float32) * scale
        std = np.asarray(cfg.image_std, np.float32) * scale
        pixels = (pixels - mean) / std
    elif cfg.do_rescale:
        pixels = pixels * np.float32(cfg.rescale_factor)
    if pad := -count % tp:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
    grid_t, gh, gw = pixels.shape[0] // tp, height // p, width // p
    blocks = pixels.transpose(0, 3, 1, 2).reshape(grid_t, tp, 3, gh // m, m, p, gw // m, m, p)
    flat = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(grid_t * gh * gw, 3 * tp * p * p)
    return np.ascontiguousarray(flat), np.array([[grid_t, gh, gw]], dtype=np.int64)


def seconds_per_grid(cfg: VideoProcessorConfig, fps: float) -> float:
    """Seconds one temporal patch spans (Qwen2.5-VL's second_per_grid_ts)."""
    return cfg.temporal_patch_size / fps


def placeholder(cfg: VideoProcessorConfig, grid: np.ndarray, frames: int, fps: float) -> str:
    """What replaces the template's one video token: the video's tokens, and on Qwen3-VL before each frame
    group its timestamp (the mean time of the group's first and last frame, the last frame repeated to fill
    the group)."""
    t, h, w = (int(v) for v in np.asarray(grid).reshape(3))
    per_group = h * w // cfg.merge_size ** 2
    if cfg.family != "qwen3_vl":
        return VIDEO_PLACEHOLDER * (t * per_group)
    tp = cfg.temporal_patch_size
    times = [min(i, frames - 1) / fps for i in range(t * tp)]
    text = ""
    for group in range(t):
        first, last = times[group * tp], times[group * tp + tp - 1]
        text += f"<{(first + last) / 2:.1f} seconds>{VISION_START}{VIDEO_PLACEHOLDER * per_group}{VISION_END}"
    return text
