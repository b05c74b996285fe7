"""A Triton Inference Server model repository that serves GLANCE through Triton's Python backend.

The model `glance` is decoupled (one request, many responses), so `generate_stream` streams pieces as
rounds commit while `generate` gets the whole text in one response. Each model instance is one Triton
stub process holding one runner, which decodes concurrent requests together where the graphs hold batched
graphs (`max_batch`; unset: glance-serve's default); `instance_group` sets how many run per GPU, and replicas of
the repository on more machines sit behind a load balancer. The repository names the model by absolute
paths and the Python environment the stubs run in (`EXECUTION_ENV_PATH`: a virtual environment with the
runtime's dependencies and numpy < 2, which Triton 2.51's stub needs for string tensors: the `triton` extra).
"""
from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from glance_runtime.store.atomic import atomic_directory, check_output
from glance_runtime.errors import GlanceError
from .launch import stub_requirement

REPOSITORY_FORMAT = "glance-triton-repository"
MODEL_NAME = "glance"
TEMPLATE = Path(__file__).with_name("python_model.py")
RUNTIME_ROOT = Path(__import__("glance_runtime").__file__).resolve().parents[1]  # where glance_runtime imports from


@dataclass(frozen=True)
class TritonRepo:
    out: Path
    artifacts: Path | None = None
    engines: Path | None = None
    model: Path | None = None
    head: Path | None = None
    backend: str | None = None
    providers: tuple[str, ...] = ()
    instances_per_gpu: int = 1
    gpus: bool = False  # KIND_GPU instances (one group per visible GPU) instead of KIND_CPU
    python_env: Path | None = None
    max_tokens: int = 1024
    max_batch: int | None = None  # requests one instance decodes together (None: glance-serve's default)


def _param(key: str, value: str) -> str:
    return f'parameters: {{\n  key: "{key}"\n  value: {{ string_value: {json.dumps(value)} }}\n}}\n'


def config_pbtxt(repo: TritonRepo) -> str:
    """The model configuration: string prompt and image, int32 max_tokens, the sampling settings (temperature,
    top_p, top_k, min_p, seed; absent: greedy), string text; decoupled."""
    kind = "KIND_GPU" if repo.gpus else "KIND_CPU"
    paths = {"artifacts": repo.artifacts, "engines": repo.engines, "model": repo.model, "head": repo.head}
    params = {k: str(Path(v).resolve()) for k, v in paths.items() if v is not None}
    params.update(runtime_root=str(RUNTIME_ROOT), max_tokens=str(repo.max_tokens))
    if repo.backend:
        params["backend"] = repo.backend
    if repo.max_batch is not None:
        params["max_batch"] = str(repo.max_batch)
    if repo.providers:
        params["providers"] = ",".join(repo.providers)
    if repo.python_env is not None:
        params["EXECUTION_ENV_PATH"] = str(Path(repo.python_env).resolve())
    return (f'name: "{MODEL_NAME}"\nbackend: "python"\nmax_batch_size: 0\n'
            "model_transaction_policy { decoupled: true }\n"
            "input [\n"
            '  { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] },\n'
            '  { name: "image" data_type: TYPE_STRING dims: [ 1 ] optional: true },\n'
            '  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true },\n'
            '  { name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true },\n'
            '  { name: "top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true },\n'
            '  { name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true },\n'
            '  { name: "min_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true },\n'
            '  { name: "seed" data_type: TYPE_INT64 dims: [ 1 ] optional: true }\n'
            "]\n"
            'output [\n  { name: "text" data_type: TYPE_STRING dims: [ 1 ] }\n]\n'
            f"instance_group [\n  {{ count: {repo.instances_per_gpu} kind: {kind} }}\n]\n"
            + "".join(_param(k, v) for k, v in sorted(params.items())))


def check(repo: TritonRepo) -> None:
    if repo.instances_per_gpu < 1:
        raise GlanceError(f"--instances-per-gpu must be at least 1 (got {repo.instances_per_gpu})")
    if repo.max_batch is not None and repo.max_batch < 1:
        raise GlanceError(f"--max-batch must be at least 1 (got {repo.max_batch})")
    for flag, path in (("--artifacts", repo.artifacts), ("--engines", repo.engines), ("--model", repo.model),
                       ("--head", repo.head), ("--python-env", repo.python_env)):
        if path is not None and not Path(path).is_dir():
            raise GlanceError(f"{flag} {path} does not exist or is not a directory; pass an existing directory")
    if repo.python_env is not None and not (Path(repo.python_env) / "bin" / "python").exists():
        raise GlanceError(f"--python-env {repo.python_env} is not a virtual environment (no bin/python); make one "
                          f"with python3 -m venv and pip install {shlex.join(stub_requirement())} into it")
    check_output(repo.out, REPOSITORY_FORMAT, [repo.artifacts, repo.engines, repo.model, repo.head, repo.python_env])


def write_repository(repo: TritonRepo, progress: Callable[[str], None] = lambda _: None) -> Path:
    """Write (atomically) REPO/glance/{config.pbtxt, 1/model.py}; returns the repository directory."""
    check(repo)
    with atomic_directory(repo.out, REPOSITORY_FORMAT, "glance-export triton") as tmp:
        version = tmp / MODEL_NAME / "1"
        version.mkdir(parents=True)
        shutil.copyfile(TEMPLATE, version / "model.py")
        (tmp / MODEL_NAME / "config.pbtxt").write_text(config_pbtxt(repo))
    progress(f"wrote Triton model repository {repo.out} (model {MODEL_NAME!r}, "
             f"{repo.instances_per_gpu} instance(s) per {'GPU' if repo.gpus else 'server'})")
    return Path(repo.out)
