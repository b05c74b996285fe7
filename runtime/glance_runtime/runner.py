"""Opens a backend with everything a caller needs around it: prompt building, stop ids, detokenizing.

Backends are imported only when chosen, so the ONNX Runtime path never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .backend import Backend
from .errors import GlanceError

BACKENDS = ("torch", "onnxruntime")


@dataclass
class Runner:
    backend: Backend
    build_prompt: Callable[[str, str | Path | None], Any]
    stop_ids: tuple[int, ...]
    detokenize: Callable[[Sequence[int]], str]
    oracle: Callable[[Any, int], list[int]] | None = None  # independent greedy decode, when the backend has one


def open_torch(model: Path, head: Path | None, dtype: str = "float32") -> Runner:
    try:
        from glance_export.adapters import Snapshot
        from glance_export.head import load_head

        from .backends.torch_backend import TorchBackend, greedy_reference
    except ImportError as exc:
        raise GlanceError(f"the torch backend needs the export extra ({exc.name} is missing): "
                          "pip install 'glance-toolkit[export]'") from None

    snapshot = Snapshot(model)
    backend = TorchBackend(snapshot, load_head(head) if head is not None else None, dtype=dtype)
    stops = snapshot.stop_token_ids
    return Runner(backend=backend, build_prompt=snapshot.build_prompt, stop_ids=stops,
                  detokenize=lambda ids: snapshot.tokenizer.decode(list(ids), skip_special_tokens=True),
                  oracle=lambda prompt, n: greedy_reference(backend.model, snapshot, prompt, n, stops))


def open_runner(backend: str, *, model: Path | None = None, head: Path | None = None,
                artifacts: Path | None = None, dtype: str = "float32") -> Runner:
    if backend == "torch":
        if model is None:
            raise GlanceError("the torch backend needs --model (a HF snapshot directory)")
        return open_torch(model, head, dtype)
    raise GlanceError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
