"""The GPU check: every backend this machine has, audited and timed, in one call of a few minutes.

For each backend it finds (the torch reference on CUDA, ONNX Runtime with the CUDA provider, TensorRT
or TensorRT-RTX engines built here, and the same engines with the target built as a chain of three parts;
ONNX Runtime on the CPU as the baseline row), in fp32 and in half precision: GLANCE at the fixed --budget and at auto (this backend's round costs measured here, the
shipped calibration) and the backend's own greedy decode against the torch fp32 oracle (the oracle runs
with TF32 off), GLANCE sampling (temperature 0.8, top-p 0.95) against the backend's own plain sampling with the
same seed, and AR vs GLANCE vs auto ms/token without prefill. Two models: the embedded default (its
held-out prompts, real draft head; then the same with its EAGLE-3 head, one head pass per tree depth) and a
mid-size random Qwen2.5-VL written here (seeded drafts, so
acceptance is high and the speed of the loop itself shows). For the default model, the graph backends on the GPU
are also opened with a KV pool of 4 and every prompt decoded in one batch (fixed budget, plain steps, the batch's
auto), each answer against the oracle, and the batch's ms per token against one prompt at a time. Prints one table, then what it skipped and
why. Needs only this repository and what the machine already has (CUDA PyTorch, transformers, onnx,
onnxruntime); nothing is downloaded.

Then (GPU only) the device sampler (the NVRTC-built sampling kernel on CUDA memory) against the numpy sampler on
random 151,936-token logits, greedy and under each truncation; and `train-head --device cuda` on a tiny random
Qwen2.5-VL: a bf16 target, bf16 autocast with fp32 master weights, answers generated in batches; under torchrun
with NCCL when the machine has two GPUs or more.

    python benchmarks/gpu_check.py [--out DIR] [--prompts 6] [--max-new-tokens 48] [--skip-random] [--skip-eagle3]
        [--skip-batch] [--skip-train]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

from glance_runtime.decode.auto_budget import AUTO_MAX_NODES, AutoBudget  # noqa: E402
from glance_runtime.decode.backend import STEP_DRAFTERS  # noqa: E402
from glance_runtime.backends.seeded import SeededDrafter  # noqa: E402
from glance_runtime.decode.calibration import find_calibration  # noqa: E402
from glance_runtime.decode.cost_profile import measure as measure_costs  # noqa: E402
from glance_runtime.decode.limits import reachable_nodes  # noqa: E402
from glance_runtime.decode.loop import DecodeConfig, decode  # noqa: E402
from glance_runtime.decode.sampling import SamplingParams  # noqa: E402

KINDS = ("receipt", "chart", "scene", "caption")
HALF = {"torch": "float16", "onnxruntime": "fp16"}


@dataclass
class Row:
    model: str
    backend: str
    precision: str
    n: int = 0
    glance_identical: int = 0
    greedy_identical: int = 0
    auto_identical: int = 0
    sampled_identical: int = 0  # GLANCE sampling (T 0.8, seed = prompt index) equal to plain sampling on this backend
    tau: float = 0.0
    ar_ms: float = 0.0
    glance_ms: float = 0.0
    auto_ms: float = 0.0
    status: str = "ok"
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.ar_ms / self.glance_ms if self.glance_ms else 0.0

    def passed(self) -> bool:
        """fp32 must match the oracle on every prompt (fixed budget and auto); half precision as often as the
        backend's own greedy."""
        if self.precision in ("fp32", "float32"):
            return self.glance_identical == self.greedy_identical == self.auto_identical == self.sampled_identical \
                == self.n
        return min(self.glance_identical, self.auto_identical) >= self.greedy_identical


@dataclass
class Case:
    """A model to check: how to build prompts, the oracle's tokens per prompt, seeded or real drafts."""

    name: str
    prompts: list
    oracle: list[list[int]]
    seeded: bool


