"""The one place the server touches the runtime, through the Python API's public calls only.

OpenAI clients resend the whole conversation each turn. Each request here is decoded by the API's
`Reuse` handle, which keeps the rows its prompt shares with what the previous request committed (a
conversation that extends the last one prefills only its new turn). The answer is token-identical to a
fresh decode (the API's guarantee), and for a single user turn it is `glance-run`'s text.
With max_batch > 1 requests are decoded together (`Model.submit`), each slot of the batch keeping its last
request's rows for the prompt that shares most of them; every answer is still the one decoded alone.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..api import Model, Output, load
from ..backends.batch_rounds import check_batch
from ..backends.ort_backend import resolve_providers
from ..decode.backend import ServeLimits
from ..decode.limits import answer_rows, check_tree, runtime_limit
from ..batching import OnTokens
from ..decode.sampling import GREEDY, SamplingParams, TokenLogprob
from ..defaults import SERVE_MAX_BATCH, resolve
from ..errors import GlanceError, LimitError
from ..formats.artifacts import read as read_manifest
from ..formats.graphs import MANIFEST
from ..prompt.codec import exported_codec
from ..prompt.prompt_builder import Prompt
from ..prompt.token_bytes import TokenBytes

WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 4
EXPORTED = ("artifacts were exported for", "re-export with `glance-export onnx`")
CONTEXT_FIX = "shorten the conversation or ask for fewer max_tokens"


class Cancelled(Exception):
    """The decode stopped at a round boundary: the client left or the request ran out of time."""


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
    max_context: int | None = None
    max_tree: int | None = None
    max_batch: int = 1  # requests decoded together; 1: one at a time, in arrival order


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    prefill_tokens: int  # the prompt's rows actually prefilled (the rest were kept from the last request)
    token_ids: list[int]
    tau: float
    rounds: int
    finish_reason: str  # "stop" (a stop token or string) or "length"
    ms: float = 0.0  # the decode's wall time, as an in-process caller would see it
    prepare_ms: float = 0.0  # building its prompt (images, tokens), where the caller timed that
    queue_ms: float = 0.0  # waiting for the runner, where the caller queued it
    stats: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None  # the seed the answer was sampled with (drawn where none was asked); None: greedy
    logprobs: list[TokenLogprob] | None = None  # per token id, where the request asked for them


def default_batch(spec: ModelSpec) -> int:
    """Requests to decode together where none was asked for: SERVE_MAX_BATCH where the artifacts served were
    exported for batches (at most as many as they were exported for), else 1 (torch, engines, an EAGLE-3 head,
    `--max-batch 1` exports). Read from the manifest's JSON alone: the backend checks the files as it loads."""
    backend = "tensorrt" if spec.engines is not None else spec.backend
    try:
        _, _, artifacts, backend = resolve(spec.model, spec.head, spec.artifacts, backend)
        manifest = json.loads((artifacts / MANIFEST).read_text()) if artifacts is not None else {}
        exported = manifest["limits"].get("max_batch", 1) if manifest else 1
    except (GlanceError, OSError, ValueError, KeyError, AttributeError, TypeError):  # refused, with its reason, at load
        return 1
    if backend == "torch" or manifest.get("head_kind") == "eagle3" or not isinstance(exported, int) or exported < 2:
        return 1
    return min(SERVE_MAX_BATCH, exported)


def _warmup() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": WARMUP_PROMPT}]}]


def check_warmup(prompt: Prompt, max_context: int) -> None:
    """The warm-up's decode fits the context: a --max-context too small for it is the flag's fault, named with
    the smallest value that serves anything (the chat template and a one-word prompt), not the prompt's."""
    needed = answer_rows(prompt.length, WARMUP_TOKENS)
    if max_context < needed:
        raise LimitError(f"--max-context {max_context} is too small to serve anything: the chat template and the "
                         f"server's one-word warm-up prompt with a {WARMUP_TOKENS}-token answer take {needed} rows; "
                         f"pass --max-context {needed} or more")


def preflight(spec: ModelSpec) -> None:
    """Refuse what the exported graphs cannot serve (--provider, --max-context, --max-tree, --budget, --max-batch)
    from their manifest and prompt files alone, before the server listens, in the words loading them would use.
    TensorRT engines and the torch reference are checked as they load."""
    backend = "tensorrt" if spec.engines is not None else spec.backend
    _, _, artifacts, backend = resolve(spec.model, spec.head, spec.artifacts, backend)
    if artifacts is None or backend != "onnxruntime" or not (artifacts / MANIFEST).is_file():
        return  # exported on first use, or refused with its reason as it loads
    resolve_providers(spec.providers)
    manifest = read_manifest(artifacts)
    context = runtime_limit("--max-context", spec.max_context, manifest.max_context, *EXPORTED)
    tree = runtime_limit("--max-tree", spec.max_tree, manifest.max_tree, *EXPORTED)
    if isinstance(spec.budget, int):
        check_tree(ServeLimits(block_size=1, max_branch_k=1, max_tree=tree, exported=True), spec.budget + 1,
                   spec.budget)
    if spec.max_batch > 1:
        check_batch(manifest, spec.max_batch)
    check_warmup(exported_codec(manifest).encode(_warmup()), context)


