"""Build TensorRT engines from an ONNX artifacts directory, with profiles sized from its manifest.

One code path for `tensorrt` and `tensorrt_rtx`, through Polygraphy's loaders (`network_from_onnx_path`,
`CreateConfig` / `CreateConfigRTX` with profiles, TF32 and the workspace pool, `SetDecomposableAttentions`).
Each graph is built in its own worker process (`python -m glance_export.build.tensorrt_build`), so a build's
peak host memory is that of its largest graph, never the sum, and the memory the builder keeps after a
graph is returned to the system before the next one starts. Within a worker, external weights are handed
to the parser from a read-only map of their file (`mapped_weights`), so the builder's own copy and the
serialized engine are all it holds (see `memory_plan` for the measured peak). A graph the memory plan cut
(`engine_parts`) is built part by part, one worker each, from part protobufs written in the build's scratch
directory; its part engines are chained at run time (`glance_runtime.backends.graph_chain`). In CI the TensorRT-RTX
builder proves on a CPU-only machine that every exported graph parses and compiles under a real TensorRT
compiler.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import glance_runtime
from glance_runtime.store.atomic import write_file
from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import GraphFile, Manifest
from glance_runtime.store.integrity import sha256
from glance_runtime.backends.shape_expr import evaluate, symbols

from .engine_parts import GraphCut
from .mapped_weights import WeightMap, external_initializers
from .precision import Precision
from .toolchain import Toolchain

Range = tuple[int, int, int]  # min, opt, max
ERROR_PREFIX = "glance-build-error: "  # marks the worker's one-line error on its stderr
PHASE_PREFIX = "glance-build-phase: "  # a builder phase the worker started, passed on as a progress line
PEAK_PREFIX = "glance-build-peak-gib: "  # the worker's peak RSS, its last line
SHOWN_PHASE_DEPTH = 3  # builder phases this deep (0: "Building engine") become progress lines


@dataclass(frozen=True)
class ShapeProfile:
    """One TensorRT optimization profile: the min, opt and max of every symbolic axis of a graph."""

    name: str
    axes: dict[str, Range]  # symbolic axis name -> range; every input's shape is resolved from these


def _opt(lo: int, hi: int, want: int) -> int:
    return max(lo, min(hi, want))


def _span(bounds: list[int], want: int) -> Range:
    lo, hi = bounds
    return lo, _opt(lo, hi, want), hi


def shape_profiles(manifest: Manifest, graph: str) -> list[ShapeProfile]:
    """Optimization profiles of one graph from the manifest's axis bounds. The target and GLANCE draft graphs are
    one engine each: a lone sequence's passes (B = 1) and, where the bounds allow more than one sequence, a batched
    round's (`batch`)."""
    axes, max_tree = manifest.axes, manifest.max_tree
    if graph == "target":
        past = _span(axes["S"], axes["S"][1] // 2)
        prefill = {**_lone(axes), "T": _span(axes["T"], 256), "S": past}
        verify = {**_lone(axes), "T": (1, _opt(1, max_tree, 32), max_tree), "S": past}
        batch = {**_batched(axes), "T": (1, _opt(1, max_tree, 16), max_tree), "S": past}
        if "N_img" in axes:  # images enter at prefill only: every later pass sends zero rows
            prefill["N_img"] = _span(axes["N_img"], axes["N_img"][1] // 4)
            verify["N_img"] = batch["N_img"] = (0, 1, 1)
        return _with_batch(axes, [ShapeProfile("prefill", prefill), ShapeProfile("verify", verify)], batch)
    if graph == "draft" and manifest.head_kind == "eagle3":
        return _step_profiles(axes)
    if graph == "draft":
        cached = _span(axes["S_h"], axes["S_h"][1] // 2)
        rows = {"Bk": (axes["Bk"][0], axes["Bk"][1], axes["Bk"][1])} if "Bk" in axes else {}  # short blocks too
        lone = {**_lone(axes), "N": (1, _opt(1, axes["N"][1], max_tree), axes["N"][1]), "S_h": cached, **rows}
        block = min(manifest.block_size, axes["N"][1])  # a round commits at most a block's rows a sequence
        batch = {**_batched(axes), "N": (1, block, block), "S_h": cached, **rows}
        return _with_batch(axes, [ShapeProfile("draft", lone)], batch)
    if graph == "draft_vocab":  # projections only: the runtime embeds through the vocab graph
        return [ShapeProfile("project", {"E": (1, 1, 1), "R": _span(axes["R"], 32)})]
    if graph == "vocab":
        return [ShapeProfile("embed", {"E": _span(axes["E"], 256), "R": (1, 1, 1)}),
                ShapeProfile("project", {"E": (1, 1, 1), "R": _span(axes["R"], 32)})]
    patches = _span(axes["N_patch"], axes["N_patch"][1] // 4)
    unit = manifest.spatial_merge_size ** 2
    return [ShapeProfile("vision", {"N_patch": patches, "N_merged": tuple(p // unit for p in patches)})]


def _pool(axes: dict[str, list[int]], slots: int) -> dict[str, Range]:
    """The KV pool's axes, spanned rather than fixed: P from 1 to max_batch, so a runtime decoding one sequence
    holds a one-slot pool; C_pool from 1 to the build's context, so a runtime's lower --max-context holds a pool of
    that many rows (`kv_pool` sizes it so). Nothing in TensorRT asks for them fixed: the graph only flattens the
    pool and gathers rows from it (at indices from `slots`, its row count and `past_rows`), so no kernel is tuned
    to its size, and a fixed size would only refuse those runtimes. `slots` is the opt: one for a lone pass, the
    pool's every slot for a batched round."""
    batch, rows = axes["P"][1], axes["C_pool"][1]
    return {"P": (1, _opt(1, batch, slots), batch), "C_pool": (1, rows, rows)}


def _lone(axes: dict[str, list[int]]) -> dict[str, Range]:
    """A lone sequence's pass: a batch of one, over a pool of 1 to max_batch slots."""
    return {"B": (1, 1, 1), **_pool(axes, 1)}


def _batched(axes: dict[str, list[int]]) -> dict[str, Range]:
    """A batched round: 1 to max_batch sequences over the whole pool."""
    batch = axes["B"][1]
    return {"B": (1, batch, batch), **_pool(axes, batch)}


def _with_batch(axes: dict[str, list[int]], lone: list[ShapeProfile], batch: dict[str, Range]) -> list[ShapeProfile]:
    """The lone profiles, and the batch profile where more than one sequence may share a pass (max_batch > 1)."""
    return lone + ([ShapeProfile("batch", batch)] if axes["B"][1] > 1 else [])


def _step_profiles(axes: dict[str, list[int]]) -> list[ShapeProfile]:
    """An EAGLE-3 draft graph runs two ways: the root run over the committed rows new to the head's cache
    (N_taps rows through fc, no drafted rows, the last row projected) and a step over one depth's expanded nodes
    (M rows from their parents' outputs, no committed rows, every row projected). Cached rows S_h span the
    committed context and the round's earlier nodes; a run's columns C are S_h + its rows."""
    cached = _span(axes["S_h"], axes["S_h"][1] // 2)
    nodes = axes["M"][1]
    root_rows = _span([1, axes["N_taps"][1]], 8)
    root = {"N_taps": root_rows, "M": (0, 0, 0), "R_h": root_rows, "Q": (1, 1, 1),
            "C": (1, cached[1] + root_rows[1], axes["C"][1]), "S_h": cached}
    step = {"N_taps": (0, 0, 0), "M": (1, nodes, nodes), "R_h": (1, nodes, nodes), "Q": (1, nodes, nodes),
            "C": (1, cached[1] + nodes, axes["C"][1]), "S_h": cached}
    return [ShapeProfile("root", root), ShapeProfile("step", step)]


TIMING_CACHE_MAGIC = b"ptrt"  # what TensorRT's serialized timing caches start with


def is_timing_cache(path: Path) -> bool:
    """An empty file (trtexec starts from one) or one with TensorRT's header: safe to read and replace."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(TIMING_CACHE_MAGIC))
    except OSError:
        return False
    return head in (b"", TIMING_CACHE_MAGIC)


class TimingCache:
    """One timing cache carried through every graph of a build: read from `path` when it exists, written
    back atomically after a successful build (trtexec's --timingCacheFile).

    Between graphs it lives in a scratch file that each worker reads and rewrites."""

    def __init__(self, path: Path):
        self.path = path
        self.data = path.read_bytes() if path.is_file() else b""

    def save(self) -> None:
        write_file(self.path, self.data)


@dataclass(frozen=True)
class BuildOptions:
    precision: Precision
    workspace_gib: float
    timing_cache: TimingCache | None = None


@dataclass(frozen=True)
class GraphJob:
    """What one worker process builds: plain data, sent as JSON on its stdin."""

    module: str  # "tensorrt" or "tensorrt_rtx"
    onnx: str
    external_data: bool  # the graph keeps its weights in a data file beside it
    engine: str  # where the worker writes the serialized engine
    inputs: dict[str, list[list[int]]]  # input name -> [min, opt, max] shapes, one entry per profile
    profiles: int
    strongly_typed: bool
    builder_flag: str | None  # "FP16" / "BF16" on a weakly typed network
    tf32: bool
    workspace_bytes: int
    timing_cache: str | None  # scratch file read before and rewritten after the build
    timing_cache_source: str | None  # the user's --timing-cache, for messages


def _shapes(shape: list[int | str], axes: dict[str, Range], name: str) -> list[list[int]]:
    """An input's min, opt and max shapes: a dim is a size, an axis, or (a part's input) arithmetic on axes,
    evaluated at the axes' min, opt and max (dims grow with the axes they read, as a KV concat's S + T does)."""
    out: list[list[int]] = [[], [], []]
    for dim in shape:
        unbound = symbols(dim) - axes.keys()
        if unbound:
            raise GlanceError(f"input {name} has axis {dim!r} that no profile bounds; re-export the artifacts")
        rng = [evaluate(dim, {axis: r[i] for axis, r in axes.items()}) for i in range(3)]
        if not rng[0] <= rng[1] <= rng[2]:
            raise GlanceError(f"input {name}'s dim {dim!r} is {rng[0]}, {rng[1]}, {rng[2]} at the profile's min, opt "
                              f"and max; pass a larger --max-part-gib to build the graph whole")
        for i in range(3):
            out[i].append(rng[i])
    return out


def graph_job(module: str, onnx_path: Path, engine_path: Path, inputs: dict[str, dict[str, Any]],
              profiles: list[ShapeProfile], options: BuildOptions, timing_cache: Path | None,
              external_data: bool = False) -> GraphJob:
    """A precision reached through a builder flag needs a weakly typed network; otherwise the network is
    strongly typed, so the engine computes in exactly the graph's dtypes."""
    flag = options.precision.builder_flag
    shapes = {name: [_shapes(spec["shape"], p.axes, name) for p in profiles] for name, spec in inputs.items()}
    return GraphJob(module, str(onnx_path), external_data, str(engine_path), shapes, len(profiles),
                    strongly_typed=flag is None,
                    builder_flag=flag, tf32=options.precision.name != "fp32",
                    workspace_bytes=int(options.workspace_gib * (1 << 30)),
                    timing_cache=str(timing_cache) if timing_cache else None,
                    timing_cache_source=str(options.timing_cache.path) if options.timing_cache else None)


def _worker_env(module: str) -> dict[str, str]:
    """The worker imports this tree's packages, wherever the parent found them, and Polygraphy picks its
    TensorRT module from the environment when it is first imported."""
    roots = [str(Path(__file__).resolve().parents[2]), str(Path(glance_runtime.__file__).resolve().parents[1])]
    inherited = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(roots + ([inherited] if inherited else [])),
            "POLYGRAPHY_USE_TENSORRT_RTX": "1" if module == "tensorrt_rtx" else "0"}


def run_job(job: GraphJob, progress: Callable[[str], None] = lambda _: None) -> float:
    """Build one graph in a worker process; its peak RSS in GiB. The builder's phases go to `progress` as
    they start; the worker's one-line error is re-raised."""
    child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=_worker_env(job.module))
    child.stdin.write(json.dumps(asdict(job)))
    child.stdin.close()
    lines, peak = [], 0.0
    for line in child.stdout:
        if line.startswith(PHASE_PREFIX):
            progress(line.removeprefix(PHASE_PREFIX).rstrip())
        elif line.startswith(PEAK_PREFIX):
            peak = float(line.removeprefix(PEAK_PREFIX))
        elif line.strip():
            lines.append(line.strip())
    child.wait()
    if child.returncode != 0:
        error = next((line.removeprefix(ERROR_PREFIX) for line in lines if line.startswith(ERROR_PREFIX)), None)
        logged = [line.removeprefix("[E] ").strip() for line in lines if line.startswith("[E] ")]
        if error and logged:  # what the parser or builder said, before Polygraphy's summary
            error = f"{error} ({logged[0]})"
        if error is None and child.returncode == -9:
            error = (f"the TensorRT builder for {Path(job.onnx).name} was killed (SIGKILL: out of memory?); build on "
                     f"a machine with more memory, or write a bundle for one with --plan-only")
        raise GlanceError(error or f"the TensorRT builder for {Path(job.onnx).name} exited with code "
                                   f"{child.returncode}: {lines[-1] if lines else 'no output'}")
    return peak


def _file_record(path: Path) -> dict[str, Any]:
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)}


def _build_parts(toolchain: Toolchain, graph: str, entry: GraphFile, cut: GraphCut, profiles: list[ShapeProfile],
                 engine_dir: Path, scratch: Path, options: BuildOptions, cache: Path | None,
                 progress: Callable[[str], None]) -> dict[str, Any]:
    """One worker per part, in run order; the part protobufs live in `scratch` only while the build runs."""
    parts = cut.write(scratch, graph)
    records = []
    for number, part in enumerate(parts, start=1):
        t0 = time.perf_counter()
        path = engine_dir / f"{graph}.part{number}.engine"
        progress(f"building {graph} part {number} of {len(parts)} ({part.weight_bytes / (1 << 30):.2f} GiB of weights, "
                 f"{len(part.inputs)} inputs, {len(part.outputs)} outputs) in a worker process")
        peak = run_job(graph_job(toolchain.name, part.onnx, path, part.inputs, profiles, options, cache,
                                 external_data=bool(entry.data_file)),
                       lambda phase: progress(f"  {graph} part {number}: {phase}"))
        records.append({**_file_record(path), "inputs": list(part.inputs), "outputs": part.outputs,
                        "weight_bytes": part.weight_bytes, "build_s": round(time.perf_counter() - t0, 2),
                        "peak_rss_gib": round(peak, 3)})
        part.onnx.unlink()
        progress(f"built {graph} part {number} engine ({path.stat().st_size / 1e6:.1f} MB) in "
                 f"{time.perf_counter() - t0:.1f}s, worker peak RSS {peak:.2f} GiB")
    return {"parts": records, "peak_rss_gib": max(r["peak_rss_gib"] for r in records)}


def build_engines(toolchain: Toolchain, artifacts: Path, manifest: Manifest, engine_dir: Path,
                  options: BuildOptions, progress: Callable[[str], None] = print,
                  cuts: dict[str, GraphCut] | None = None) -> dict[str, dict[str, Any]]:
    """Build every graph the manifest lists into `engine_dir/<graph>.engine`, one worker process each, or,
    for a graph in `cuts`, into `<graph>.partN.engine`, one worker per part.

    `manifest` is the artifacts manifest, its axes possibly lowered (`memory_plan.Limits.apply`).
    Returns, per graph, what engines.json records: the engine (or each part's, with the tensors it reads and
    writes) and ONNX files (sizes, sha256), the build time, the worker's peak RSS and every profile's
    min/opt/max per axis."""
    records = {}
    with tempfile.TemporaryDirectory(prefix=".glance-build-") as scratch:
        cache = Path(scratch) / "timing.cache" if options.timing_cache is not None else None
        if cache is not None:
            cache.write_bytes(options.timing_cache.data)
        for graph, entry in manifest.graphs.items():
            t0 = time.perf_counter()
            profiles = shape_profiles(manifest, graph)
            names = ", ".join(p.name for p in profiles)
            if graph in (cuts or {}):
                built = _build_parts(toolchain, graph, entry, cuts[graph], profiles, engine_dir, Path(scratch),
                                     options, cache, progress)
            else:
                path = engine_dir / f"{graph}.engine"
                progress(f"building {graph} ({names} profiles) in a worker process")
                peak = run_job(graph_job(toolchain.name, artifacts / entry.file, path, entry.inputs, profiles,
                                         options, cache, external_data=bool(entry.data_file)),
                               lambda phase, graph=graph: progress(f"  {graph}: {phase}"))
                built = {**_file_record(path), "peak_rss_gib": round(peak, 3)}
                progress(f"built {graph} engine ({path.stat().st_size / 1e6:.1f} MB) in "
                         f"{time.perf_counter() - t0:.1f}s, worker peak RSS {peak:.2f} GiB")
            onnx = [_file_record(artifacts / name) for name in (entry.file, entry.data_file) if name]
            records[graph] = {**built, "onnx": onnx, "build_s": round(time.perf_counter() - t0, 2),
                              "profiles": {p.name: {axis: list(rng) for axis, rng in p.axes.items()} for p in profiles}}
        if cache is not None:
            options.timing_cache.data = cache.read_bytes()
    return records


def _network(trt, job: GraphJob) -> tuple[Any, WeightMap | None]:
    """Polygraphy's ONNX network loader, and the map its external weights are referenced from.

    `parse_from_file` reads external weights into buffers of the parser's own; a parser that takes
    initializers (TensorRT 10.13+, TensorRT-RTX) is handed each one from a read-only map of the data file
    instead (`load_model_proto`, `load_initializer`, `parse_model_proto`), so the only resident weights are
    the pages the builder is reading. Inline weights are part of the protobuf the parser must hold anyway."""
    from polygraphy.backend.trt import network_from_onnx_path
    from polygraphy.backend.trt import util as trt_util
    from polygraphy.backend.trt.loader import BaseNetworkFromOnnx

    if not job.external_data or not hasattr(trt.OnnxParser, "load_initializer"):
        return network_from_onnx_path(job.onnx, strongly_typed=job.strongly_typed), None
    model = Path(job.onnx).read_bytes()
    tensors = external_initializers(model)
    weights = WeightMap(Path(job.onnx), tensors)

    class NetworkFromMappedOnnx(BaseNetworkFromOnnx):
        def call_impl(self):
            builder, network, parser = super().call_impl()
            ok = (parser.load_model_proto(model, job.onnx)
                  and all(parser.load_initializer(t.name, weights.address(t), t.length) for t in tensors)
                  and parser.parse_model_proto())
            trt_util.check_onnx_parser_errors(parser, ok)
            return builder, network, parser

    return NetworkFromMappedOnnx(strongly_typed=job.strongly_typed), weights


def _build_in_this_process(job: GraphJob) -> None:
    """The worker's build, through Polygraphy's loaders for the TensorRT module the job names."""
    from polygraphy.backend.trt import (CreateConfig, PostprocessConfig, Profile as TrtProfile,
                                        SetDecomposableAttentions)
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    trt = __import__(job.module)
    profiles = []
    for i in range(job.profiles):
        profile = TrtProfile()
        for name, per_profile in job.inputs.items():
            profile.add(name, *per_profile[i])
        profiles.append(profile)
    network, weights = _network(trt, job)
    monitor = _monitor(trt, weights) if hasattr(trt, "IProgressMonitor") else None
    common = dict(profiles=profiles, memory_pool_limits={trt.MemoryPoolType.WORKSPACE: job.workspace_bytes},
                  progress_monitor=monitor)
    if job.module == "tensorrt_rtx":
        from polygraphy.backend.tensorrt_rtx import CreateConfigRTX

        config = CreateConfigRTX(**common)
    else:
        flags = {job.builder_flag.lower(): True} if job.builder_flag else {}
        config = CreateConfig(tf32=job.tf32, **flags, **common)
    # Polygraphy's CreateConfigRTX leaves TF32 alone and ignores set_timing_cache's result: both done here.
    config = PostprocessConfig(config, lambda builder, network, cfg: _finish_config(trt, job, cfg))
    if hasattr(trt.LayerType, "ATTENTION_INPUT"):  # TensorRT before 10.14 has no attention layers
        network = SetDecomposableAttentions(network)
    try:
        _write_engine(trt, job, network, config, weights)
    finally:
        if weights is not None:
            weights.close()


def _finish_config(trt, job: GraphJob, config) -> None:
    if not job.tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    if job.timing_cache is not None:
        data = Path(job.timing_cache).read_bytes()
        if not config.set_timing_cache(config.create_timing_cache(data), False):
            raise GlanceError(f"{job.timing_cache_source} was written by another TensorRT version or GPU; delete "
                              f"it or pass another --timing-cache")


def _monitor(trt, weights: WeightMap | None):
    """The builder's progress monitor: each phase down to `SHOWN_PHASE_DEPTH` is a line for the parent, with
    the worker's resident memory as it starts; and at the end of each phase the weight pages the builder
    read go back to the kernel, so they are gone before the engine is serialized (the peak, which reads the
    builder's own copy, not the map). Between phase ends `WeightMap.returning_pages` keeps returning them."""
    class BuildMonitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.depth: dict[str, int] = {}

        def phase_start(self, phase_name, parent_phase, num_steps) -> None:
            depth = self.depth[phase_name] = self.depth.get(parent_phase, -1) + 1 if parent_phase else 0
            if depth <= SHOWN_PHASE_DEPTH:
                _phase_line(phase_name, depth)

        def step_complete(self, phase_name, step) -> bool:
            return True  # never cancel

        def phase_finish(self, phase_name) -> None:
            if weights is not None:
                weights.return_pages()

    return BuildMonitor()


def _phase_line(name: str, depth: int) -> None:
    print(f"{PHASE_PREFIX}{'  ' * depth}{name} (resident {_status_gib('VmRSS'):.2f} GiB)", file=sys.stderr, flush=True)


def _stream_writer(trt, fh):
    class FileWriter(trt.IStreamWriter):
        def __init__(self):
            trt.IStreamWriter.__init__(self)
            self.started = False

        def write(self, data) -> int:
            if not self.started:
                self.started = True
                _phase_line("Writing the serialized engine", 0)
            return fh.write(data)

    return FileWriter()


def _write_engine(trt, job: GraphJob, network_loader, config_loader, weights: WeightMap | None) -> None:
    """Streams the serialized engine to its file (TensorRT's IStreamWriter) instead of Polygraphy's
    `engine_bytes_from_network`, which returns it as one more host buffer (measured: 0.3x the weights more
    at the peak). TensorRT-RTX still serializes the whole engine in memory before its first write."""
    builder, network, parser = network_loader()  # the parser (or `weights`) holds what the network points at
    config = config_loader(builder, network)
    engine = Path(job.engine)
    with open(engine, "wb") as fh, (weights.returning_pages() if weights is not None else nullcontext()):
        built = builder.build_serialized_network_to_stream(network, config, _stream_writer(trt, fh))
    if not built:
        engine.unlink()
        raise GlanceError("TensorRT's builder returned no engine")
    if job.timing_cache is not None:
        write_file(Path(job.timing_cache), bytes(config.get_timing_cache().serialize()))


def _status_gib(key: str) -> float:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: the peak) in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def _worker() -> int:
    from polygraphy.exception import PolygraphyException

    job = GraphJob(**json.loads(sys.stdin.read()))
    try:
        _build_in_this_process(job)
    except (GlanceError, PolygraphyException) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{ERROR_PREFIX}TensorRT cannot build {Path(job.onnx).name}: {detail}", file=sys.stderr)
        return 2
    print(f"{PEAK_PREFIX}{_status_gib('VmHWM'):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
