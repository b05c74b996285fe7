"""Single tokens' bytes and text, as log-probs report them: a byte-level token's bytes are exactly what it adds to
the answer, also where it holds part of a character."""
from __future__ import annotations

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.formats.artifacts import read
from glance_runtime.prompt.codec import exported_codec
from glance_runtime.prompt.token_bytes import TokenBytes, byte_level_alphabet

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too


@pytest.fixture(scope="module")
def tokenizer():
    return exported_codec(read(DEFAULT_ARTIFACTS)).tokenizer


def test_the_byte_level_alphabet_spells_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(ByteLevel.alphabet())
    assert alphabet["Ġ"] == ord(" ") and alphabet["A"] == ord("A")


@pytest.mark.parametrize("text", ["What is the total?", "  two  spaces\nand a line", "价格是 ¥42", "emoji 🙂 ok"])
def test_tokens_bytes_join_to_the_texts_bytes(tokenizer, text):
    spelling = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(spelling.bytes(i) for i in ids) == text.encode()


def test_a_token_holding_part_of_a_character_keeps_its_bytes_and_shows_a_replacement(tokenizer):
    spelling = TokenBytes(tokenizer)
    ids = tokenizer.encode("价", add_special_tokens=False).ids
    assert len(ids) == 3 and [spelling.bytes(i) for i in ids] == [b"\xe4", b"\xbb", b"\xb7"]
    assert [spelling.text(i) for i in ids] == ["\ufffd"] * 3


def test_special_tokens_are_their_text_and_unknown_ids_are_empty(tokenizer):
    spelling = TokenBytes(tokenizer)
    end = tokenizer.token_to_id("<|im_end|>")
    assert spelling.bytes(end) == b"<|im_end|>" and spelling.text(end) == "<|im_end|>"
    assert spelling.bytes(tokenizer.get_vocab_size() + 5) == b""