def auto_config(backend, prompt, cfg: DecodeConfig, places: list[Path]) -> DecodeConfig:
    """`--budget auto` as glance-run builds it: this backend's round costs, measured here (not stored), and
    the calibration shipped beside the model's artifacts or head (else the prior)."""
    largest = min(AUTO_MAX_NODES, reachable_nodes(backend.block_size, cfg.branch_k, backend.info.limits.drafter),
                  (backend.info.limits.max_tree or AUTO_MAX_NODES + 1) - 1)
    cost = measure_costs(backend, prompt, largest + 1, cfg.branch_k)
    policy = AutoBudget(cost, find_calibration(places)[0], min(largest, cost.max_rows - 1), backend.block_size,
                        steps=backend.info.limits.drafter in STEP_DRAFTERS)
    return DecodeConfig(max_new_tokens=cfg.max_new_tokens, budget=policy.max_nodes, branch_k=cfg.branch_k, auto=policy)


def measure(backend, stop_ids, case: Case, cfg: DecodeConfig, auto: DecodeConfig, row: Row) -> Row:
    """Audit and time one backend on a case, at the fixed budget and at auto: first prompt once as a
    warm-up, then every prompt."""
    ar_cfg = DecodeConfig(max_new_tokens=cfg.max_new_tokens, speculative=False)
    decode(backend, case.prompts[0], ar_cfg, stop_ids)
    accepted = rounds = 0
    ar_ms, glance_ms, auto_ms = [], [], []
    for prompt, truth in zip(case.prompts, case.oracle):
        ar = decode(backend, prompt, ar_cfg, stop_ids)
        drafter = SeededDrafter(backend, ar.tokens, prompt.length, lambda d: 0) if case.seeded else backend
        spec = decode(drafter, prompt, cfg, stop_ids)
        sized = decode(drafter, prompt, auto, stop_ids)
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=row.n)
        plain = decode(backend, prompt, replace(ar_cfg, sampling=sampling), stop_ids)
        sampled = decode(backend, prompt, replace(cfg, sampling=sampling), stop_ids)
        row.sampled_identical += sampled.tokens == plain.tokens
        row.n += 1
        row.greedy_identical += ar.tokens == truth
        row.glance_identical += spec.tokens == truth
        row.auto_identical += sized.tokens == truth
        accepted += sum(r.accepted for r in spec.rounds)
        rounds += len(spec.rounds)
        ar_ms.append(ar.ms_per_token_decode)
        glance_ms.append(spec.ms_per_token_decode)
        auto_ms.append(sized.ms_per_token_decode)
    row.tau = accepted / max(rounds, 1)
    row.ar_ms, row.glance_ms, row.auto_ms = (statistics.median(ms) for ms in (ar_ms, glance_ms, auto_ms))
    row.status = "ok" if row.passed() else "FAIL"
    return row


BATCH = 4  # sequences the batched rows decode together


def measure_batched(backend, stop_ids, case: Case, cfg: DecodeConfig, places: list[Path], row: Row) -> Row:
    """In-flight batching on a graph backend opened with max_batch BATCH: every prompt of the case decoded in one
    batch (more prompts than slots wait for one) at the fixed budget, with plain steps and with the batch's auto,
    each against the oracle; ms per token over the batch's wall time against one prompt at a time."""
    from glance_runtime.backends.batch_rounds import BatchRounds
    from glance_runtime.decode.batch_budget import BatchBudget, BatchCost
    from glance_runtime.decode.batch_loop import BatchLoop, Request

    from glance_runtime.decode.batch_budget import start_from_profile

    plain = DecodeConfig(max_new_tokens=cfg.max_new_tokens, speculative=False)
    rounds = BatchRounds(backend)
    sized = auto_config(backend, case.prompts[0], cfg, places)  # each request's own auto, as a session resolves it
    single = sized.auto
    verify_ms = single.cost.verify_cost(list(range(1, single.max_nodes + 2)))
    policy = BatchBudget(BatchCost(start_from_profile(verify_ms, single.cost.draft_ms)), single.calibration,
                         single.max_nodes)
    policy.switch.drafting = True  # this check is about the drafted batch's tokens

    def batch(config: DecodeConfig, auto: bool = False) -> tuple[list[list[int]], float]:
        loop = BatchLoop(rounds, policy if auto else None)
        requests = [Request(p, config, stop_ids) for p in case.prompts]
        t0 = time.perf_counter()
        loop.run(requests)
        ms = (time.perf_counter() - t0) * 1e3
        tokens = [r.result.tokens for r in requests]
        return tokens, ms / max(sum(len(t) for t in tokens), 1)

    batch(cfg)  # warm-up
    spec, row.glance_ms = batch(cfg)
    steps, _ = batch(plain)
    auto, row.auto_ms = batch(sized, auto=True)
    t0 = time.perf_counter()
    alone = [decode(rounds.slots[0], p, cfg, stop_ids).tokens for p in case.prompts]
    row.ar_ms = (time.perf_counter() - t0) * 1e3 / max(sum(len(t) for t in alone), 1)  # one prompt at a time
    row.n = len(case.prompts)
    row.glance_identical = sum(a == b for a, b in zip(spec, case.oracle))
    row.greedy_identical = sum(a == b for a, b in zip(steps, case.oracle))
    row.auto_identical = sum(a == b for a, b in zip(auto, case.oracle))
    row.notes.append(f"batch {BATCH}: ms/token batched vs one at a time in ar_ms/glance_ms")
    row.status = "ok" if row.passed() else "FAIL"
    return row


