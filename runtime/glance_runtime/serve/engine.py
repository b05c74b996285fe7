"""The one place the server touches the runtime: load a model, decode a conversation, report usage.

The server never imports the loop or the runners itself, so moving it onto the public Python API is a
change to this module only. Today every request is decoded from scratch (its prompt is prefilled whole);
the text equals `glance-run`'s because it is made the same way: the same runner, the same budget policy
(`decode_config`), the same stop ids and the same detokenizer.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from ..auto_budget import AUTO, decode_config
from ..defaults import resolve
from ..errors import GlanceError
from ..limits import check_decode
from ..loop import decode
from ..preprocess import IMAGE_PLACEHOLDER, Prompt, process_image
from ..runner import Runner, open_runner

WARMUP_PROMPT = "Hello"


class Cancelled(Exception):
    """Raised inside the decode at a round boundary: the client left or the request ran out of time."""


@dataclass(frozen=True)
class ModelSpec:
    """What to serve, as `glance-run` takes it (all None: the embedded default)."""

    model: Path | None = None
    head: Path | None = None
    artifacts: Path | None = None
    engines: Path | None = None
    backend: str | None = None
    providers: Sequence[str] | None = None
    threads: int | None = None
    budget: int | str | None = None


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    token_ids: list[int]
    tau: float
    rounds: int
    finish_reason: str  # "stop" (a stop token or string) or "length"
    ms: float = 0.0  # the decode's wall time, as an in-process caller would see it
    prepare_ms: float = 0.0  # building its prompt (images, tokens), where the caller timed that
    queue_ms: float = 0.0  # waiting for the runner, where the caller queued it
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Pieces:
    """Streams the newly decodable text as rounds commit, holding back what may still become a stop string.

    The text is re-detokenized whole each round, exactly as `glance-run` prints it, so the streamed
    pieces join to the final text."""

    detokenize: Callable[[Sequence[int]], str]
    stops: tuple[str, ...]
    emit: Callable[[str], None] | None
    tokens: list[int] = field(default_factory=list)
    shown: int = 0
    commits: int = 0
    cut: str | None = None  # the text up to the first stop string, once one appeared

    def on_commit(self, new: list[int]) -> None:
        self.tokens.extend(new)
        self.commits += 1
        text = self.detokenize(self.tokens)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.cut = text[:min(hits)]
            self._show(self.cut)
            raise _StopString
        if not text.endswith("\ufffd"):
            self._show(text[:len(text) - _held_back(text, self.stops)])

    def _show(self, text: str) -> None:
        if self.emit and len(text) > self.shown:
            self.emit(text[self.shown:])
        self.shown = max(self.shown, len(text))


class _StopString(Exception):
    pass


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string (it may yet complete one)."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if stop.startswith(text[-n:]):
                best = n
                break
    return best


class Engine:
    """A loaded model; not thread-safe: the server calls it from its one decode thread only."""

    def __init__(self, spec: ModelSpec, max_new_tokens: int, progress: Callable[[str], None] = lambda _: None):
        if spec.engines is not None:  # engines name their own model: no embedded default around them
            model, head, artifacts, backend = spec.model, spec.head, spec.artifacts, "tensorrt"
        else:
            model, head, artifacts, backend = resolve(spec.model, spec.head, spec.artifacts, spec.backend)
        options = dict(providers=spec.providers, threads=spec.threads) if backend == "onnxruntime" else {}
        self.runner: Runner = open_runner(backend, model=model, head=head, artifacts=artifacts, engines=spec.engines,
                                          progress=progress, **options)
        self.name = Path(spec.engines or model or artifacts).name
        self.cfg = decode_config(self.runner, spec.budget, max_new_tokens=max_new_tokens, branch_k=8,
                                 speculative=self.runner.backend.block_size > 1, progress=progress)
        check_decode(self.runner.limits, self.cfg)

    @property
    def backend(self) -> str:
        return self.runner.backend.name

    @property
    def budget(self) -> int | str:
        return AUTO if self.cfg.auto else self.cfg.budget

    def warm(self) -> None:
        """One short decode, so the first client does not pay for lazy initialisation."""
        messages = [{"role": "user", "content": [{"type": "text", "text": WARMUP_PROMPT}]}]
        self.complete(self.prepare(messages, 4), 4)

    def prepare(self, messages: list[dict[str, Any]], max_tokens: int) -> Prompt:
        """The prompt, refused here, before anything is decoded, if it cannot be (safe on any thread).

        A single user turn is built exactly as `glance-run` builds it; longer conversations are rendered
        with the snapshot's chat template (graph backends), one image at most per conversation."""
        images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
        if len(images) > 1:
            raise GlanceError(f"the conversation has {len(images)} images; this server takes one image per request")
        texts = [p["text"] for p in messages[0]["content"] if p["type"] == "text"]
        builder = getattr(self.runner.backend, "prompts", None)
        if len(messages) == 1 and messages[0]["role"] == "user" and len(texts) <= 1:
            prompt = self.runner.build_prompt(texts[0] if texts else "", images[0] if images else None)
        elif builder is None:
            raise GlanceError(f"the {self.backend} backend serves a single user message; send one, or serve "
                              "exported graphs (--artifacts) for system prompts and multi-turn conversations")
        else:
            prompt = _render(builder, messages, images[0] if images else None)
        room = getattr(self.runner.backend, "max_context", None)
        tree = getattr(self.runner.backend, "max_tree", None) or 1
        if room is not None and prompt.length + max_tokens + tree > room:
            raise GlanceError(f"the prompt's {prompt.length} tokens + max_tokens {max_tokens} (+ {tree} rows for a "
                              f"verify pass) exceed the model's context of {room}; shorten the conversation or "
                              "ask for fewer tokens")
        return prompt

    def complete(self, prompt: Prompt, max_tokens: int, stop: Sequence[str] = (),
                 emit: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Completion:
        """Decode one prompt greedily; `emit` gets text pieces as rounds commit, `cancelled` is polled each round.
        Call it from one thread at a time."""
        t0 = time.perf_counter()
        cfg = dataclasses.replace(self.cfg, max_new_tokens=max_tokens)
        pieces = _Pieces(self.runner.detokenize, tuple(s for s in stop if s), emit)

        def on_commit(new: list[int]) -> None:
            if cancelled():
                raise Cancelled
            pieces.on_commit(new)

        try:
            result = decode(self.runner.backend, prompt, cfg, self.runner.stop_ids, on_commit=on_commit)
        except _StopString:
            rounds = max(pieces.commits - 1, 1)  # the first commit is the prefill's token
            return Completion(pieces.cut or "", prompt.length, pieces.tokens, (len(pieces.tokens) - 1) / rounds,
                              rounds, "stop", (time.perf_counter() - t0) * 1e3)
        text = self.runner.detokenize(result.tokens)
        pieces._show(text)
        finish = "length" if result.stopped_on is None and len(result.tokens) >= max_tokens else "stop"
        return Completion(text, prompt.length, result.tokens, result.tau, len(result.rounds), finish,
                          (time.perf_counter() - t0) * 1e3, result.stats())

    def close(self) -> None:
        self.runner = None  # type: ignore[assignment]  # the sessions and buffers go with the last reference


def _render(builder, messages: list[dict[str, Any]], image: Image.Image | None) -> Prompt:
    """The conversation through the chat template, its image placeholder expanded as the runtime's prompt
    builder expands it for a single turn."""
    if image is not None and builder.image_token_id is None:
        raise GlanceError("the served model is text-only; send messages without images")
    rendered = builder.template.render([{"role": m["role"], "content": [
        {"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]} for p in m["content"]]}
        for m in messages])
    if image is None:
        return Prompt(builder.encode(rendered))
    pixel_values, grid = process_image(image.convert("RGB"), builder.image_config)
    n_tokens = int(grid[0].prod()) // builder.image_config.merge_size ** 2
    ids = builder.encode(rendered.replace(IMAGE_PLACEHOLDER, IMAGE_PLACEHOLDER * n_tokens))
    if int((ids == builder.image_token_id).sum()) != n_tokens:
        raise GlanceError(f"the chat template must emit exactly one {IMAGE_PLACEHOLDER} per image")
    return Prompt(ids, pixel_values, np.asarray(grid))
