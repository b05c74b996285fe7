"""Each token id's own bytes, as OpenAI's log-probs report them (`token` text and its UTF-8 `bytes`).

A token alone need not be whole characters: a byte-level BPE token (every Qwen family) may hold half of a
Chinese character, so decoding it alone loses bytes. Its vocabulary string spells bytes in the byte-level
alphabet (each byte one printable character: printable Latin-1 bytes stand for themselves, the other 68
take the code points from 256 on, in byte order), which is inverted here; special tokens are their text.
"""
from __future__ import annotations

import re
from functools import lru_cache

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's spelling of a lone byte


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """Byte-level character -> the byte it spells."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenBytes:
    """Bytes and text of single token ids of one `tokenizers.Tokenizer`, cached per id."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import ByteLevel

        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, ByteLevel)
        self.special = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        """The token's bytes: empty for an id the tokenizer has no token for (a model's padded vocabulary)."""
        found = self._cache.get(token)
        if found is None:
            found = self._cache[token] = self._spell(int(token))
        return found

    def text(self, token: int) -> str:
        """The token's bytes as text, a byte that completes no character shown as U+FFFD."""
        return self.bytes(token).decode("utf-8", errors="replace")

    def _spell(self, token: int) -> bytes:
        if token in self.special:
            return self.special[token].encode()
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if self.byte_level:
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        lone = _BYTE_FALLBACK.fullmatch(piece)
        if lone:
            return bytes([int(lone.group(1), 16)])
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()
