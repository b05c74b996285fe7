"""The TensorRT backend: engines from `glance-export build`, run by the shared graph backend on CUDA buffers.

An engines directory holds `<graph>.engine` files and `engines.json` (what they were built with and
from). A TensorRT plan runs only on the TensorRT version and GPU it was built for, so both are checked
before any engine is deserialized, with a one-line refusal that names the rebuild. There is one engine per
graph kind: the target and draft engines serve a lone sequence's passes and a batched round alike, with a
profile for each (prefill, verify and batch; draft and batch). Each optimization profile gets its own
execution context (switching one context between profiles would re-plan every pass); each pass picks the
tightest profile that holds its shapes (`pick_profile`), so a one-row decode or a tree verify never runs in
the prefill profile, nor a lone sequence's pass in the batch profile. The KV pool's geometry is the record's:
at most `limits.max_batch` slots of at most `limits.max_context` rows (the profiles span both, so a runtime
decoding one sequence holds a one-slot pool, and a lower --max-context a shorter one). A graph built in parts
(engines.json lists them) runs as a chain of its part engines (`graph_chain`), each part's output shapes read
from its context once the pass's input shapes are set. Works with `tensorrt` and `tensorrt_rtx` alike: the runtime API below
is common to both.
"""
from __future__ import annotations

import importlib
from math import prod
from pathlib import Path
from typing import Sequence

import numpy as np

from .device_buffers import CudaDevice, Tensor
from ..errors import GlanceError
from .graph_chain import chain
from ..store.integrity import verify_engines
from ..formats import engines as engines_format
from ..formats.artifacts import read as load_manifest
from ..store.integrity import sha256
from ..decode.limits import runtime_limit
from .batch_rounds import check_batch
from .graph_backend import GraphBackend

REBUILD = "rebuild them on this device with `glance-export build --artifacts ART --target T --out DIR`"

Ranges = dict[str, tuple[Sequence[int], Sequence[int]]]  # input -> (min shape, max shape)


def check_engines(record: engines_format.EnginesRecord, module: str, version: str, compute_capability: str) -> None:
    """Refuse engines built by another TensorRT or for another GPU: their plans would fail or misbehave."""
    if (record.module, record.tensorrt_version) != (module, version):
        raise GlanceError(f"engines were built with {record.module} {record.tensorrt_version} but this machine has "
                          f"{module} {version}; {REBUILD}")
    allowed = record.compute_capabilities
    if compute_capability not in allowed:
        raise GlanceError(f"engines were built for compute capability {', '.join(allowed) or '?'} but this GPU is "
                          f"{compute_capability}; {REBUILD}")


def check_engine_batch(record: engines_format.EnginesRecord, max_batch: int) -> None:
    """Refuse a batch above the one the engines were built for: their batch axis and pool slots stop there."""
    if max_batch <= record.max_batch:
        return
    built = ("one sequence at a time (no batch profile)" if record.max_batch == 1 else
             f"at most {record.max_batch} sequences a pass")
    raise GlanceError(f"--max-batch {max_batch} is more than these engines serve: they were built for {built}; "
                      f"pass --max-batch {record.max_batch} or less, or rebuild with `glance-export build --max-batch "
                      f"{max_batch}` (with a smaller --max-context where memory is short)")


def pick_profile(profiles: list[Ranges], shapes: dict[str, tuple[int, ...]]) -> int:
    """The tightest profile (least input volume at its maxima) whose ranges hold every shape of the pass."""
    best, best_volume = -1, None
    for index, ranges in enumerate(profiles):
        fits = all(all(lo <= s <= hi for s, lo, hi in zip(shape, *ranges[name]))
                   for name, shape in shapes.items() if name in ranges)
        volume = sum(prod(hi) for _, hi in ranges.values())
        if fits and (best_volume is None or volume < best_volume):
            best, best_volume = index, volume
    if best < 0:
        raise GlanceError(f"no engine profile holds a pass of shapes {shapes}; {REBUILD} with larger limits")
    return best


def _numpy_dtype(trt, dtype) -> np.dtype:
    """The numpy dtype of a TensorRT tensor type; bf16, which numpy lacks, as a 2-byte container (a buffer
    between parts is only ever bound by address)."""
    if dtype == trt.DataType.BF16:
        return np.dtype(np.uint16)
    return np.dtype(trt.nptype(dtype))


