"""`glance-export build`: artifacts -> checked against the target -> sized to its memory -> engines + engines.json.

Every refusal (wrong GPU, TensorRT version, precision, memory, mismatched artifacts) happens before the
first engine is built, and the engines directory appears whole or not at all. With `--artifacts` this
path imports neither torch nor onnx: a Jetson builds from an export made on a workstation.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from glance_runtime.store.atomic import atomic_directory, check_output, check_output_file, output_format
from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import MANIFEST
from glance_runtime.formats import engines as engines_format
from glance_runtime.formats.artifacts import Manifest, check_source, read as load_manifest
from glance_runtime.store.integrity import sha256

from glance_runtime._version import __version__
from .targets import DeviceProfile, load_profile
from .local_gpu import BuildGpu, check_device, resolve_target
from .memory_plan import MemoryPlan, available_host_gib, check_build_host, check_device_builds, plan_memory
from .plan_bundle import BUNDLE_FORMAT, write_bundle
from .precision import Precision, choose_precision
from .quant_engines import engine_manifest
from .tensorrt_build import BuildOptions, TimingCache, build_engines, is_timing_cache
from .toolchain import Toolchain, check_opset, check_version, load_toolchain

ENGINES_FORMAT = "glance-engines"
HEAD_WEIGHTS = "model.safetensors"  # glance_export.model.head.WEIGHTS_FILE, not imported here: that module needs torch
CACHE_DTYPE = "fp32"  # what `exported_artifacts` exports (the --model/--head path)


@dataclass(frozen=True)
class BuildRequest:
    target: str
    out: Path
    model: Path | None = None
    head: Path | None = None
    artifacts: Path | None = None
    precision: str | None = None
    max_context: int | None = None
    max_tree: int | None = None
    max_batch: int | None = None
    memory_gib: float | None = None
    workspace_gib: float | None = None
    max_part_gib: float | None = None
    timing_cache: Path | None = None
    plan_only: bool = False

    def device_flags(self) -> list[str]:
        """The flags a plan-only bundle's build.sh passes on, as the user gave them."""
        flags = []
        for flag, value in (("--precision", self.precision), ("--max-context", self.max_context),
                            ("--max-tree", self.max_tree), ("--max-batch", self.max_batch),
                            ("--memory-gib", self.memory_gib), ("--workspace-gib", self.workspace_gib),
                            ("--max-part-gib", self.max_part_gib)):
            if value is not None:
                flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return flags


class Stopwatch:
    """Progress lines prefixed with the seconds since the build started."""

    def __init__(self, progress: Callable[[str], None]):
        self.progress, self.t0 = progress, time.perf_counter()

    def __call__(self, line: str) -> None:
        self.progress(f"[{time.perf_counter() - self.t0:6.1f}s] {line}")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def check_head(manifest: Manifest, head: Path, artifacts: Path) -> None:
    """Refuse artifacts exported with another draft head (the manifest records its weights' sha256)."""
    expected = manifest.head_weights_sha256
    if expected and (not (head / HEAD_WEIGHTS).is_file() or sha256(head / HEAD_WEIGHTS) != expected):
        raise GlanceError(f"{head}/{HEAD_WEIGHTS} differs from the head {artifacts} was exported with; pass the "
                          f"original head directory, or re-export with `glance-export onnx --model M --head {head}`")


def _artifacts(request: BuildRequest, say: Callable[[str], None]) -> Path:
    """The artifacts directory: given, or exported once into the cache; checked against --model/--head."""
    if request.artifacts is None and (request.model is None or request.head is None):
        raise GlanceError("build needs --artifacts DIR (from `glance-export onnx`), or --model and --head to export "
                          "them")
    if (request.model is None) != (request.head is None):
        raise GlanceError("pass --model and --head together (the artifacts are checked against both)")
    if request.artifacts is not None:
        artifacts = request.artifacts
    else:
        from glance_runtime.backends.registry import exported_artifacts

        artifacts = exported_artifacts(request.model, request.head, say)
    if request.model is not None:
        say(f"checking {artifacts} against {request.model} and {request.head} (sha256)")
        manifest = load_manifest(artifacts)
        check_source(manifest, request.model)
        check_head(manifest, request.head, artifacts)
    return artifacts


