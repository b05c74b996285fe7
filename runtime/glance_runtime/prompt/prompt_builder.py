"""Torch-free prompt building: chat template, tokenizer and the Qwen2-VL image processor in numpy/PIL.

The edge runtime cannot import transformers, yet its prompts must be the exact ids and pixels the
exporter's reference path (transformers) produces, or parity with the torch oracle is lost at token
zero. So this module re-derives each step from the snapshot's own files: `chat_template.jinja` (or
`tokenizer_config.json`'s template) rendered with jinja2 under the same environment settings,
`tokenizer.json` through `tokenizers`, and `preprocessor_config.json` driving a smart resize, a PIL
bicubic resize of the uint8 image, rescale/normalise and the patch layout the vision tower expects.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from ..errors import GlanceError, InputError, IntegrityError
from ..formats.common import read_json, read_text
from .images import smart_resize, to_rgb
from .messages import split
from .processor_values import read_processor_config
from .video import VIDEO_PLACEHOLDER, Video, VideoProcessorConfig, placeholder, process_video, seconds_per_grid

IMAGE_PLACEHOLDER = "<|image_pad|>"
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


@dataclass
class Prompt:
    """Everything the target's prefill needs, as numpy, for every backend."""

    input_ids: np.ndarray  # int64 [P]
    pixel_values: np.ndarray | None = None  # float32 [patches, C*t*p*p]
    image_grid_thw: np.ndarray | None = None  # int64 [images, 3], one (t, h, w) per image in prompt order
    pixel_values_videos: np.ndarray | None = None  # float32 [patches, C*t*p*p], every video's in prompt order
    video_grid_thw: np.ndarray | None = None  # int64 [videos, 3]
    second_per_grid_ts: np.ndarray | None = None  # float32 [videos]: seconds one temporal patch spans
    video_token_id: int | None = None  # set with the videos: the id their placeholder tokens carry

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def check_unicode(text: str, what: str) -> None:
    """Refuse text holding a lone surrogate: it has no UTF-8 form, so no tokenizer or client can carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what} holds a lone surrogate ({text[exc.start]!a} at character {exc.start}), which is not "
                         "text; pass valid Unicode (decode bytes as UTF-8 first)") from None


def check_text_placeholders(messages: Sequence[dict[str, Any]]) -> None:
    """Refuse message text holding an image or video placeholder token: the token stands for pixels the prompt
    does not carry there, so the prompt's images and their placeholders would no longer pair up."""
    for i, msg in enumerate(messages):
        content = msg["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
        for token, kind, article in ((IMAGE_PLACEHOLDER, "image", "an"), (VIDEO_PLACEHOLDER, "video", "a")):
            if any(token in text for text in texts):
                raise InputError(f"the prompt text (message {i}) holds {token}, the model's {kind} placeholder token, "
                                 f"which stands for {article} {kind}'s pixels and is placed only for {article} {kind} "
                                 f"given; remove it from the text and pass the {kind} itself as {kind}s=[...] or a "
                                 f"{{'type': '{kind}', ...}} part")


def check_placeholders(rendered: str, images: int, videos: int, where: str) -> None:
    """Refuse, before any pixels are processed, a template that did not emit one placeholder per image and video."""
    for token, count, kind in ((IMAGE_PLACEHOLDER, images, "image"), (VIDEO_PLACEHOLDER, videos, "video")):
        if rendered.count(token) != count:
            raise InputError(f"the chat template {where} must emit exactly one {token} per {kind} (it emitted "
                             f"{rendered.count(token)} for {count}); give it a {kind} branch as the Qwen-VL "
                             "templates have")


def expand_placeholders(rendered: str, images: Sequence[str], videos: Sequence[str]) -> str:
    """The rendered prompt with its k-th image and video placeholder replaced by the k-th expansion of that kind,
    in prompt order (`check_placeholders` has passed)."""
    queues = {IMAGE_PLACEHOLDER: iter(images), VIDEO_PLACEHOLDER: iter(videos)}
    pattern = f"{re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)}"
    return re.sub(pattern, lambda match: next(queues[match.group(0)]), rendered)


def processed_videos(videos: Sequence[Video], cfg: VideoProcessorConfig) -> tuple[dict[str, np.ndarray], list[str]]:
    """The Prompt fields of `videos` (empty when there are none) and each one's placeholder text."""
    if not videos:
        return {}, []
    done = [process_video(video, cfg) for video in videos]
    fields = {"pixel_values_videos": np.concatenate([pixels for pixels, _ in done]),
              "video_grid_thw": np.concatenate([grid for _, grid in done]),
              "second_per_grid_ts": np.array([seconds_per_grid(cfg, v.fps) for v in videos], np.float32)}
    return fields, [placeholder(cfg, grid, len(v.frames), v.fps) for v, (_, grid) in zip(videos, done)]


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of a Qwen2-VL `preprocessor_config.json` that shape pixel_values."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL bicubic
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ImageProcessorConfig":
        """Read min/max pixels from the legacy keys or from `size` {shortest_edge, longest_edge}."""
        size = raw.get("size") or {}
        base = cls()
        mean, std = raw.get("image_mean", base.image_mean), raw.get("image_std", base.image_std)
        return cls(patch_size=int(raw.get("patch_size", base.patch_size)),
                   temporal_patch_size=int(raw.get("temporal_patch_size", base.temporal_patch_size)),
                   merge_size=int(raw.get("merge_size", base.merge_size)),
                   min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or base.min_pixels),
                   max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or base.max_pixels),
                   image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
                   image_std=tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3,
                   rescale_factor=float(raw.get("rescale_factor", base.rescale_factor)),
                   resample=int(raw.get("resample", base.resample)),
                   do_resize=bool(raw.get("do_resize", True)), do_rescale=bool(raw.get("do_rescale", True)),
                   do_normalize=bool(raw.get("do_normalize", True)))