class TrtGraph:
    """One engine with an execution context per optimization profile, all on the device's stream."""

    def __init__(self, trt, runtime, path: Path, device: CudaDevice):
        self.device = device
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise GlanceError(f"TensorRT cannot deserialize {path}; {REBUILD}")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.input_names = frozenset(inputs)
        self.output_dtypes = {n: _numpy_dtype(trt, engine.get_tensor_dtype(n)) for n in names if n not in inputs}
        self.engine = engine
        self.profiles: list[Ranges] = []
        self.contexts = []
        self._shapes_set: dict[str, tuple[int, ...]] | None = None  # the input shapes last set, and on which context
        self._context_set = None
        for index in range(engine.num_optimization_profiles):
            shapes = {n: engine.get_tensor_profile_shape(n, index) for n in inputs}
            self.profiles.append({n: (tuple(s[0]), tuple(s[2])) for n, s in shapes.items()})
            context = engine.create_execution_context()
            context.set_optimization_profile_async(index, device.stream.ptr)
            self.contexts.append(context)

    def _context(self, shapes: dict[str, tuple[int, ...]]):
        """The tightest profile's context, with the pass's input shapes set; a chain asks for a part's output
        shapes and then runs it on the same shapes, so those are set once, not twice."""
        key = {name: tuple(shape) for name, shape in shapes.items()}
        if key == self._shapes_set:
            return self._context_set
        context = self.contexts[pick_profile(self.profiles, shapes)]
        for name, shape in shapes.items():
            context.set_input_shape(name, shape)
        self._shapes_set, self._context_set = key, context
        return context

    def output_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        context = self._context(shapes)
        return {name: tuple(context.get_tensor_shape(name)) for name in self.output_dtypes}

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        context = self._context({n: t.shape for n, t in inputs.items()})
        for name, t in inputs.items():
            context.set_tensor_address(name, t.ptr)
        for name, t in outputs.items():
            context.set_tensor_address(name, t.ptr)
        if not context.execute_async_v3(self.device.stream.ptr):
            raise GlanceError("TensorRT failed to enqueue a pass; see the TensorRT log above")


class TrtBackend(GraphBackend):
    """Engines in `engines_dir`; their sizes come from the artifacts they were built from (recorded in
    engines.json, or `artifacts_dir`), whose manifest must be the one built from."""

    binds_every_output = True  # an engine runs only with every output bound: the vocab engine's logits too

    def __init__(self, engines_dir: str | Path, artifacts_dir: str | Path | None = None,
                 max_context: int | None = None, max_tree: int | None = None, max_batch: int = 1):
        engines = Path(engines_dir)
        record = engines_format.read(engines)
        verify_engines(engines, record.files)  # first: a damaged copy is named as such on any machine
        module_name = record.module
        try:
            trt = importlib.import_module(module_name)
        except ImportError:
            raise GlanceError(f"these engines need the {module_name} Python module (on Jetson it comes with "
                              "JetPack: apt install python3-libnvinfer)") from None
        device = CudaDevice()
        check_engines(record, module_name, trt.__version__, device.compute_capability())
        artifacts = Path(artifacts_dir or record.artifacts_path or engines)
        manifest = load_manifest(artifacts)
        expected = record.artifacts_manifest_sha256
        if expected and sha256(artifacts / "manifest.json") != expected:
            raise GlanceError(f"{artifacts} is not the export these engines were built from; pass the original "
                              f"with --artifacts or {REBUILD}")
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
        def graph(files):
            if len(files) == 1:
                return TrtGraph(trt, self.runtime, engines / files[0].file, device)
            return chain(files, lambda part: TrtGraph(trt, self.runtime, engines / part.file, device), device)

        if max_batch > 1:
            check_batch(manifest, max_batch)
            check_engine_batch(record, max_batch)
        graphs = {name: graph(files) for name, files in record.engines.items()}
        built = ("engines were built for", "rebuild them with `glance-export build`")
        super().__init__(manifest, device, graphs, name="tensorrt", home=engines,
                         precision=record.precision,  # fp16 engines from fp32 graphs
                         max_context=runtime_limit("--max-context", max_context, record.max_context, *built),
                         max_tree=runtime_limit("--max-tree", max_tree, record.max_tree, *built),
                         max_batch=max_batch,
                         weight_bytes=sum(f.bytes for f in record.files))  # each engine holds its weights once
