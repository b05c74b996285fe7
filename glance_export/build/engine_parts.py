"""Cut a graph too large to build whole into consecutive parts, each built as its own engine and chained at run
time (`glance_runtime.backends.graph_chain`), so the builder's peak is one part's, not the graph's.

TensorRT's builder holds its own copy of a graph's weights and the serialized engine at once, about twice the
weights (`memory_plan`), and an engine that leaves its weights out (weight-stripped, refittable) cannot be built
by TensorRT-RTX without a GPU. A part is a run of consecutive nodes (`onnx.segments.split`) with at most a part
budget of weights; its ONNX file is weightless where the graph's weights are external, pointing into the same
data file (linked beside it in the build's scratch directory, never written into the artifacts).

What crosses a cut must be something an engine can take as an input: a floating-point tensor whose dims are
arithmetic on the graph's axes (a KV concat's `S + T`), so a profile's min/opt/max of it follow from the
graph's own (`shape_expr`). Values that are cheap to recompute from the graph's inputs (shape arithmetic,
constants, the attention mask, rotary tables: nodes that read no weight but vectors of at most
`RECOMPUTE_ELEMENTS`) are recomputed
in every part that reads them instead of crossing, and a cut is placed only where everything else that
crosses is such a tensor. Dims come from ONNX Runtime's symbolic shape inference, which needs `onnx` and
`sympy`: a build that cuts a graph needs them, one that does not never imports them.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from glance_runtime.errors import GlanceError
from glance_runtime.backends.shape_expr import symbols

PART_GIB = 2.0  # default part budget: see memory_plan.part_budget_gib
RECOMPUTE_ELEMENTS = 4096  # a node reading no initializer but vectors this short (and only such values) is recomputed
NUMPY_OF_ONNX = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 9: "bool", 2: "uint8"}
FLOATING = {1, 10, 16}


def _onnx():
    try:
        import onnx
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError as exc:
        raise GlanceError(f"building a graph in parts needs {exc.name or 'onnx'} (pip install "
                          f"'glance-toolkit[parts]'), or pass a larger --max-part-gib to build every graph whole") from None
    return onnx, SymbolicShapeInference


def _dims(value_type) -> list[int | str] | None:
    """A tensor type's dims (ints and axis expressions), None where its shape or a dim is unknown."""
    tensor = value_type.tensor_type
    if not tensor.HasField("shape"):
        return None
    dims: list[int | str] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            return None
    return dims


@dataclass(frozen=True)
class PartFile:
    """One part as the builder takes it: its ONNX file, its inputs as the manifest lists a graph's
    ({name: {dtype, shape}}), the tensors it writes, and the bytes of weights it reads."""

    onnx: Path
    inputs: dict[str, dict[str, Any]]
    outputs: list[str]
    weight_bytes: int


