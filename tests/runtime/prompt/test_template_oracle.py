"""Prompt ids against transformers' own `apply_chat_template(..., tokenize=True, add_generation_prompt=True)`
for every family, under chat templates written as each family's are (text templates that print `content`
as it comes, concatenate it, trim it or test `content is string`; vision templates that walk the parts),
for every message shape: plain-string and list-of-parts content, system messages, multi-turn chats and,
on vision models, images; both the runtime's prompt builder and the torch reference's (the snapshot's own
tokenizer and image processor) are checked.

A text template renders whatever `content` holds, so a text-only model gets each message's content as
one string, its text parts joined as the vision templates join them: the oracle for list content there
is transformers on the same conversation written with string content. transformers' Qwen-VL processor
classes cannot be built without torchvision (absent here), so for images the oracle does what their
`__call__` does after the template: each `<|image_pad|>` repeated once per merged patch of its image's
grid from transformers' image processor, then the text tokenized."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from glance_export.model.adapters import Snapshot
from glance_export.train.tokenizer import CHAT_TEMPLATE
from glance_runtime.errors import GlanceError
from glance_runtime.prompt.codec import PromptCodec
from glance_runtime.prompt.prompt_builder import IMAGE_PLACEHOLDER, PromptBuilder
from support import ALL_FAMILIES, VL_FAMILIES

# Prints `content` as it comes (the ChatML templates of Qwen1.5/Qwen2 base models and many fine-tunes).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Concatenates it with `+` (Qwen2-Instruct, Qwen2.5): a list there is a TypeError.
QWEN2 = ("{%- for message in messages %}{%- if loop.first and messages[0].role != 'system' %}"
         "{{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{%- endif %}"
         "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
# Tests `content is string` and renders nothing else (Qwen3).
QWEN3 = ("{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
         "{%- else %}{%- set content = '' %}{%- endif %}"
         "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{%- endif %}")
# Trims it (Llama 3).
LLAMA3 = ("{{- bos_token }}{%- for message in messages %}"
          "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim "
          "+ '<|eot_id|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
# Walks the parts, strings passed whole (Qwen2-VL, Qwen2.5-VL).
QWEN2_VL = ("{% set image_count = namespace(value=0) %}{% for message in messages %}"
            "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
            "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
            "{% else %}{% for content in message['content'] %}"
            "{% if content['type'] == 'image' or 'image' in content %}"
            "{% set image_count.value = image_count.value + 1 %}"
            "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
            "<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same with whitespace control and no default system turn (Qwen3-VL).
QWEN3_VL = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}"
            "{%- if message.content is string %}{{- message.content }}{%- else %}"
            "{%- for content in message.content %}"
            "{%- if content.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
            "{%- elif content.type == 'text' %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
            "{{- '<|im_end|>\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
TEMPLATES = {"qwen2": {"chatml": CHATML, "qwen2": QWEN2}, "qwen3": {"qwen3": QWEN3}, "llama": {"llama3": LLAMA3},
             "qwen2_vl": {"qwen2_vl": QWEN2_VL}, "qwen2_5_vl": {"qwen2_vl": QWEN2_VL},
             "qwen3_vl": {"qwen3_vl": QWEN3_VL}}
CASES = [(family, name) for family in ALL_FAMILIES for name in [*TEMPLATES[family], "default"]]


def _picture(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


TEXT_CHATS = {
    "string": [{"role": "user", "content": "What colour is the square?"}],
    "one part": [{"role": "user", "content": [_text("What colour is the square?")]}],
    "two parts": [{"role": "user", "content": [_text("Read the total: "), _text("42.17 ünïcødé ✓")]}],
    "system": [{"role": "system", "content": "You are brief."},
               {"role": "user", "content": [_text("  Describe the image.  ")]}],
    "system parts": [{"role": "system", "content": [_text("You are brief.")]},
                     {"role": "user", "content": "Describe the image."}],
    "multi-turn": [{"role": "system", "content": "You are brief."},
                   {"role": "user", "content": [_text("What colour is the square?")]},
                   {"role": "assistant", "content": "The square is red."},
                   {"role": "user", "content": "How many circles are there?"}],
    "assistant parts": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": [_text("The square "), _text("is red.")]},
                        {"role": "user", "content": [_text("And the fox?")]}],
}
IMAGE_CHATS = {
    "image": [{"role": "user", "content": [{"type": "image", "image": _picture(0, (90, 150))},
                                           _text("Describe the image.")]}],
    "two images": [{"role": "user", "content": [{"type": "image", "image": _picture(1, (70, 130))}, _text("and"),
                                                {"type": "image", "image": _picture(2, (112, 112))},
                                                _text("What changed?")]}],
    "multi-turn image": [{"role": "system", "content": "You are brief."},
                         {"role": "user", "content": [{"type": "image", "image": _picture(3, (64, 200))},
                                                      _text("Describe it.")]},
                         {"role": "assistant", "content": "The square is red."},
                         {"role": "user", "content": "What colour is the square?"}],
}


@pytest.fixture(scope="module")
def models(snapshot_dir, tmp_path_factory):
    """(family, template) -> (transformers' tokenizer, its image processor or None, the runtime's PromptBuilder over
    the files an export ships, the torch reference's Snapshot), all with that template."""
    built: dict[tuple[str, str], tuple] = {}

    def get(family: str, name: str):
        if (family, name) not in built:
            snap = snapshot_dir(family)
            template = CHAT_TEMPLATE if name == "default" else TEMPLATES[family][name]
            tok = AutoTokenizer.from_pretrained(snap)
            tok.chat_template = template
            out = tmp_path_factory.mktemp(f"{family}_{name}")
            for file in ("tokenizer_config.json", "preprocessor_config.json"):
                if (snap / file).is_file():
                    shutil.copy(snap / file, out / file)
            tok.backend_tokenizer.save(str(out / "tokenizer.json"))
            (out / "chat_template.jinja").write_text(template)
            vl = family in VL_FAMILIES
            image_token_id = json.loads((snap / "config.json").read_text())["image_token_id"] if vl else None
            whole = tmp_path_factory.mktemp(f"{family}_{name}_snapshot")
            for file in snap.iterdir():
                (whole / file.name).symlink_to(file)
            (whole / "chat_template.jinja").unlink()
            (whole / "chat_template.jinja").write_text(template)
            built[family, name] = (tok, AutoImageProcessor.from_pretrained(snap) if vl else None,
                                   PromptBuilder(out, image_token_id, family), Snapshot(whole))
        return built[family, name]

    return get


def _as_strings(messages: list[dict]) -> list[dict]:
    """The conversation with each message's content one string, its text parts joined."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])}
            for m in messages]


def _oracle(tok, image_processor, messages: list[dict]) -> list[int]:
    """transformers' prompt ids for `messages`: the tokenizer's own apply_chat_template, and for images the Qwen-VL
    processor's expansion of each placeholder by its image's grid."""
    images = [p["image"] for m in messages if not isinstance(m["content"], str) for p in m["content"]
              if p["type"] == "image"]
    if not images:
        return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    grids = image_processor(images=images, return_tensors="np")["image_grid_thw"]
    runs = iter(IMAGE_PLACEHOLDER * (int(np.prod(g)) // image_processor.merge_size ** 2) for g in grids)
    text = "".join(piece + (next(runs) if i < len(grids) else "")
                   for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)))
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("chat", list(TEXT_CHATS))
@pytest.mark.parametrize("family,template", CASES)
def test_text_prompt_ids_are_transformers(models, family, template, chat):
    tok, processor, builder, snapshot = models(family, template)
    messages = TEXT_CHATS[chat]
    want = _oracle(tok, processor, messages if family in VL_FAMILIES else _as_strings(messages))
    assert builder.build_messages(messages).input_ids.tolist() == want
    assert snapshot.build_messages(messages).input_ids.tolist() == want


@pytest.mark.parametrize("chat", list(IMAGE_CHATS))
@pytest.mark.parametrize("family,template", [c for c in CASES if c[0] in VL_FAMILIES])
def test_image_prompt_ids_are_transformers(models, family, template, chat):
    tok, processor, builder, snapshot = models(family, template)
    prompt, want = builder.build_messages(IMAGE_CHATS[chat]), _oracle(tok, processor, IMAGE_CHATS[chat])
    assert prompt.input_ids.tolist() == want
    assert snapshot.build_messages(IMAGE_CHATS[chat]).input_ids.tolist() == want
    images = [p["image"] for m in IMAGE_CHATS[chat] if not isinstance(m["content"], str) for p in m["content"]
              if p["type"] == "image"]
    np.testing.assert_array_equal(prompt.image_grid_thw,
                                  processor(images=images, return_tensors="np")["image_grid_thw"])


@pytest.mark.parametrize("family,template", [c for c in CASES if c[0] not in VL_FAMILIES])
def test_a_codec_turn_on_a_text_model_is_transformers(models, family, template):
    """The API's and glance-run's one-turn prompt (a list with one text part) on a text-only model."""
    tok, _, builder, _ = models(family, template)
    codec = PromptCodec(builder.build_messages, builder.tokenizer, (), None, 1)
    want = _oracle(tok, None, [{"role": "user", "content": "What colour is the square?"}])
    assert codec.turn("What colour is the square?").input_ids.tolist() == want


@pytest.mark.parametrize("part", [{"type": "image", "image": _picture(4, (32, 32))},
                                  {"type": "video", "video": [_picture(5, (32, 32))] * 2}], ids=["image", "video"])
def test_a_text_model_refuses_an_image_or_video_part_in_one_line(models, part):
    _, _, builder, snapshot = models("qwen3", "qwen3")
    for build in (builder.build_messages, snapshot.build_messages):
        with pytest.raises(GlanceError, match=f"text-only.*drop the {part['type']}") as err:
            build([{"role": "user", "content": [part, _text("What is it?")]}])
        assert "\n" not in str(err.value)
