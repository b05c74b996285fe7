"""Build TensorRT engines from an ONNX artifacts directory, with profiles sized from its manifest.

The same code proves in CI, with the TensorRT-RTX builder on a CPU-only machine, that every exported
graph parses and compiles under a real TensorRT compiler, and later builds deployable engines. The
target gets two profiles: prefill (long passes, image rows) and verify (T up to max_tree over any past).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from glance_runtime.errors import GlanceError
from glance_runtime.graphs import MANIFEST

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
    """Let ONNX Attention ops (opset 23) fall back to plain layers where no fused kernel fits (fp32, masks)."""
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.ATTENTION_INPUT:
            layer.__class__ = trt.IAttentionBoundaryLayer
            layer.attention.decomposable = True


def build_engine(onnx_path: Path, inputs: dict[str, dict[str, Any]], profiles: list[Profile], *,
                 workspace_gib: float = 2.0) -> bytes:
    """Parse and build one graph; GlanceError names the graph and the parser/builder failure."""
    import tensorrt_rtx as trt

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise GlanceError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    _allow_attention_fallback(trt, network)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    for profile in profiles:
        opt = builder.create_optimization_profile()
        for name, spec in inputs.items():
            opt.set_shape(name, *_shapes(spec["shape"], profile.axes, name))
        config.add_optimization_profile(opt)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise GlanceError(f"TensorRT could not build an engine for {onnx_path.name}; see the builder log above")
    return bytes(engine)


def build_engines(artifacts_dir: str | Path, engine_dir: str | Path | None = None, *, workspace_gib: float = 2.0,
                  progress: Callable[[str], None] = print) -> dict[str, int]:
    """Build every graph of an artifacts directory; write `<graph>.engine` files when engine_dir is given.

    Returns the serialized engine size per graph."""
    artifacts = Path(artifacts_dir)
    if not (artifacts / MANIFEST).is_file():
        raise GlanceError(f"{artifacts} has no {MANIFEST}; export it with `glance-export onnx` first")
    manifest = json.loads((artifacts / MANIFEST).read_text())
    sizes = {}
    for graph, entry in manifest["graphs"].items():
        t0 = time.perf_counter()
        profiles = profiles_for(manifest, graph)
        engine = build_engine(artifacts / entry["file"], entry["inputs"], profiles, workspace_gib=workspace_gib)
        sizes[graph] = len(engine)
        if engine_dir is not None:
            Path(engine_dir).mkdir(parents=True, exist_ok=True)
            (Path(engine_dir) / f"{graph}.engine").write_bytes(engine)
        progress(f"built {graph} engine ({', '.join(p.name for p in profiles)} profiles, "
                 f"{len(engine) / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s")
    return sizes