class GraphCut:
    """Where one graph is cut for a part budget, from its weightless protobuf (the weights are never read)."""

    def __init__(self, path: Path, budget: int):
        onnx, symbolic = _onnx()
        from ..onnx.node_runs import Segment, boundaries, crossing, reads, split

        self.path, self.budget = path, budget
        try:
            self.model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf's DecodeError, OSError: a damaged or foreign file
            raise GlanceError(f"cannot read {path} to cut it into parts ({type(exc).__name__}); re-export the "
                              f"artifacts") from None
        graph = self.model.graph
        try:
            inferred = symbolic.infer_shapes(_with_small_weights(self.model, path.parent), auto_merge=True)
        except Exception as exc:  # symbolic inference raises whatever its sympy and onnx calls raise
            raise GlanceError(f"cannot infer the tensor shapes of {path.name} to cut it into parts ({exc}); pass a "
                              f"larger --max-part-gib to build it whole") from None
        self.types = {v.name: v.type for v in (*inferred.graph.input, *inferred.graph.value_info,
                                                 *inferred.graph.output)}
        inputs = {i.name for i in graph.input}
        self.axes = {s for i in graph.input for d in (_dims(i.type) or []) for s in symbols(d)}
        small = {t.name for t in graph.initializer if len(t.dims) <= 1 and math.prod(t.dims) <= RECOMPUTE_ELEMENTS}
        producer, cheap = {}, set()
        for index, node in enumerate(graph.node):
            names = reads(node)
            if all(n in inputs or n in cheap or n in small for n in names):
                cheap.update(o for o in node.output if o)
            producer.update((o, index) for o in node.output if o)

        @lru_cache(maxsize=None)
        def can_cut(index: int) -> bool:
            return all(name in cheap or self._passable(name) for name in crossing(graph, index))

        segments = self.runs = split(graph, budget, can_cut)  # the nodes each part owns, before recomputing
        augmented = []
        for number, segment in enumerate(segments):
            made = {o for node in segment.nodes for o in node.output}
            wanted = {n for node in segment.nodes for n in reads(node)} - made
            cone: set[int] = set()
            todo = [n for n in wanted if n in cheap and n not in inputs] if number else []
            while todo:
                index = producer[todo.pop()]
                if index not in cone:
                    cone.add(index)
                    todo += [n for n in reads(graph.node[index]) if n in cheap and n not in inputs]
            augmented.append(Segment([graph.node[i] for i in sorted(cone)] + segment.nodes, segment.weight_bytes))
        self.segments = augmented
        self.boundaries = boundaries(graph, augmented)

    def _passable(self, name: str) -> bool:
        """Whether an engine can take the value as an input: a float tensor with dims in the graph's axes."""
        value_type = self.types.get(name)
        dims = None if value_type is None else _dims(value_type)
        if dims is None or value_type.tensor_type.elem_type not in FLOATING:
            return False
        try:
            return all(symbols(d) <= self.axes for d in dims)
        except GlanceError:  # a dim symbolic inference wrote as something other than arithmetic
            return False

    @property
    def part_bytes(self) -> list[int]:
        return [segment.weight_bytes for segment in self.segments]

    def _spec(self, name: str) -> dict[str, Any]:
        value_type = self.types[name]
        return {"dtype": NUMPY_OF_ONNX.get(value_type.tensor_type.elem_type, "float32"), "shape": _dims(value_type)}

    def write(self, out_dir: Path, stem: str) -> list[PartFile]:
        """Write each part's protobuf as out_dir/<stem>.partN.onnx, the graph's data file linked beside them."""
        onnx, _ = _onnx()
        from ..onnx.node_runs import segment_model

        initializers = {t.name: t for t in self.model.graph.initializer}
        locations = {entry.value for t in initializers.values() for entry in t.external_data if entry.key == "location"}
        for location in locations:
            link = out_dir / location
            if not link.exists():
                os.symlink((self.path.parent / location).resolve(), link)
        parts = []
        for number, (segment, (inputs, outputs)) in enumerate(zip(self.segments, self.boundaries), start=1):
            path = out_dir / f"{stem}.part{number}.onnx"
            onnx.save_model(segment_model(self.model, segment, inputs, outputs, initializers, self.types), str(path))
            parts.append(PartFile(path, {n: self._spec(n) for n in inputs}, list(outputs), segment.weight_bytes))
        return parts


def _with_small_weights(model, directory: Path):
    """A copy of the weightless model with its small external weights read in: shape inference computes with
    the values of shape arithmetic (and of tables like rotary frequencies), never with a weight matrix."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        if uses_external_data(tensor) and math.prod(tensor.dims) <= RECOMPUTE_ELEMENTS:
            info = ExternalDataInfo(tensor)
            with open(directory / info.location, "rb") as fh:
                fh.seek(info.offset or 0)
                raw = fh.read(info.length)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.raw_data = raw
    return copy


def cut_budget(graph_bytes: int, part_bytes: int) -> int | None:
    """The weights per part for a graph of `graph_bytes` under a budget of `part_bytes`: None where it is built
    whole; else the graph shared evenly over as few parts as the budget allows (a cut lands only between
    nodes, so a part may hold a little more or a few less)."""
    if graph_bytes <= part_bytes:
        return None
    return math.ceil(graph_bytes / math.ceil(graph_bytes / part_bytes))
