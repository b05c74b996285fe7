"""Size a build to the target's memory: weights (once: one engine per graph) + the KV pool (max context rows for
each of max batch sequences) + builder workspace must fit; and check, before any work, that the machine running
the build can hold the builder itself.

On a Jetson the GPU shares the module's memory with the OS and the runtime process, so the context,
tree, image and batch limits an engine is built for are derived from that budget (never above the export's,
whose axis bounds the ONNX graphs were traced for), and the build says which limit bound each one.

The builder's host memory is bounded by one graph, not the model: each graph is built in its own
worker process (`tensorrt_build`), whose peak is the process itself (`BUILD_PROCESS_GIB`), plus the
workspace where the GPU shares the host's memory (a Jetson), plus a factor times that graph's ONNX weights.
Measured with TensorRT-RTX 1.7 on an fp16 target with two profiles (0.9 GiB of weights, per builder phase):
the builder's own copy of the weights, made while it determines the engines to build for the first profile
(0.9x), a transient second one for the second profile (0.6x), and the serialized engine, held whole in
memory before the first write (1.0x), which coexists with the builder's copy at the peak. Those are the
builder's; what the build decides is where the parser's weights live. Where the parser reads them itself
(inline weights, or a parser older than TensorRT 10.13) it holds them too: `BUILD_WEIGHT_FACTOR`. Where
external weights are referenced from a map of their file (`mapped_weights`), resident only while the
builder reads them: `BUILD_MAPPED_WEIGHT_FACTOR`.

Those factors are about twice a graph's weights, so a graph over a part budget is built as a chain of parts
(`engine_parts`), one worker each, and the peak is the largest part's. The default budget is `PART_GIB`
(2 GiB) of weights, the graph shared evenly over as few parts as that allows: a part then holds at most half
its graph, so its worker's estimate is at most 2.3 x 0.5 = 1.15x the graph + 1 GiB with mapped weights (1.6x
parsed, TensorRT 10.3), and never more than 2.3 x 2 + 1 = 5.6 GiB (7.4 parsed) + the workspace on a Jetson,
whatever the model's size. Smaller parts would lower that further but add engines and boundaries to every
pass. It is a fixed size, not this machine's free memory, so the same export and flags give the same engines
wherever they are built. On a Jetson, which builds in the memory it runs in, the budget is lowered to the
part whose worker fits beside the workspace; `--max-part-gib` sets it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import GraphFile, Manifest
from glance_runtime.backends.hardware import available_host_bytes

from .targets import DeviceProfile, version_tuple
from .local_gpu import BuildGpu
from .engine_parts import PART_GIB, GraphCut, cut_budget

GIB = float(1 << 30)
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
IO_BYTES = {"float32": 4, "float16": 2}
CONTEXT_STEP = 256  # a budget-derived max context is rounded down to a multiple of this
BUILD_WEIGHT_FACTOR = 3.2  # a worker's host bytes per byte of weights the parser holds: 2.3-3.1 measured
BUILD_MAPPED_WEIGHT_FACTOR = 2.3  # ... per byte of weights referenced from a map of their file: 2.1-2.2 measured
BUILD_PROCESS_GIB = 1.0  # Python, TensorRT's libraries, the builder's fixed working memory (0.15-0.5 measured)
MAPPED_WEIGHTS_FROM = {"tensorrt": "10.13", "tensorrt_rtx": "1.0"}  # parsers with load_initializer


@dataclass(frozen=True)
class Limits:
    max_context: int
    max_tree: int
    max_image_tokens: int | None  # None: a text-only model
    max_batch: int = 1  # sequences a target or draft pass serves; 1: no batch profile

    def apply(self, manifest: Manifest) -> Manifest:
        """The artifacts manifest with its axis bounds lowered to these limits (never raised): the batch axis and
        the KV pool's slots to max_batch, its rows to the context."""
        axes, ctx = dict(manifest.axes), self.max_context
        # S_h and C run past the context by what a head caches beyond it (an EAGLE-3 round's node rows)
        beyond = {axis: axes[axis][1] - manifest.max_context for axis in ("S_h", "C") if axis in axes}
        lowered = {"T": ctx, "S": ctx - 1, "N": ctx, "E": ctx, "T_verify": self.max_tree, "N_taps": ctx, "R_h": ctx,
                   **{axis: ctx + extra for axis, extra in beyond.items()}}
        if self.max_image_tokens is not None and "N_img" in axes:
            unit = manifest.spatial_merge_size ** 2
            lowered.update(N_img=self.max_image_tokens, N_merged=max(axes["N_merged"][0], self.max_image_tokens),
                           N_patch=max(axes["N_patch"][0], self.max_image_tokens * unit))
        lowered.update(B=self.max_batch, P=self.max_batch, C_pool=ctx)
        for axis, hi in lowered.items():
            if axis in axes:
                top = min(axes[axis][1], hi)
                axes[axis] = (min(axes[axis][0], top), top)
        return replace(manifest, axes=axes, max_context=ctx, max_tree=self.max_tree,
                       max_batch=min(manifest.max_batch, self.max_batch))


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.1f} MiB"