def default_case(n: int, max_new: int, device: str) -> tuple[Case, Path, Path, Path]:
    """The embedded default on its held-out prompts (n spread over the four kinds), oracle on `device`."""
    from glance_runtime.formats.tasks import read as read_tasks
    from glance_export.model.torch_backend import TorchBackend, greedy_reference
    from glance_export.model.adapters import Snapshot
    from glance_runtime.defaults import DEFAULT_ARTIFACTS, DEFAULT_HEAD, DEFAULT_MODEL

    snapshot = Snapshot(DEFAULT_MODEL)
    tasks = [t for i in range(n) for t in read_tasks(ROOT / "examples" / KINDS[i % 4] / "tasks.jsonl")[i // 4:i // 4 + 1]]
    prompts = [snapshot.build_prompt(t.prompt, t.image) for t in tasks]
    model = TorchBackend(snapshot, None, device=device).model
    oracle = [greedy_reference(model, snapshot, p, max_new, snapshot.stop_token_ids) for p in prompts]
    return Case("default", prompts, oracle, seeded=False), DEFAULT_MODEL, DEFAULT_HEAD, DEFAULT_ARTIFACTS


def random_case(root: Path, n: int, max_new: int, device: str) -> tuple[Case, Path, Path, Path]:
    """A mid-size random Qwen2.5-VL (hidden 512, 8 layers, 32k vocabulary) with seeded drafts."""
    import subprocess

    if not (root / "artifacts" / "manifest.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_bench_model.py"), str(root)], check=True,
                       stdout=subprocess.DEVNULL)
    from glance_export.model.adapters import Snapshot
    from glance_export.model.torch_backend import TorchBackend, greedy_reference

    snapshot = Snapshot(root / "snapshot")
    texts = ["Describe the image.", "What colour is the square?", "Read the total on the receipt.",
             "How many circles are there?"]
    prompts = [snapshot.build_prompt(texts[i % len(texts)] + " " * (i // len(texts)), None) for i in range(n)]
    model = TorchBackend(snapshot, None, device=device).model
    oracle = [greedy_reference(model, snapshot, p, max_new, snapshot.stop_token_ids) for p in prompts]
    return Case("random-512x8", prompts, oracle, seeded=True), root / "snapshot", root / "head", root / "artifacts"


def half_artifacts(model: Path, head: Path, out: Path) -> Path:
    from glance_export.onnx import export_artifacts

    if not (out / "manifest.json").is_file():
        export_artifacts(model, head, out, dtype="fp16", max_tree=64, max_context=1024, progress=lambda _: None)
    return out


def backends(model: Path, head: Path, artifacts: Path, work: Path, cuda: bool, skipped: list[str],
             batched: bool = True):
    """(backend name, precision, opener) for everything this machine can run; skipped gets the rest."""
    import onnxruntime

    from glance_export.model.head import load_head
    from glance_export.model.torch_backend import TorchBackend
    from glance_export.model.adapters import Snapshot
    from glance_runtime.backends.ort_backend import OrtBackend

    snapshot = Snapshot(model)
    found: list[tuple[str, str, Callable]] = [
        ("onnxruntime-cpu", "fp32", lambda: (OrtBackend(artifacts), snapshot.stop_token_ids))]
    if cuda:
        for dtype in ("float32", "float16"):
            found.append(("torch-cuda", dtype, lambda dtype=dtype: (
                TorchBackend(snapshot, load_head(head), dtype=dtype, device="cuda"), snapshot.stop_token_ids)))
    else:
        skipped.append("torch on CUDA: torch.cuda.is_available() is False")
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        found.append(("onnxruntime-cuda", "fp32", lambda: (OrtBackend(artifacts, providers="cuda"),
                                                            snapshot.stop_token_ids)))
        found.append(("onnxruntime-cuda", "fp16", lambda: (
            OrtBackend(half_artifacts(model, head, work / "fp16"), providers="cuda"), snapshot.stop_token_ids)))
        if batched:
            found.append((f"onnxruntime-cuda-batch{BATCH}", "fp32", lambda: (
                OrtBackend(artifacts, providers="cuda", max_batch=BATCH), snapshot.stop_token_ids)))
    else:
        skipped.append(f"ONNX Runtime on CUDA: this onnxruntime has {', '.join(onnxruntime.get_available_providers())}"
                       " (install onnxruntime-gpu)")
    module = next((m for m in ("tensorrt", "tensorrt_rtx") if importlib.util.find_spec(m)), None)
    if module and cuda:
        found.append((module, "fp32", lambda: (tensorrt_backend(module, artifacts, work / "engines-fp32"),
                                               snapshot.stop_token_ids)))
        found.append((module, "fp16", lambda: (tensorrt_backend(module, half_artifacts(model, head, work / "fp16"),
                                                                work / "engines-fp16"), snapshot.stop_token_ids)))
        found.append((f"{module}-chained", "fp32", lambda: (
            tensorrt_backend(module, artifacts, work / "engines-fp32-chained", parts=3), snapshot.stop_token_ids)))
        found.append((f"{module}-chained", "fp16", lambda: (
            tensorrt_backend(module, half_artifacts(model, head, work / "fp16"), work / "engines-fp16-chained", parts=3),
            snapshot.stop_token_ids)))
        if batched:
            found.append((f"{module}-batch{BATCH}", "fp32", lambda: (  # the lone rows' engines: one set serves both
                tensorrt_backend(module, artifacts, work / "engines-fp32", max_batch=BATCH), snapshot.stop_token_ids)))
    else:
        skipped.append("TensorRT: " + ("no GPU" if module else "neither tensorrt nor tensorrt_rtx is installed"))
    return found


def tensorrt_backend(module: str, artifacts: Path, out: Path, parts: int = 1, max_batch: int = 1):
    """Engines built here for this GPU (rtx for TensorRT-RTX, datacenter for TensorRT), then the backend; with
    `parts` > 1 the target is built as a chain of that many part engines (its decode must equal the whole one's:
    both rows are checked against the same oracle); `max_batch` opens them for that many sequences at once (the
    build's default batch, the device profile's, serves any batch up to it)."""
    from glance_export.build.local_gpu import probe_device
    from glance_export.build.engine_build import BuildRequest, build
    from glance_export.build.memory_plan import GIB, graph_bytes
    from glance_runtime.backends.trt_backend import TrtBackend
    from glance_runtime.formats.artifacts import read as load_manifest

    if not (out / "engines.json").is_file():
        target = "rtx" if module == "tensorrt_rtx" else "datacenter"
        part_gib = None
        if parts > 1:
            part_gib = graph_bytes(artifacts, load_manifest(artifacts).graphs)["target"] / parts / GIB
        build(BuildRequest(target, out, artifacts=artifacts, max_part_gib=part_gib), probe_device(),
              progress=lambda _: None)
    backend = TrtBackend(out, artifacts, max_batch=max_batch)
    if parts > 1 and not hasattr(backend.graphs["target"], "parts"):
        raise RuntimeError(f"{out} holds the target whole, not as a chain of parts")
    return backend


def table(rows: list[Row]) -> str:
    head = f"{'model':14s} {'backend':17s} {'prec':8s} {'GLANCE=oracle':>13s} {'auto=oracle':>11s} {'AR=oracle':>9s} " \
           f"{'sampled=plain':>13s} {'tau':>5s} {'AR ms/tok':>9s} {'GLANCE ms/tok':>13s} {'auto ms/tok':>11s} {'speedup':>7s}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.model:14s} {r.backend:17s} {r.precision:8s} {f'{r.glance_identical}/{r.n}':>13s} "
                     f"{f'{r.auto_identical}/{r.n}':>11s} {f'{r.greedy_identical}/{r.n}':>9s} "
                     f"{f'{r.sampled_identical}/{r.n}':>13s} {r.tau:5.2f} "
                     f"{r.ar_ms:9.2f} {r.glance_ms:13.2f} {r.auto_ms:11.2f} "
                     f"{r.speedup:6.2f}x  {r.status}{' (' + '; '.join(r.notes) + ')' if r.notes else ''}")
    return "\n".join(lines)


def check_head_training(work: Path, skipped: list[str]) -> list[str]:
    """GPU only: train a head on CUDA (bf16 target, autocast, fp32 master weights), then under torchrun + NCCL
    where there are two GPUs; returns failures."""
    import os
    import subprocess

    import torch
    from safetensors.torch import load_file

    from support import make_image, make_snapshot

    model = make_snapshot(work / "snapshot", "qwen2_5_vl")
    rows = []
    for i in range(8):
        make_image(work / f"{i}.png", 56 + 28 * (i % 3), 56 + 28 * (i // 3), seed=i)
        rows.append(json.dumps({"image": f"{i}.png", "prompt": "What is shown?" + " Look." * i}))
    (work / "tasks.jsonl").write_text("\n".join(rows) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "runtime")]))
    args = ["-m", "glance_export", "train-head", "--model", str(model), "--data", str(work / "tasks.jsonl"),
            "--block-size", "4", "--steps", "20", "--batch", "2", "--anchors", "4", "--max-new-tokens", "16",
            "--device", "cuda"]
    runs = [("1 GPU", [sys.executable, *args, "--out", str(work / "head1")], work / "head1")]
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        runs.append((f"torchrun {gpus} GPUs", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                               f"--nproc-per-node={gpus}", *args, "--out", str(work / "headN")],
                     work / "headN"))
    else:
        skipped.append("train-head under torchrun with NCCL: this machine has one GPU")
    failures = []
    for name, cmd, out in runs:
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        state = load_file(str(out / "model.safetensors")) if done.returncode == 0 else {}
        ok = bool(state) and all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in state.values())
        print(f"train-head {name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f}s; "
              f"{(done.stdout.strip().splitlines() or [''])[-2:]}", flush=True)
        if not ok:
            failures.append(f"train-head {name}: {done.stderr.strip()[-400:]}")
    return failures