def process_image(image: Image.Image, cfg: ImageProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
    """pixel_values float32 [grid_h*grid_w, C*t*p*p] in merge-window order, and image_grid_thw int64 [1, 3].

    Resizing happens on the uint8 image (as transformers' PIL backend does); rescale runs in float64
    and normalisation in float32, matching its rounding so the result is bit-identical."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    rgb = to_rgb(image)
    height, width = rgb.height, rgb.width
    if cfg.do_resize:
        height, width = smart_resize(height, width, p * m, cfg.min_pixels, cfg.max_pixels)
        rgb = rgb.resize((width, height), resample=_RESAMPLE[cfg.resample])
    elif height % (p * m) or width % (p * m):
        raise InputError(f"with do_resize false the image must be a multiple of {p * m} px; got {width}x{height}")
    pixels = np.asarray(rgb).astype(np.float64)
    pixels = (pixels * cfg.rescale_factor if cfg.do_rescale else pixels).astype(np.float32)
    if cfg.do_normalize:
        pixels = (pixels - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    chw = pixels.transpose(2, 0, 1)
    gh, gw = height // p, width // p
    blocks = chw.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    flat = np.ascontiguousarray(frames).reshape(gh * gw, 3 * t * p * p)
    return flat, np.array([[1, gh, gw]], dtype=np.int64)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json, stored either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=32)
def _compiled(source: str):
    """The template compiled under transformers' environment settings. Compiling is most of opening a model's
    prompt builder and depends on the source text alone, so a process compiles each template once."""
    try:
        import jinja2
        import jinja2.ext

        from .template_budget import BudgetedSandbox
    except ImportError:
        raise GlanceError("rendering the chat template needs jinja2: pip install 'jinja2>=3.1'") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=jinja2.utils.Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise IntegrityError(f"the chat template does not parse ({exc.message} at line {exc.lineno}); restore "
                          "chat_template.jinja from the model's source") from None


class ChatTemplate:
    """A chat template rendered the way transformers renders it (sandboxed jinja2, trimmed blocks)."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.template = _compiled(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_dir(cls, path: Path) -> "ChatTemplate":
        """`chat_template.jinja` if present, else the template inside `tokenizer_config.json`; rendered once on
        a probe conversation, so a template that fails or runs past its budget is refused when loaded."""
        tok_cfg_path = path / "tokenizer_config.json"
        try:
            tok_cfg = read_json(tok_cfg_path, "tokenizer config", "restore it from the model's source") \
                if tok_cfg_path.is_file() else {}
            jinja_file = path / "chat_template.jinja"
            source = read_text(jinja_file, "chat template", "restore it from the model's source") \
                if jinja_file.is_file() else tok_cfg.get("chat_template")
        except GlanceError as exc:
            raise IntegrityError(str(exc)) from None
        specials = {k: s for k, v in tok_cfg.items() if k.endswith("_token") and (s := _token_text(v)) is not None}
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not source or not isinstance(source, str):
            raise IntegrityError(f"{path} has no chat template; add chat_template.jinja to the snapshot")
        template = cls(source, specials)
        try:
            template.render([{"role": "user", "content": "probe"}])
        except InputError:  # a template may refuse a conversation; it only has to render within its budget
            pass
        return template

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The rendered prompt; a template that runs past its budget or fails inside is the model files' fault."""
        from jinja2.exceptions import TemplateError

        from .template_budget import OverBudget, render_on_budget

        try:
            return render_on_budget(lambda: self.template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens))
        except TemplateError as exc:
            raise InputError(f"the chat template rejected the prompt: {exc}") from None
        except OverBudget as exc:
            raise IntegrityError(f"the chat template ran past its budget ({exc}) rendering this prompt; restore "
                                 "chat_template.jinja from the model's source") from None
        except (RecursionError, MemoryError, ArithmeticError, TypeError, ValueError, LookupError,
                AttributeError) as exc:
            raise IntegrityError(f"the chat template failed ({type(exc).__name__}: {str(exc)[:120]}); restore "
                                 "chat_template.jinja from the model's source") from None