@dataclass(frozen=True)
class Budget:
    """What a build has to fit in, and what it costs before the KV cache."""

    memory_gib: float
    source: str  # where memory_gib came from
    reserve_gib: float  # the OS and the runtime process
    workspace_gib: float
    weights_gib: float  # at the built precision
    kv_bytes_per_row: int

    @property
    def usable_gib(self) -> float:
        return self.memory_gib - self.reserve_gib

    def need_gib(self, rows: int) -> float:
        return self.weights_gib + self.workspace_gib + self.kv_bytes_per_row * rows / GIB

    def rows_that_fit(self, ceiling: int) -> int:
        """The most context rows that fit, up to `ceiling`."""
        if not self.kv_bytes_per_row:
            return ceiling if self.need_gib(0) <= self.usable_gib else 0
        room = (self.usable_gib - self.need_gib(0)) * GIB
        return max(0, min(ceiling, math.floor(room / self.kv_bytes_per_row)))

    def shortfall(self, rows: int) -> str:
        need = self.need_gib(rows)
        return (f"needs {need:.2f} GiB, {need - self.usable_gib:.2f} GiB over the budget of {self.usable_gib:g} GiB "
                f"({self.describe()})")

    def describe(self) -> str:
        return f"{self.memory_gib:g} GiB {self.source}, {self.reserve_gib:g} reserved"


@dataclass(frozen=True)
class BuildPeak:
    """The host memory a build needs at its peak: the worker building its costliest graph."""

    graph: str
    graph_gib: float  # that graph's ONNX file and external data (or its largest part's weights)
    workspace_gib: float  # counted where the GPU shares the host's memory, else 0 (it is GPU memory)
    mapped: bool = False  # its weights are referenced from a map of their file, not held by the parser
    part: str = ""  # "part 2 of 3" where the graph is built in parts

    @property
    def factor(self) -> float:
        return BUILD_MAPPED_WEIGHT_FACTOR if self.mapped else BUILD_WEIGHT_FACTOR

    @property
    def gib(self) -> float:
        return self.factor * self.graph_gib + self.workspace_gib + BUILD_PROCESS_GIB

    def explain(self) -> str:
        workspace = f" + workspace {self.workspace_gib:g} GiB" if self.workspace_gib else ""
        held = "mapped" if self.mapped else "parsed"
        part = f" {self.part}" if self.part else ""
        return (f"builder peak about {self.gib:.2f} GiB of host memory ({self.factor:g} x the {held} weights of "
                f"{self.graph}{part}, {_size(self.graph_gib)}{workspace} + {BUILD_PROCESS_GIB:g} GiB for the process)")