def check_device_sampler(skipped: list[str]) -> list[str]:
    """GPU only: DeviceSampler's tokens and top ids against the numpy sampler's on flat, peaked, integer (tied) and
    spread rows of a full vocabulary, greedy and sampled under each truncation; returns failures."""
    import numpy as np

    from glance_runtime.backends.device_buffers import CudaDevice
    from glance_runtime.backends.device_sampling import DeviceSampler
    from glance_runtime.decode.sampling import logprobs, sample
    from glance_runtime.errors import GlanceError

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (16, 151_936)).astype(np.float32)
    logits[0::4] *= 0.05
    logits[1::4, 7] += 20
    logits[2::4] = np.round(logits[2::4])
    rows, positions = np.arange(16), rng.integers(0, 500, 16)
    settings = [SamplingParams(), SamplingParams(0.8, seed=1), SamplingParams(0.8, top_k=50, seed=2),
                SamplingParams(0.8, top_p=0.9, seed=3), SamplingParams(0.8, min_p=0.05, seed=4),
                SamplingParams(0.8, top_p=0.9, top_k=50, min_p=0.05, seed=5)]
    try:
        device = CudaDevice()
        sampler = DeviceSampler(device)
        buffer = device.empty(logits.shape, np.float32)
        device.upload(buffer.rows(16), logits)
        sampler.choose(buffer.rows(16), rows, positions, settings[0])  # compiles and loads the kernel
    except GlanceError as exc:
        skipped.append(f"the device sampler: {exc}")
        return []
    differ = 0
    try:
        for params in settings:
            t0 = time.perf_counter()
            chosen = sampler.choose(buffer.rows(16), rows, positions, params, top_n=5)
            ms = (time.perf_counter() - t0) * 1e3
            tokens = sample(logits, positions, params)
            same = (chosen.tokens == tokens) & (chosen.top_ids == logprobs(logits, tokens, 5).top_ids).all(axis=1)
            differ += int((~same).sum())
            print(f"device sampler T {params.temperature} top-k {params.top_k} top-p {params.top_p} min-p "
                  f"{params.min_p}: {'equal' if same.all() else 'DIFFERS'} on {same.sum()}/16 rows, {ms:.2f} ms",
                  flush=True)
    except GlanceError as exc:
        return [f"device sampler: {exc}"]
    finally:
        sampler.close()
        device.free(buffer)
    return [f"device sampler: {differ} rows differ from the numpy sampler"] if differ else []