class PromptBuilder:
    """Turns a conversation into a Prompt from a directory of tokenizer/template/processor files.

    `image_token_id` is None for text-only targets; then an image or a video is refused. `family` picks the
    video processor's rules (Qwen3-VL's differ)."""

    def __init__(self, files_dir: str | Path, image_token_id: int | None = None, family: str = "qwen2_vl"):
        self.path = Path(files_dir)
        self.family = family
        if not (self.path / "tokenizer.json").is_file():
            raise IntegrityError(f"{self.path} has no tokenizer.json; the torch-free runtime needs the fast tokenizer file")
        self.image_token_id = image_token_id
        if image_token_id is not None and not (self.path / "preprocessor_config.json").is_file():
            raise IntegrityError(f"{self.path} has no preprocessor_config.json; a vision model needs its image processor")
        self.template = ChatTemplate.from_dir(self.path)
        self.tokenizer  # loaded and checked now, like the processor's values: found before any prompt
        if image_token_id is not None:
            self.image_config

    @cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(self.path / "tokenizer.json"))
        except Exception as exc:  # tokenizers' Rust errors share no base class short of Exception
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
            raise IntegrityError(f"cannot load {self.path / 'tokenizer.json'} ({reason}); restore it from the "
                                 "model's source") from None

    @cached_property
    def image_config(self) -> ImageProcessorConfig:
        return ImageProcessorConfig.from_json(read_processor_config(self.path / "preprocessor_config.json"))

    @cached_property
    def video_config(self) -> VideoProcessorConfig:
        return VideoProcessorConfig.from_dir(self.path, self.family)

    @cached_property
    def video_token_id(self) -> int:
        token = self.tokenizer.token_to_id(VIDEO_PLACEHOLDER)
        if token is None:
            raise InputError(f"the tokenizer in {self.path} has no {VIDEO_PLACEHOLDER} token; this model cannot "
                              "take video")
        return int(token)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of rendered text: every prompt passes here, so text that is not Unicode is refused here."""
        check_unicode(text, "the prompt")
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def build_messages(self, messages) -> Prompt:
        """Render a conversation (OpenAI-style messages, any number of images and videos) with the snapshot's
        template; each image and video gets its own grid and its own run of placeholder tokens, in prompt order."""
        rendered_msgs, images, videos = split(messages, text_only=self.image_token_id is None)
        check_text_placeholders(rendered_msgs)
        rendered = self.template.render(rendered_msgs)
        check_placeholders(rendered, len(images), len(videos), f"in {self.path}")
        processed = [process_image(image, self.image_config) for image in images]
        counts = [int(grid[0].prod()) // self.image_config.merge_size ** 2 for _, grid in processed]
        video_fields, video_texts = processed_videos(videos, self.video_config) if videos else ({}, [])
        ids = self.encode(expand_placeholders(rendered, [IMAGE_PLACEHOLDER * n for n in counts], video_texts))
        if images and int((ids == self.image_token_id).sum()) != sum(counts):
            raise IntegrityError(f"the tokenizer in {self.path} does not map {IMAGE_PLACEHOLDER} to image_token_id "
                              f"{self.image_token_id}")
        if videos and int((ids == self.video_token_id).sum()) != sum(t.count(VIDEO_PLACEHOLDER) for t in video_texts):
            raise IntegrityError(f"the tokenizer in {self.path} does not keep {VIDEO_PLACEHOLDER} as one token")
        if videos:
            video_fields["video_token_id"] = self.video_token_id
        if not images:
            return Prompt(ids, **video_fields)
        return Prompt(ids, np.concatenate([pixels for pixels, _ in processed]),
                      np.concatenate([grid for _, grid in processed]), **video_fields)
