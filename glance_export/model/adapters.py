"""Model adapters: open a HF-format snapshot directory and turn (image, prompt) into model inputs.

One adapter serves every supported family; what differs between them (vision or not, M-RoPE or
1-D positions, where the language model lives) is read from `config.json`'s `model_type`.
Weights load from safetensors only and `trust_remote_code` is never set.

transformers' `AutoProcessor` cannot be used here: for Qwen-VL it insists on a video processor
that needs torchvision. The prompt is therefore built from its parts, which is also what the
processor does: the snapshot's chat template, its image processor, and the image placeholder
expanded to `grid_t * grid_h * grid_w / merge_size**2` image tokens.
"""
from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError
from PIL import Image

from glance_runtime.prompt.processor_values import read_processor_config
from glance_runtime.errors import GlanceError
from glance_runtime.formats.common import read_json
from glance_runtime.store.input_files import present, regular_file
from glance_runtime.prompt.messages import split, user_turn
from glance_runtime.prompt.prompt_builder import (IMAGE_PLACEHOLDER, Prompt, check_placeholders, expand_placeholders,
                                                  processed_videos)
from glance_runtime.prompt.video import VIDEO_PLACEHOLDER, VideoProcessorConfig

FROM_SOURCE = "restore it from the model's source"
# files of a snapshot that transformers or the tokenizer may open: each is typed before anything reads it, since a
# FIFO among them blocks the library's read until killed
READ_SUFFIXES = (".json", ".jinja", ".safetensors", ".txt", ".model", ".tiktoken")
VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TEXT_FAMILIES = ("qwen2", "qwen3", "llama")
SUPPORTED_FAMILIES = VL_FAMILIES + TEXT_FAMILIES


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json, typed and sized before it is read (a directory, FIFO or link loop is named as such)."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise GlanceError(f"model directory {model_dir} does not exist; pass a HF snapshot directory")
    if not present(path, "model config", FROM_SOURCE):
        raise GlanceError(f"{path} is missing; pass a HF snapshot directory (config.json, safetensors and tokenizer "
                          "files)")
    return read_json(path, "model config", FROM_SOURCE)


def check_file_kinds(model_dir: Path) -> None:
    """Every file of the snapshot a library may read is a regular file, or one line naming what it is."""
    with os.scandir(model_dir) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.endswith(READ_SUFFIXES):
                regular_file(Path(entry.path), "model file", FROM_SOURCE)