@dataclass(frozen=True)
class MemoryPlan:
    limits: Limits
    budget: Budget
    reasons: dict[str, str]  # limit -> what bound it
    build: BuildPeak  # the host memory the builder needs, wherever it runs
    part_gib: float = PART_GIB  # weights per part of a graph built in parts
    cuts: dict[str, GraphCut] = field(default_factory=dict, compare=False)  # graph -> its parts, where cut
    batch_note: str | None = None  # the line saying a default max batch was lowered to fit, and how to ask for it

    @property
    def workspace_gib(self) -> float:
        return self.budget.workspace_gib

    @property
    def kv_rows(self) -> int:
        """Context rows of every sequence the KV pool holds: one context per sequence of a batched round."""
        return self.limits.max_context * self.limits.max_batch

    @property
    def kv_gib(self) -> float:
        return self.budget.kv_bytes_per_row * self.kv_rows / GIB

    @property
    def total_gib(self) -> float:
        return self.budget.need_gib(self.kv_rows)

    def explain(self) -> str:
        lim, b = self.limits, self.budget
        image = (f", max image tokens {lim.max_image_tokens} ({self.reasons['max_image_tokens']})"
                 if lim.max_image_tokens is not None else "")
        batch = f" for {lim.max_batch} sequences" if lim.max_batch > 1 else ""
        return (f"memory plan: weights {_size(b.weights_gib)} + KV {_size(self.kv_gib)} ({self.kv_rows} rows{batch} x "
                f"{b.kv_bytes_per_row / 1024:.1f} KiB) + workspace {b.workspace_gib:g} GiB = {_size(self.total_gib)} "
                f"of {b.usable_gib:g} GiB ({b.describe()}); max context {lim.max_context} "
                f"({self.reasons['max_context']}), max tree {lim.max_tree} ({self.reasons['max_tree']}), max batch "
                f"{lim.max_batch} ({self.reasons['max_batch']}){image}; "
                f"{self.build.explain()}{self._parts()}")

    def _parts(self) -> str:
        if not self.cuts:
            return f"; every graph whole (at most {self.part_gib:g} GiB of weights each)"
        built = ", ".join(f"{graph} in {len(cut.segments)} parts of at most "
                          f"{_size(max(cut.part_bytes) / GIB)}" for graph, cut in self.cuts.items())
        return f"; {built} (graphs over {self.part_gib:g} GiB of weights are built in parts, chained at run time)"

    def record(self) -> dict[str, Any]:
        b = self.budget
        return {"memory_gib": b.memory_gib, "memory_source": b.source, "reserve_gib": b.reserve_gib,
                "workspace_gib": b.workspace_gib, "weights_gib": round(b.weights_gib, 4),
                "kv_gib": round(self.kv_gib, 4), "kv_bytes_per_row": b.kv_bytes_per_row,
                "total_gib": round(self.total_gib, 4), "reasons": self.reasons,
                "build_peak_gib": round(self.build.gib, 4), "build_peak_graph": self.build.graph,
                "build_peak_part": self.build.part or None,
                "build_peak_weights": "mapped" if self.build.mapped else "parsed", "part_gib": self.part_gib,
                "parts_gib": {graph: [round(b / GIB, 4) for b in cut.part_bytes] for graph, cut in self.cuts.items()}}


def graph_bytes(artifacts: Path, graphs: dict[str, GraphFile]) -> dict[str, int]:
    """Per graph: its ONNX file and external data, the weights its worker parses."""
    return {graph: sum((artifacts / name).stat().st_size for name in (entry.file, entry.data_file) if name)
            for graph, entry in graphs.items()}


def weights_bytes(artifacts: Path, graphs: dict[str, GraphFile]) -> int:
    """Bytes of every graph file and its external data: the weights each engine will hold."""
    return sum(graph_bytes(artifacts, graphs).values())


