"""Build TensorRT engines from an ONNX artifacts directory, with profiles sized from its manifest.

One code path over the API that `tensorrt` and `tensorrt_rtx` share. In CI the TensorRT-RTX builder
proves on a CPU-only machine that every exported graph parses and compiles under a real TensorRT
compiler; `glance-export build` uses the same functions to build deployable engines. Each graph's
optimization profiles come from `profiles_for`, from the manifest's (possibly lowered) axis bounds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from glance_runtime.atomic import write_file
from glance_runtime.errors import GlanceError
from glance_runtime.integrity import sha256

from .precision import Precision
from .toolchain import Toolchain

Range = tuple[int, int, int]  # min, opt, max


@dataclass(frozen=True)
class Profile:
    name: str
    axes: dict[str, Range]  # symbolic axis name -> range; every input's shape is resolved from these


def _opt(lo: int, hi: int, want: int) -> int:
    return max(lo, min(hi, want))


def _span(bounds: list[int], want: int) -> Range:
    lo, hi = bounds
    return lo, _opt(lo, hi, want), hi


def profiles_for(manifest: dict[str, Any], graph: str) -> list[Profile]:
    """Optimization profiles of one graph from the manifest's axis bounds."""
    axes = manifest["axes"]
    max_tree = manifest["limits"]["max_tree"]
    if graph == "target":
        past = _span(axes["S"], axes["S"][1] // 2)
        prefill = {"T": _span(axes["T"], 256), "S": past}
        verify = {"T": (1, _opt(1, max_tree, 32), max_tree), "S": past}
        if "N_img" in axes:
            prefill["N_img"] = _span(axes["N_img"], axes["N_img"][1] // 4)
            verify["N_img"] = (0, 1, 1)
        return [Profile("prefill", prefill), Profile("verify", verify)]
    if graph == "draft":
        return [Profile("draft", {"N": (1, _opt(1, axes["N"][1], max_tree), axes["N"][1]),
                                  "S_h": _span(axes["S_h"], axes["S_h"][1] // 2)})]
    if graph == "vocab":
        return [Profile("embed", {"E": _span(axes["E"], 256), "R": (1, 1, 1)}),
                Profile("project", {"E": (1, 1, 1), "R": _span(axes["R"], 32)})]
    patches = _span(axes["N_patch"], axes["N_patch"][1] // 4)
    unit = manifest["graphs"]["vision"]["index_params"]["merge_size"] ** 2
    return [Profile("vision", {"N_patch": patches, "N_merged": tuple(p // unit for p in patches)})]


def _shapes(shape: list[int | str], axes: dict[str, Range], name: str) -> tuple[list[int], list[int], list[int]]:
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    for dim in shape:
        if isinstance(dim, str) and dim not in axes:
            raise GlanceError(f"input {name} has axis {dim!r} that no profile bounds; re-export the artifacts")
        rng = axes[dim] if isinstance(dim, str) else (dim, dim, dim)
        for i in range(3):
            out[i].append(rng[i])
    return out


def _allow_attention_fallback(trt, network) -> None:
    """Let ONNX Attention ops (opset 23) fall back to plain layers where no fused kernel fits (fp32, masks).

    TensorRT before 10.14 has no attention layers (and its parser refuses opset 23 before this runs)."""
    if not hasattr(trt.LayerType, "ATTENTION_INPUT"):
        return
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.ATTENTION_INPUT:
            layer.__class__ = trt.IAttentionBoundaryLayer
            layer.attention.decomposable = True


class TimingCache:
    """One timing cache carried through every graph of a build: read from `path` when it exists, written
    back atomically after a successful build (trtexec's --timingCacheFile).

    It travels as serialized bytes, because a cache object does not outlive the builder config it came from."""

    def __init__(self, path: Path):
        self.path = path
        self.data = path.read_bytes() if path.is_file() else b""

    def attach(self, config) -> None:
        if not config.set_timing_cache(config.create_timing_cache(self.data), False):
            raise GlanceError(f"{self.path} was written by another TensorRT version or GPU; delete it or pass "
                              f"another --timing-cache")

    def collect(self, config) -> None:
        """Keep what this graph's build added (call while `config` is alive)."""
        self.data = bytes(config.get_timing_cache().serialize())

    def save(self) -> None:
        write_file(self.path, self.data)


@dataclass(frozen=True)
class BuildOptions:
    precision: Precision
    workspace_gib: float
    timing_cache: TimingCache | None = None


def build_engine(toolchain: Toolchain, onnx_path: Path, inputs: dict[str, dict[str, Any]], profiles: list[Profile],
                 options: BuildOptions) -> memoryview:
    """Parse and build one graph (the serialized engine, not copied: it can be GBs); GlanceError names the
    graph and the parser/builder failure.

    A precision reached through a builder flag needs a weakly typed network; otherwise the network is
    strongly typed, so the engine computes in exactly the graph's dtypes."""
    trt = toolchain.module
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    flag = options.precision.builder_flag
    network = builder.create_network(0 if flag else 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise GlanceError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    _allow_attention_fallback(trt, network)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * (1 << 30)))
    if flag:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if options.precision.name == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)
    if options.timing_cache is not None:
        options.timing_cache.attach(config)
    for profile in profiles:
        opt = builder.create_optimization_profile()
        for name, spec in inputs.items():
            opt.set_shape(name, *_shapes(spec["shape"], profile.axes, name))
        config.add_optimization_profile(opt)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise GlanceError(f"TensorRT could not build an engine for {onnx_path.name}; see the builder log above")
    if options.timing_cache is not None:
        options.timing_cache.collect(config)
    return memoryview(engine)


def _file_record(path: Path) -> dict[str, Any]:
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)}


def build_engines(toolchain: Toolchain, artifacts: Path, manifest: dict[str, Any], engine_dir: Path,
                  options: BuildOptions, progress: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Build every graph the manifest lists into `engine_dir/<graph>.engine`.

    `manifest` is the artifacts manifest, its axes possibly lowered (`memory_plan.Limits.apply`).
    Returns, per graph, what engines.json records: the engine and ONNX files (sizes, sha256), the build
    time and every profile's min/opt/max per axis."""
    records = {}
    for graph, entry in manifest["graphs"].items():
        t0 = time.perf_counter()
        profiles = profiles_for(manifest, graph)
        engine = build_engine(toolchain, artifacts / entry["file"], entry["inputs"], profiles, options)
        path = engine_dir / f"{graph}.engine"
        path.write_bytes(engine)
        onnx = [_file_record(artifacts / name) for name in (entry["file"], entry.get("data_file")) if name]
        records[graph] = {**_file_record(path), "onnx": onnx, "build_s": round(time.perf_counter() - t0, 2),
                          "profiles": {p.name: {axis: list(rng) for axis, rng in p.axes.items()} for p in profiles}}
        progress(f"built {graph} engine ({', '.join(p.name for p in profiles)} profiles, "
                 f"{engine.nbytes / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s")
    return records