def check_out(request: BuildRequest) -> None:
    """--out is replaced whole: refused, before any work, where it is an input, holds one or lies inside one
    (a bundle nested in its export), or is a directory this command did not write. The one nesting allowed
    is engines built inside the bundle they come from, which is what a bundle's build.sh does."""
    fmt = BUNDLE_FORMAT if request.plan_only else ENGINES_FORMAT
    out, artifacts = Path(request.out), request.artifacts
    inputs = [request.model, request.head, request.timing_cache]
    own_bundle = (artifacts is not None and not request.plan_only and output_format(Path(artifacts)) == BUNDLE_FORMAT
                  and Path(os.path.realpath(out)).is_relative_to(os.path.realpath(artifacts))
                  and os.path.realpath(out) != os.path.realpath(artifacts))
    check_output(out, fmt, inputs if own_bundle else [*inputs, artifacts])
    if request.timing_cache is not None:
        check_output_file(request.timing_cache, "TensorRT timing cache", [request.model, request.head, artifacts],
                          recognise=is_timing_cache)


def _identity(artifacts: Path, manifest: Manifest) -> dict[str, Any]:
    return {"path": str(artifacts.resolve()), "manifest_sha256": sha256(artifacts / MANIFEST),
            "toolkit_version": manifest.toolkit_version, "family": manifest.family, "dtype": manifest.dtype,
            "opset": manifest.opset, "limits": {"max_tree": manifest.max_tree, "max_context": manifest.max_context,
                                                "max_batch": manifest.max_batch},
            "source": manifest.source, "head_weights_sha256": manifest.head_weights_sha256}


def _device_record(profile: DeviceProfile, device: BuildGpu) -> dict[str, Any]:
    if device.name is None:
        return {"name": "ahead-of-time, no GPU", "compute_capability": None,
                "runs_on_compute_capabilities": list(profile.compute_capabilities)}
    return {"name": device.name, "compute_capability": device.compute_capability, "memory_gib": device.memory_gib}


def _precision(request: BuildRequest, profile: DeviceProfile, device: BuildGpu) -> Precision:
    """Checked before any export or TensorRT import, so a precision the target cannot run fails first."""
    dtype = load_manifest(request.artifacts).dtype if request.artifacts else CACHE_DTYPE
    return choose_precision(profile, request.precision, dtype, device)


def _timing_cache(request: BuildRequest, profile: DeviceProfile, toolchain: Toolchain,
                  say: Callable[[str], None]) -> tuple[TimingCache | None, dict[str, Any]]:
    """The cache to build with (None where the builder keeps none), and what engines.json says about it."""
    path = request.timing_cache
    if path is None or profile.timing_cache:
        return (TimingCache(path) if path else None), {"path": str(path) if path else None, "used": path is not None}
    note = f"{toolchain.name} ignores timing caches; {path} not used"
    say(note)
    return None, {"path": str(path), "used": False, "note": note}


@dataclass(frozen=True)
class Target:
    """Stage 1, the target resolved: its profile, the GPU here, the precision to build at, and the builder
    (None for a bundle planned here and built on the device)."""
    profile: DeviceProfile
    device: BuildGpu
    precision: Precision
    toolchain: Toolchain | None


@dataclass(frozen=True)
class Planned:
    """Stage 2, the plan: the checked artifacts, the manifest the engines are built from, and the memory plan
    (the limits the engines are sized for, and the graphs it cuts into parts)."""
    artifacts: Path
    manifest: Manifest
    memory: MemoryPlan


@dataclass(frozen=True)
class Built:
    """Stage 3: what engines.json records of each graph's engines, and the timing cache they were built with."""
    engines: dict[str, dict[str, Any]]
    timing_cache: TimingCache | None
    cache_record: dict[str, Any]


def resolve(request: BuildRequest, device: BuildGpu, toolchain: Toolchain | None, profile: DeviceProfile | None,
            say: Callable[[str], None]) -> Target:
    """The target's profile, the GPU, precision and builder checked against it, before any export or build."""
    profile = profile or load_profile(resolve_target(request.target, device))
    check_out(request)
    if request.plan_only:
        no_gpu = BuildGpu(None)
        return Target(profile, no_gpu, _precision(request, profile, no_gpu), None)
    check_device(profile, device)
    precision = _precision(request, profile, device)
    toolchain = toolchain or load_toolchain(profile)
    check_version(profile, toolchain)
    say(f"target {profile.name}: {device.describe() if device.name else 'ahead-of-time build, no GPU'}; "
        f"{toolchain.name} {toolchain.version}")
    return Target(profile, device, precision, toolchain)


def plan(request: BuildRequest, target: Target, say: Callable[[str], None]) -> Planned:
    """The checked artifacts, their manifest, and the memory plan (printed) that sizes and cuts the engines."""
    artifacts = _artifacts(request, say)
    manifest = engine_manifest(target.profile, load_manifest(artifacts))
    version = target.toolchain.version if target.toolchain is not None else None
    check_opset(target.profile, manifest.opset, version)
    memory = plan_memory(target.profile, manifest, artifacts, target.precision.name, target.device,
                         max_context=request.max_context, max_tree=request.max_tree, memory_gib=request.memory_gib,
                         workspace_gib=request.workspace_gib, tensorrt_version=version,
                         max_part_gib=request.max_part_gib, max_batch=request.max_batch)
    say(memory.explain())
    if memory.batch_note:
        say(memory.batch_note)
    return Planned(artifacts, manifest, memory)


