"""One call that opens a backend and decodes prompts with it: the commands' path and the public API's
(`api.Model` wraps a Session with conversations, streamed text and stop strings).

A `Session` owns an opened runner (backend, prompt building, stop ids, detokenizing) and the decode
settings resolved against it, so glance-run, glance-bench and the audits do not each re-assemble
`decode(backend, build_prompt(...), config, stop_ids)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

from .auto_budget import decode_config
from ..defaults import BRANCH_K, RUN_MAX_NEW_TOKENS
from .loop import DecodeConfig, DecodeResult, decode
from ..backends.registry import Runner, open_runner


@dataclass(frozen=True)
class Source:
    """Which model, on which backend: what the shared command-line flags name (`cli_parser.runner_flags`)."""
    backend: str
    model: Path | None = None
    head: Path | None = None
    artifacts: Path | None = None
    engines: Path | None = None
    providers: Sequence[str] | None = None  # ONNX Runtime execution providers, in priority order
    threads: int | None = None  # ONNX Runtime intra-op threads
    max_context: int | None = None  # below the export's or build's bound (graph backends)
    max_tree: int | None = None


@dataclass(frozen=True)
class Settings:
    """How to decode, before it is resolved against a backend (auto needs its cost profile)."""
    budget: int | str | None = None  # None: auto where a cost profile exists or is measured, else the fixed default
    max_new_tokens: int = RUN_MAX_NEW_TOKENS
    branch_k: int = BRANCH_K
    speculative: bool = True
    remeasure: bool = False  # auto's cost profile measured again, not read


class Session:
    """An opened runner and its decode settings (`settings`, or a config already resolved)."""

    def __init__(self, runner: Runner, settings: Settings | DecodeConfig = Settings(),
                 progress: Callable[[str], None] = lambda _: None):
        self.runner, self.settings, self.progress = runner, settings, progress

    @cached_property
    def config(self) -> DecodeConfig:
        """Resolved on first use, so a bad prompt or image is refused before auto measures this device."""
        s = self.settings
        if isinstance(s, DecodeConfig):
            return s
        return decode_config(self.runner, s.budget, max_new_tokens=s.max_new_tokens, branch_k=s.branch_k,
                             speculative=s.speculative, remeasure=s.remeasure, progress=self.progress)

    def prompt(self, text: str, image: str | Path | None = None):
        return self.runner.build_prompt(text, image)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.runner.detokenize(ids)

    def decode(self, prompt, on_commit: Callable[[list[int]], bool | None] | None = None, *,
               config: DecodeConfig | None = None, keep: int = 0) -> DecodeResult:
        """`config`: this call's (e.g. another answer length), else the session's; `keep`: committed rows the
        prompt starts with (a conversation's earlier turns)."""
        return decode(self.runner.backend, prompt, config or self.config, self.runner.stop_ids,
                      on_commit=on_commit, keep=keep)

    def greedy(self, prompt) -> list[int]:
        """The backend's own greedy (AR) tokens, as long as the session's answers may be."""
        plain = DecodeConfig(max_new_tokens=self.config.max_new_tokens, speculative=False)
        return decode(self.runner.backend, prompt, plain, self.runner.stop_ids).tokens

    def reference(self, prompt) -> list[int]:
        """Greedy tokens from the independent oracle where the runner has one, else the backend's own."""
        if self.runner.oracle is None:
            return self.greedy(prompt)
        return self.runner.oracle(prompt, self.config.max_new_tokens)

    def close(self) -> None:
        self.runner.backend.close()


def open_source(source: Source, progress: Callable[[str], None] = lambda _: None) -> Runner:
    """The runner for `source` (glance-bench measures its own configurations on it)."""
    return open_runner(source.backend, model=source.model, head=source.head, artifacts=source.artifacts,
                       engines=source.engines, providers=source.providers, threads=source.threads,
                       max_context=source.max_context, max_tree=source.max_tree, progress=progress)


def open_session(source: Source, settings: Settings = Settings(),
                 progress: Callable[[str], None] = lambda _: None) -> Session:
    """Open `source` and decode with `settings`: the one way in for commands and the Python API."""
    return Session(open_source(source, progress), settings, progress)
