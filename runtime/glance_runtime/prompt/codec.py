"""A model's text side, one object above its backend: conversations into prompts, generated ids into text,
and the ids an answer stops at.

A backend owns graphs, caches and passes only; everything that reads the tokenizer, the chat template or
the image processor is here, built either from the files exported beside the graphs (`exported_codec`) or,
for the torch reference, from the snapshot itself (the export package builds it), so every caller (the API,
the commands, the audits) turns text into a Prompt and back the same way whatever decodes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .messages import ImageLike, user_turn
from .prompt_builder import Prompt, PromptBuilder

if TYPE_CHECKING:
    from ..formats.artifacts import Manifest


@dataclass(frozen=True)
class PromptCodec:
    encode: Callable[[Sequence[dict[str, Any]]], Prompt]  # OpenAI-style messages (images, videos) -> Prompt
    tokenizer: Any  # the raw `tokenizers.Tokenizer`: streamed text and `decode`
    stop_ids: tuple[int, ...]  # an answer ends at the first of these
    image_token_id: int | None  # None for text-only targets
    merge_size: int  # vision patches merged into one image row (1 for text-only targets)
    max_positions: int | None = None  # the positions the model has, where no backend bound is smaller

    def turn(self, text: str, image: ImageLike | None = None) -> Prompt:
        """One user turn: the text after one image, or alone."""
        return self.encode([user_turn(text, [image] if image is not None else [])])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens dropped (what the commands print)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def exported_codec(manifest: "Manifest") -> PromptCodec:
    """The codec of exported graphs: the tokenizer, template and processor files the export copied beside them."""
    m = manifest
    builder = PromptBuilder(m.path, m.image_token_id if m.is_vl else None, m.family)
    return PromptCodec(builder.build_messages, builder.tokenizer, m.stop_token_ids,
                       m.image_token_id if m.is_vl else None, m.spatial_merge_size if m.is_vl else 1)