def kv_bytes_per_row(manifest: Manifest) -> int:
    """K and V of one context row in every graph that keeps a cache (target and head layers)."""
    return sum(2 * s.num_layers * s.kv_heads * s.head_dim * IO_BYTES[manifest.float_dtype]
               for s in (manifest.target, manifest.head))


def _memory(profile: DeviceProfile, device: BuildGpu, memory_gib: float | None) -> tuple[float, str]:
    if memory_gib is not None:
        if memory_gib <= 0:
            raise GlanceError("--memory-gib must be positive")
        return memory_gib, "from --memory-gib"
    if device.memory_gib and device.compute_capability in profile.compute_capabilities:
        return round(device.memory_gib, 1), "on this device"
    return profile.memory_gib, f"the {profile.name} default, --memory-gib to change"


def _workspace(profile: DeviceProfile, workspace_gib: float | None) -> float:
    ws = profile.workspace_gib if workspace_gib is None else workspace_gib
    if not 0 < ws <= profile.max_workspace_gib:
        raise GlanceError(f"--workspace-gib {ws:g} is outside {profile.name}'s 0 < workspace <= "
                          f"{profile.max_workspace_gib:g} GiB ({profile.workspace_note})")
    return ws


def _requested(flag: str, value: int | None, exported: int) -> None:
    """A limit may only lower the export's: its graphs' axis bounds, which the engine profiles come from."""
    if value is None:
        return
    if value < 1:
        raise GlanceError(f"{flag} must be at least 1")
    if value > exported:
        raise GlanceError(f"{flag} {value} is more than the export's {exported}, and engine profiles are sized from "
                          f"the export; re-export with a larger `glance-export onnx {flag} {value}`")


def _max_context(profile: DeviceProfile, budget: Budget, exported: int, requested: int | None) -> tuple[int, str]:
    fit = budget.rows_that_fit(exported)
    if requested is not None:
        if requested > fit:
            lower = f"lower --max-context to {fit} or below" if fit else "lower --workspace-gib or --precision"
            raise GlanceError(f"the model does not fit {profile.name} at --max-context {requested}: "
                              f"{budget.shortfall(requested)}; {lower}, or pass --memory-gib if the device has more")
        return requested, "--max-context"
    smallest = min(exported, CONTEXT_STEP)
    if fit < smallest:
        raise GlanceError(f"the model does not fit {profile.name}: at a {smallest}-row context it "
                          f"{budget.shortfall(smallest)}; lower --workspace-gib (now {budget.workspace_gib:g}), build "
                          f"at a narrower --precision, or pass --memory-gib if the device has more")
    if fit == exported:
        return exported, "the export's limit"
    return fit // CONTEXT_STEP * CONTEXT_STEP, "what fits the memory budget"


def _context_for(budget: Budget, batch: int, ctx: int) -> int:
    """The longest context (a multiple of `CONTEXT_STEP` where one fits) a pool of `batch` sequences fits in."""
    rows = budget.rows_that_fit(batch * ctx) // batch
    return rows // CONTEXT_STEP * CONTEXT_STEP if rows >= CONTEXT_STEP else rows