def build_planned(request: BuildRequest, target: Target, planned: Planned, out: Path,
                  say: Callable[[str], None]) -> Built:
    """Every graph's engines (a cut graph's parts) into `out`, one worker each."""
    timing_cache, cache_record = _timing_cache(request, target.profile, target.toolchain, say)
    precision, memory = target.precision, planned.memory
    sized = memory.limits.apply(planned.manifest)
    say(f"building {', '.join(sized.graphs)} at {precision.name} ({precision.how})")
    engines = build_engines(target.toolchain, planned.artifacts, sized, out,
                            BuildOptions(precision, memory.workspace_gib, timing_cache), say, cuts=memory.cuts)
    return Built(engines, timing_cache, cache_record)


def record(target: Target, planned: Planned, built: Built, build_s: float) -> dict[str, Any]:
    """What engines.json says: the builder, device, precision, limits and plan, and every engine."""
    limits, toolchain = planned.memory.limits, target.toolchain
    return {
        "toolkit_version": __version__, "target": target.profile.name,
        "tensorrt": {"module": toolchain.name, "version": toolchain.version},
        "device": _device_record(target.profile, target.device),
        "precision": {"name": target.precision.name, "artifacts_dtype": planned.manifest.dtype,
                      "how": target.precision.how},
        "limits": {"max_context": limits.max_context, "max_tree": limits.max_tree,
                   "max_image_tokens": limits.max_image_tokens, "max_batch": limits.max_batch},
        "memory_plan": planned.memory.record(), "timing_cache": built.cache_record,
        "artifacts": _identity(planned.artifacts, planned.manifest), "engines": built.engines,
        "build_s": round(build_s, 2), "target_profile": target.profile.as_shipped()}


def build(request: BuildRequest, device: BuildGpu, toolchain: Toolchain | None = None, *,
          profile: DeviceProfile | None = None, host_memory_gib: float | None = None,
          progress: Callable[[str], None] = print) -> Path:
    """Build (or with plan_only, bundle) for `request.target`; returns the output directory. The stages run
    in order, each taking what the one before produced: resolve the target, plan memory and parts, build,
    record.

    `device` and `toolchain` are this machine's (`probe_device()`, `load_toolchain(profile)` when None);
    `profile` overrides the target's file (tests); `host_memory_gib` is the memory this machine can give
    the builder (`available_host_gib()` when None)."""
    say = Stopwatch(progress)
    target = resolve(request, device, toolchain, profile, say)
    planned = plan(request, target, say)
    if request.plan_only:
        return _bundle(request, target, planned, say)
    check_build_host(planned.memory.build, available_host_gib() if host_memory_gib is None else host_memory_gib)
    with atomic_directory(request.out, ENGINES_FORMAT, "glance-export build") as tmp:
        built = build_planned(request, target, planned, tmp, say)
        engines_format.write(tmp, record(target, planned, built, say.elapsed))
    if built.timing_cache is not None:
        built.timing_cache.save()
    files = sum(len(entry.get("parts") or [entry]) for entry in built.engines.values())
    say(f"wrote {files} engines for {len(built.engines)} graphs and {engines_format.FILE} to {request.out}")
    _measure_costs(request.out, device, planned.manifest.branch_k, say)
    return request.out


def _measure_costs(out: Path, device: BuildGpu, branch_k: int, say: Callable[[str], None]) -> None:
    """Where the engines can run (a device building its own), time their rounds now for `--budget auto`;
    elsewhere the device measures them on first use."""
    if not device.name:
        say("cost profile for --budget auto: measured on the device on first use (no GPU here)")
        return
    from glance_runtime.decode.auto_budget import auto_budget
    from glance_runtime.backends.registry import Source, open_session

    try:
        _, path, _ = auto_budget(open_session(Source("tensorrt", engines=out)), branch_k, remeasure=True, progress=say)
    except GlanceError as exc:
        say(f"cost profile for --budget auto not measured here ({exc}); the device measures it on first use")
        return
    say(f"cost profile for --budget auto stored in {path}")


def _bundle(request: BuildRequest, target: Target, planned: Planned, say: Callable[[str], None]) -> Path:
    """What can be checked without the device checked, the bundle it builds from written."""
    check_device_builds(target.profile, planned.memory)
    out = write_bundle(request.out, planned.artifacts, target.profile, request.device_flags(), planned.memory,
                       target.precision)
    say(f"wrote a build bundle for {target.profile.name} to {out}: copy it to the device and run ./build.sh there")
    return out