def eagle3_case(n: int, max_new: int, device: str, work: Path) -> tuple[Case, Path, Path, Path]:
    """The embedded default with its EAGLE-3 head (one head pass per tree depth), exported here: the same prompts
    and oracle as the default case."""
    from glance_export.onnx import export_artifacts

    case, model, _, _ = default_case(n, max_new, device)
    head = ROOT / "models" / "glance-vl-tiny-eagle3"
    artifacts = work / "eagle3-onnx"
    if not (artifacts / "manifest.json").exists():
        export_artifacts(model, head, artifacts, max_tree=64, max_context=2048, progress=lambda _: None)
    return Case("default-eagle3", case.prompts, case.oracle, seeded=False), model, head, artifacts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="keep the random model, exports and engines here (default: a temp dir)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per model")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=31)
    ap.add_argument("--skip-random", action="store_true", help="only the embedded default model")
    ap.add_argument("--skip-eagle3", action="store_true", help="leave out the default model's EAGLE-3 head")
    ap.add_argument("--skip-batch", action="store_true", help="leave out the batched rows (in-flight batching)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--skip-train", action="store_true", help="skip the head-training check")
    args = ap.parse_args()

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle is fp32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    work = args.out or Path(tempfile.mkdtemp(prefix="gpu_check."))
    gpu = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    print(f"gpu_check: {gpu}; torch {torch.__version__}; work dir {work}", flush=True)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, budget=args.budget)
    skipped: list[str] = []
    rows: list[Row] = []
    makers = [lambda: default_case(args.prompts, args.max_new_tokens, device)]
    if args.skip_eagle3:
        skipped.append("the default model's EAGLE-3 head: --skip-eagle3")
    else:
        makers.append(lambda: eagle3_case(args.prompts, args.max_new_tokens, device, work))
    if args.skip_random:
        skipped.append("the mid-size random model: --skip-random")
    else:
        makers.append(lambda: random_case(work / "random", args.prompts, args.max_new_tokens, device))
    started = time.perf_counter()
    for make in makers:
        case, model, head, artifacts = make()
        print(f"[{time.perf_counter() - started:6.1f}s] {case.name}: {len(case.prompts)} prompts, oracle done",
              flush=True)
        batched = not args.skip_batch and case.name == "default"
        for name, precision, opener in backends(model, head, artifacts, work / case.name, cuda, skipped, batched):
            row = Row(case.name, name, precision)
            try:
                backend, stops = opener()
                if name.endswith(f"-batch{BATCH}"):
                    rows.append(measure_batched(backend, stops, case, cfg, [artifacts, head], row))
                else:
                    auto = auto_config(backend, case.prompts[0], cfg, [artifacts, head])
                    rows.append(measure(backend, stops, case, cfg, auto, row))
            except Exception as exc:  # one backend failing must not hide the others' rows
                row.status = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                traceback.print_exc(file=sys.stderr)
                rows.append(row)
            print(f"[{time.perf_counter() - started:6.1f}s] {case.name} {name} {precision}: {rows[-1].status}",
                  flush=True)
    failures = check_device_sampler(skipped) if cuda else []
    if not cuda:
        skipped.append("the device sampler: no CUDA device")
    if cuda and not args.skip_train:
        failures += check_head_training(work / "train", skipped)
    elif not args.skip_train:
        skipped.append("train-head on CUDA: no CUDA device")
    print()
    print(table(rows))
    print("\nskipped:" if skipped else "\nskipped: nothing")
    for line in dict.fromkeys(skipped):
        print(f"  - {line}")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "speedup": r.speedup} for r in rows], indent=2))
    for line in failures:
        print(f"FAILED {line}")
    return 0 if all(r.status == "ok" for r in rows) and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