def _max_batch(profile: DeviceProfile, budget: Budget, ctx: int, exported: int,
               requested: int | None) -> tuple[int, str, str | None]:
    """Sequences a target or draft pass serves, the reason, and the line a lowered default prints (else None):
    never above the export's; the target's default unless requested; and the pool holds a context of KV rows for
    each, so a default that does not fit is lowered to what does (1: no batch profile) rather than refusing the
    build, while a requested one that does not fit is refused."""
    if exported == 1:
        return 1, "the export's limit", None
    cap, why = ((requested, "--max-batch") if requested is not None else
                min((exported, "the export's limit"), (profile.max_batch, f"{profile.name}'s default"),
                    key=lambda pair: pair[0]))
    fit = budget.rows_that_fit(cap * ctx) // ctx
    if fit >= cap:
        return cap, why, None
    rows = _context_for(budget, cap, ctx)
    if requested is not None:
        context = f" or --max-context to {rows}" if rows else ""
        raise GlanceError(f"{cap} sequences of {ctx} context rows do not fit {profile.name}: "
                          f"{budget.shortfall(cap * ctx)}; lower --max-batch to {max(fit, 1)}{context}, or pass "
                          f"--memory-gib if the device has more")
    batch = max(fit, 1)
    ask = (f"to build for {cap}, pass --max-batch {cap} with --max-context {rows} or less" if rows else
           f"{cap} sequences fit no context in this budget: pass --memory-gib if the device has more")
    alone = " (one sequence at a time: no batch profile)" if batch == 1 else ""
    return batch, "what fits the memory budget", (
        f"max batch lowered from {why} {cap} to {batch}{alone}: with {cap} sequences of {ctx} context rows the "
        f"build {budget.shortfall(cap * ctx)}; {ask}")


def part_budget_gib(profile: DeviceProfile, budget: Budget, mapped: bool, requested: float | None) -> float:
    """Weights per part (see the module docstring): `requested`, else `PART_GIB`, lowered on a Jetson to the
    part whose worker fits its memory beside the workspace and the process."""
    if requested is not None:
        return requested
    if not profile.jetson:
        return PART_GIB
    factor = BUILD_MAPPED_WEIGHT_FACTOR if mapped else BUILD_WEIGHT_FACTOR
    room = (budget.usable_gib - budget.workspace_gib - BUILD_PROCESS_GIB) / factor
    return PART_GIB if room <= 0 else min(PART_GIB, math.floor(room * 100) / 100)


def graph_cuts(artifacts: Path, graphs: dict[str, GraphFile], part_gib: float) -> dict[str, GraphCut]:
    """The graphs with more than `part_gib` of weights, each cut into parts (reads their protobufs only)."""
    return {graph: GraphCut(artifacts / graphs[graph].file, budget)
            for graph, size in graph_bytes(artifacts, graphs).items()
            for budget in [cut_budget(size, int(part_gib * GIB))] if budget is not None}


