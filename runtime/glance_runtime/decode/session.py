"""One opened model: its backend, the prompt codec above it, and the decode settings resolved against it.

The commands' path and the public API's (`api.Model` wraps a Session with conversations, streamed text and
stop strings), so glance-run, glance-bench and the audits do not each re-assemble
`decode(backend, prompt, config, stop_ids)`. A Session is handed an opened backend (`backends.registry`
opens one by name), so decoding knows nothing of how backends are found.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from .auto_budget import decode_config
from .backend import Backend, ServeLimits
from ..defaults import BRANCH_K, RUN_MAX_NEW_TOKENS
from .limits import check_prompt
from .loop import DecodeConfig, DecodeResult, OnCommit, decode
from ..prompt.codec import PromptCodec
from ..prompt.messages import ImageLike
from ..prompt.prompt_builder import Prompt

UNBOUNDED = 1 << 31  # context rows of a model that states no bound


@dataclass(frozen=True)
class Settings:
    """How to decode, before it is resolved against a backend (auto needs its cost profile)."""
    budget: int | str | None = None  # None: auto where a cost profile exists or is measured, else the fixed default
    max_new_tokens: int = RUN_MAX_NEW_TOKENS
    branch_k: int = BRANCH_K
    speculative: bool = True
    remeasure: bool = False  # auto's cost profile measured again, not read


class Session:
    """An opened backend, its prompt codec, and its decode settings (`settings`, or a config already resolved).

    `oracle`: an independent greedy decode (prompt, max_new_tokens) -> tokens, where there is one; `home`: the
    artifacts or engines served, where a cost profile is stored beside them (None: kept unwritten);
    `identity`: what is served, for cache keys where there is no `home`; `calibration_dirs`: where
    `calibration.json` for `--budget auto` may be, first first."""

    def __init__(self, backend: Backend, codec: PromptCodec, settings: Settings | DecodeConfig = Settings(),
                 progress: Callable[[str], None] = lambda _: None, *,
                 oracle: Callable[[Prompt, int], list[int]] | None = None, home: Path | None = None,
                 identity: str = "", calibration_dirs: tuple[Path, ...] = ()):
        self.backend, self.codec, self.settings, self.progress = backend, codec, settings, progress
        self.oracle, self.home, self.identity, self.calibration_dirs = oracle, home, identity, calibration_dirs

    @property
    def limits(self) -> ServeLimits:
        return self.backend.info.limits

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.codec.stop_ids

    @property
    def max_context(self) -> int:
        """Rows a prompt and its answer may fill: the backend's allocation, else the model's positions."""
        return self.limits.max_context or self.codec.max_positions or UNBOUNDED

    @cached_property
    def config(self) -> DecodeConfig:
        """Resolved on first use, so a bad prompt or image is refused before auto measures this device."""
        s = self.settings
        if isinstance(s, DecodeConfig):
            return s
        return decode_config(self, s.budget, max_new_tokens=s.max_new_tokens, branch_k=s.branch_k,
                             speculative=s.speculative, remeasure=s.remeasure, progress=self.progress)

    def prompt(self, text: str, image: ImageLike | None = None) -> Prompt:
        """One user turn, refused by its token count before anything sized by its length is allocated."""
        prompt = self.codec.turn(text, image)
        check_prompt(prompt.length, self.max_context, flag=self.limits.max_context is not None)
        return prompt

    def build(self, messages: Sequence[dict[str, Any]]) -> Prompt:
        """A conversation's prompt (its length is the caller's to check against the answer it wants)."""
        return self.codec.encode(messages)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def decode(self, prompt: Prompt, on_commit: OnCommit | None = None, *,
               config: DecodeConfig | None = None, keep: int = 0) -> DecodeResult:
        """`config`: this call's (e.g. another answer length), else the session's; `keep`: committed rows the
        prompt starts with (a conversation's earlier turns)."""
        return decode(self.backend, prompt, config or self.config, self.stop_ids, on_commit=on_commit, keep=keep)

    def greedy(self, prompt: Prompt) -> list[int]:
        """The backend's own greedy (AR) tokens, as long as the session's answers may be."""
        plain = DecodeConfig(max_new_tokens=self.config.max_new_tokens, speculative=False)
        return decode(self.backend, prompt, plain, self.stop_ids).tokens

    def reference(self, prompt: Prompt) -> list[int]:
        """Greedy tokens from the independent oracle where the session has one, else the backend's own."""
        if self.oracle is None:
            return self.greedy(prompt)
        return self.oracle(prompt, self.config.max_new_tokens)

    def close(self) -> None:
        self.backend.close()