@dataclass(frozen=True)
class Job:
    """One request as a runner takes it: `prepare` builds its prompt (images are decoded only then, so a deep
    queue holds no pixels), then it decodes with these settings."""

    prepare: Callable[[], Prompt]
    max_tokens: int
    stops: Sequence[str] = ()
    emit: Callable[[str], None] | None = None
    cancelled: Callable[[], bool] = lambda: False
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # alternatives each token reports (None: no log-probs)
    on_tokens: OnTokens | None = None  # each round's kept tokens and their reports, after their text reached emit


class Engine:
    """A loaded model. At max_batch 1 it is not thread-safe (as the API's Model): the server calls it from one
    thread only; with max_batch > 1, `start` may be called from any thread."""

    def __init__(self, spec: ModelSpec, progress: Callable[[str], None] = lambda _: None):
        backend = "tensorrt" if spec.engines is not None else spec.backend
        self.model: Model = load(spec.artifacts, engines=spec.engines, model=spec.model, head=spec.head,
                                 backend=backend, provider=spec.providers, threads=spec.threads, budget=spec.budget,
                                 max_context=spec.max_context, max_tree=spec.max_tree, progress=progress,
                                 max_batch=spec.max_batch)
        named = spec.engines or resolve(spec.model, spec.head, spec.artifacts, spec.backend)[0] or spec.artifacts
        self.name = Path(named).name
        self.rows = self.model.reuse()  # every request decodes through it, so each keeps what it shares
        self.spelling = TokenBytes(self.model.session.codec.tokenizer)  # tokens' text and bytes for log-probs

    @property
    def backend(self) -> str:
        return self.model.session.backend.name

    @property
    def budget(self) -> int | str:
        return self.model.budget

    def warm(self) -> None:
        """One short decode, so the first client does not pay for lazy initialisation (or auto's measuring)."""
        prompt = self.model.build(messages=_warmup())
        check_warmup(prompt, self.model.session.max_context)
        self.complete(prompt, WARMUP_TOKENS)

    def prepare(self, messages: list[dict[str, Any]], max_tokens: int) -> Prompt:
        """The prompt, refused here, before anything is decoded, if it is bad or would overflow the context."""
        prompt = self.model.build(messages=messages)
        self.model.check_room(prompt, max_tokens, fix=CONTEXT_FIX)
        return prompt

    def complete(self, prompt: Prompt, max_tokens: int, stop: Sequence[str] = (),
                 emit: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] = lambda: False, sampling: SamplingParams = GREEDY,
                 logprobs: int | None = None, on_tokens: OnTokens | None = None) -> Completion:
        """Decode (greedily, or sampling as asked), keeping the rows shared with the last request; `emit` gets the
        text as rounds commit (and `on_tokens` their tokens' reports, where `logprobs` asks for them), `cancelled`
        is polled each round (Cancelled is raised once the rows are consistent)."""
        t0 = time.perf_counter()
        out = self.rows.decode(prompt, max_new_tokens=max_tokens, stop=stop, on_text=emit, cancelled=cancelled,
                               sampling=sampling, logprobs=logprobs, on_tokens=on_tokens)
        return _completion(out, (time.perf_counter() - t0) * 1e3)

    def start(self, prompt: Prompt, max_tokens: int, stop: Sequence[str] = (),
              emit: Callable[[str], None] | None = None,
              cancelled: Callable[[], bool] = lambda: False, sampling: SamplingParams = GREEDY,
              logprobs: int | None = None, on_tokens: OnTokens | None = None) -> "Future[Completion]":
        """`complete` through the batch (max_batch > 1): returns at once; the future settles with the Completion
        (or Cancelled). `emit`, `on_tokens` and `cancelled` run on the batch thread."""
        done: Future = Future()

        def settle(out: Future) -> None:
            try:
                output = out.result()
                done.set_result(_completion(output, output.stats["ms"], output.stats.get("queue_ms", 0.0)))
            except Exception as exc:
                done.set_exception(exc)

        self.model.submit(prompt, max_new_tokens=max_tokens, stop=stop, on_text=emit, cancelled=cancelled,
                          sampling=sampling, logprobs=logprobs, on_tokens=on_tokens).add_done_callback(settle)
        return done

    def close(self) -> None:
        self.model.close()


def _completion(out: Output, ms: float, queue_ms: float = 0.0) -> Completion:
    s = out.stats
    if s["finish"] == "cancelled":
        raise Cancelled
    return Completion(out.text, s["prompt_tokens"], s["prefill_tokens"], out.token_ids, out.tau, s["rounds"],
                      "length" if s["finish"] == "length" else "stop", ms, queue_ms=queue_ms, stats=s, seed=out.seed,
                      logprobs=out.logprobs)
