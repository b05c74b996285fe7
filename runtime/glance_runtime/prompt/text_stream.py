"""Answer text as tokens arrive: incremental, whole characters only, ended at a stop string.

Re-decoding the whole answer on every commit is quadratic in its length; `tokenizers`' DecodeStream
keeps only the few tokens an unfinished character spans, so each token costs the same and the
pieces join to exactly the tokenizer's decode of all of them (special tokens skipped). Stop strings
may span pieces, so the last (longest stop - 1) characters are held back until they cannot begin
one; the answer ends before the first stop string, which is not included. Bytes that never complete a
character (a truncated answer, a random model) are what the tokenizer's decode makes of them, once,
at the end.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import InputError


class TextStream:
    """Feed tokens one at a time with `push`; each call returns the text that is final now."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream

        if any(not isinstance(s, str) or not s for s in stops):
            raise InputError(f"stop strings must be non-empty strings; got {list(stops)!r}")
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""  # decoded, not yet returned: it may begin a stop string
        self.stopped = False  # a stop string was reached; later tokens add nothing
        self.tokens: list[int] = []
        self.decoded = 0  # characters the decoder has produced so far
        self.waiting = False  # the last token's bytes are not a whole character yet

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        piece = self.decoder.step(self.tokenizer, int(token))
        self.waiting = piece is None
        return self._take(piece) if piece else ""

    def _take(self, piece: str) -> str:
        self.decoded += len(piece)
        text = self.held + piece
        ends = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if ends:
            self.stopped, self.held = True, ""
            return text[:min(ends)]
        cut = max(len(text) - self.hold, 0)
        self.held = text[cut:]
        return text[:cut]

    def finish(self) -> str:
        """What was held back, once no more tokens will come."""
        if self.stopped:
            return ""
        out = ""
        if self.waiting:
            full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            out = self._take(full[self.decoded:])
            if self.stopped:
                return out
        out, self.held = out + self.held, ""
        return out