def plan_memory(profile: DeviceProfile, manifest: Manifest, artifacts: Path, precision: str, device: BuildGpu, *,
                max_context: int | None = None, max_tree: int | None = None, memory_gib: float | None = None,
                workspace_gib: float | None = None, tensorrt_version: str | None = None,
                max_part_gib: float | None = None, max_batch: int | None = None) -> MemoryPlan:
    """Check a build fits the target's memory and derive the limits its engines are sized for.

    `tensorrt_version` is the builder's (None: a plan for another machine, sized for the oldest version the
    target accepts); `max_part_gib` the weights per part (None: `part_budget_gib`'s)."""
    export_ctx, export_tree = manifest.max_context, manifest.max_tree
    _requested("--max-context", max_context, export_ctx)
    _requested("--max-tree", max_tree, export_tree)
    _requested("--max-batch", max_batch, manifest.max_batch)
    memory, source = _memory(profile, device, memory_gib)
    graphs = manifest.graphs  # one engine per graph, each holding its weights once
    weights = weights_bytes(artifacts, graphs) * BYTES[precision] / BYTES[manifest.dtype] / GIB
    budget = Budget(memory, source, profile.reserve_gib, _workspace(profile, workspace_gib), weights,
                    kv_bytes_per_row(manifest))
    ctx, ctx_why = _max_context(profile, budget, export_ctx, max_context)
    tree, tree_why = min((export_tree, "the export's limit"), (profile.max_tree, f"{profile.name}'s cap"),
                         (ctx, "the max context"), *([(max_tree, "--max-tree")] if max_tree else []),
                         key=lambda pair: pair[0])
    batch, batch_why, batch_note = _max_batch(profile, budget, ctx, manifest.max_batch, max_batch)
    reasons = {"max_context": ctx_why, "max_tree": tree_why, "max_batch": batch_why}
    image = None
    if "N_img" in manifest.axes:
        exported_image = manifest.axes["N_img"][1]
        image = min(exported_image, ctx // 2)
        reasons["max_image_tokens"] = "the export's limit" if image == exported_image else "half the context"
    mapped = maps_weights(profile, tensorrt_version)
    part_gib = part_budget_gib(profile, budget, mapped, max_part_gib)
    cuts = graph_cuts(artifacts, graphs, part_gib)
    peak = build_peak(artifacts, graphs, profile, budget.workspace_gib, mapped, cuts)
    return MemoryPlan(Limits(ctx, tree, image, batch), budget, reasons, peak, part_gib, cuts, batch_note)


def maps_weights(profile: DeviceProfile, tensorrt_version: str | None) -> bool:
    """Whether the target's parser takes initializers from memory the build maps (what the worker checks)."""
    version = profile.min_version if tensorrt_version is None else tensorrt_version
    return version_tuple(version) >= version_tuple(MAPPED_WEIGHTS_FROM[profile.module])


def build_peak(artifacts: Path, graphs: dict[str, GraphFile], profile: DeviceProfile, workspace_gib: float,
               mapped: bool = False, cuts: dict[str, GraphCut] | None = None) -> BuildPeak:
    """The costliest worker: a whole graph's, or a cut graph's largest part's. External weights are mapped
    where `mapped` (a part's are its graph's), inline ones always parsed."""
    sizes = graph_bytes(artifacts, graphs)
    workspace = workspace_gib if profile.jetson else 0.0
    peaks = []
    for graph, size in sizes.items():
        held = mapped and bool(graphs[graph].data_file)
        cut = (cuts or {}).get(graph)
        if cut is None:
            peaks.append(BuildPeak(graph, size / GIB, workspace, held))
            continue
        largest = max(range(len(cut.part_bytes)), key=cut.part_bytes.__getitem__)
        peaks.append(BuildPeak(graph, cut.part_bytes[largest] / GIB, workspace, held,
                               f"part {largest + 1} of {len(cut.part_bytes)}"))
    return max(peaks, key=lambda p: p.gib)


def available_host_gib(root: Path = Path("/")) -> float | None:
    """Memory this machine can give a new process now (MemAvailable), None where the kernel does not say."""
    available = available_host_bytes(root / "proc/meminfo")
    return None if available is None else available / (1 << 30)


def check_build_host(peak: BuildPeak, available_gib: float | None) -> None:
    """Refuse a build this machine cannot hold, before the first worker starts (not be killed mid-build)."""
    if available_gib is None or peak.gib <= available_gib:
        return
    workspace = ", lower --workspace-gib" if peak.workspace_gib else ""
    raise GlanceError(f"this machine has {available_gib:.2f} GiB of memory available and the build needs about "
                      f"{peak.gib:.2f} GiB ({peak.gib - available_gib:.2f} GiB short; {peak.explain()}); free memory"
                      f"{workspace}, build in smaller parts (--max-part-gib), or build elsewhere: --plan-only writes a "
                      f"bundle for a larger machine")


def check_device_builds(profile: DeviceProfile, plan: MemoryPlan) -> None:
    """A Jetson builds its own engines in the memory it runs them in (CPU and GPU share it): refuse a bundle
    whose build cannot fit there, before it is written."""
    b = plan.budget
    if profile.jetson is None or plan.build.gib <= b.usable_gib:
        return
    raise GlanceError(f"a {profile.name} with {b.describe()} cannot build these engines on the device: "
                      f"{plan.build.explain()} is {plan.build.gib - b.usable_gib:.2f} GiB over its "
                      f"{b.usable_gib:g} GiB; "
                      f"pass --memory-gib if the module has more, build in smaller parts (--max-part-gib), or export a "
                      f"smaller or quantized model")