def resolve_family(config: dict[str, Any]) -> str:
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise GlanceError(f"unsupported model family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    return family


class Snapshot:
    """A model directory: its config, family, tokenizer, image processor and weights."""

    def __init__(self, model_dir: str | Path):
        self.path = Path(model_dir)
        self.config = read_config(self.path)
        check_file_kinds(self.path)
        self.family = resolve_family(self.config)
        self.is_vl = self.family in VL_FAMILIES
        if not any(self.path.glob("*.safetensors")):
            raise GlanceError(f"{self.path} has no *.safetensors weights; convert the checkpoint to safetensors")
        if not any(present(self.path / name, "tokenizer file", FROM_SOURCE)
                   for name in ("tokenizer.json", "tokenizer_config.json")):
            raise GlanceError(f"{self.path} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
        if self.is_vl and not present(self.path / "preprocessor_config.json", "image processor config", FROM_SOURCE):
            raise GlanceError(f"{self.path} has no preprocessor_config.json; a vision model needs its image processor")
        if self.is_vl:
            read_processor_config(self.path / "preprocessor_config.json")  # values in range before any image

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config.get("text_config", self.config) if self.is_vl else self.config

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
        except Exception as exc:  # tokenizers' Rust errors share no base class short of Exception
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise GlanceError(f"cannot load the tokenizer of {self.path} ({reason}); restore its tokenizer files "
                              "from the model's source") from None
        if not tok.chat_template:
            raise GlanceError(f"{self.path} has no chat template; add chat_template.jinja to the snapshot")
        return tok

    @cached_property
    def image_processor(self):
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.path, trust_remote_code=False)

    @cached_property
    def image_token_id(self) -> int:
        return int(self.config["image_token_id"])

    @cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids from generation_config.json, config.json and the tokenizer, like `generate` would stop on."""
        ids: set[int] = set()
        for source in (self.path / "generation_config.json", None):
            cfg = read_json(source, "generation config", FROM_SOURCE) if source is not None and present(
                source, "generation config", FROM_SOURCE) else self.text_config
            eos = cfg.get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def build_prompt(self, text: str, image: str | Path | Image.Image | None = None) -> Prompt:
        """One user turn (the text after one image, or alone): `build_messages` of that turn."""
        return self.build_messages([user_turn(text, [image] if image is not None else [])])

    def build_messages(self, messages) -> Prompt:
        """A conversation (OpenAI-style messages, any number of images and videos) through the snapshot's own
        template and image processor, which gives every image its own grid and rows, in prompt order. Videos go
        through the runtime's numpy video processor: transformers' needs torchvision, which this install lacks."""
        rendered_msgs, images, videos = split(messages, text_only=not self.is_vl)
        try:
            rendered = self.tokenizer.apply_chat_template(rendered_msgs, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise GlanceError(f"the chat template of {self.path} does not render ({exc}); restore chat_template.jinja "
                              "from the model's source") from None
        check_placeholders(rendered, len(images), len(videos), f"of {self.path}")
        image_fields, counts = {}, []
        if images:
            processed = self.image_processor(images=images, return_tensors="np")
            grid = np.asarray(processed["image_grid_thw"], dtype=np.int64)
            counts = [int(g.prod()) // int(self.image_processor.merge_size) ** 2 for g in grid]
            image_fields = {"pixel_values": np.asarray(processed["pixel_values"], dtype=np.float32),
                            "image_grid_thw": grid}
        video_fields, video_texts = processed_videos(videos, VideoProcessorConfig.from_dir(self.path, self.family)) \
            if videos else ({}, [])
        rendered = expand_placeholders(rendered, [IMAGE_PLACEHOLDER * n for n in counts], video_texts)
        ids = np.asarray(self.tokenizer(rendered, add_special_tokens=False)["input_ids"], dtype=np.int64)
        if images and int((ids == self.image_token_id).sum()) != sum(counts):
            raise GlanceError(f"the tokenizer of {self.path} does not map {IMAGE_PLACEHOLDER} to image_token_id "
                              f"{self.image_token_id}")
        if videos:
            video_fields["video_token_id"] = int(self.config["video_token_id"])
            if int((ids == video_fields["video_token_id"]).sum()) != sum(t.count(VIDEO_PLACEHOLDER) for t in video_texts):
                raise GlanceError(f"the tokenizer of {self.path} does not map {VIDEO_PLACEHOLDER} to video_token_id "
                                  f"{video_fields['video_token_id']}")
        return Prompt(ids, **image_fields, **video_fields)

    def load_model(self, dtype: str = "float32"):
        """The unmodified target, in eval mode; sdpa attention so custom 4D tree masks are honoured."""
        import torch
        from safetensors import SafetensorError
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from transformers.utils import logging as hf_logging

        auto = AutoModelForImageTextToText if self.is_vl else AutoModelForCausalLM
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a bar on stderr would come before a refusal of the weights
        try:
            model = auto.from_pretrained(self.path, dtype=getattr(torch, dtype), use_safetensors=True,
                                         trust_remote_code=False, attn_implementation="sdpa")
        except (OSError, ValueError, SafetensorError) as exc:
            raise GlanceError(f"cannot load weights from {self.path} ({str(exc).splitlines()[0]}); check that its "
                              "*.safetensors files are complete, or restore them from the model's source") from None
        finally:
            if shown:
                hf_logging.enable_progress_bar()
        return model.eval()
