"""The ONNX Runtime backend: the shared graph backend with each graph bound through IOBinding.

Every input and output is bound at an address of the device layer's buffers: host memory for the CPU
provider, CUDA memory for the CUDA and TensorRT providers, so KV stays where the provider computes
and the loop, caches and commit code are the ones TensorRT uses (`graph_backend`). Needs numpy and
onnxruntime only: M-RoPE prefill positions come from the numpy port of the model's rope-index function
(`rope_index`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .device_buffers import CudaDevice, Device, HostDevice, Tensor
from ..errors import GlanceError
from ..formats.graphs import DRAFT_GRAPH, DRAFT_VOCAB_GRAPH, TARGET_GRAPH, VISION_GRAPH, VOCAB_GRAPH
from ..formats.artifacts import check_graph_io, read as load_manifest
from ..decode.limits import runtime_limit
from .shape_expr import bind, evaluate
from .batch_rounds import check_batch
from .graph_backend import GraphBackend
from .host_room import check_this_machine, weight_bytes
from .ort_cache import open_cached

PROVIDER_ALIASES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                    "tensorrt": "TensorrtExecutionProvider", "trt": "TensorrtExecutionProvider",
                    "nv_tensorrt_rtx": "NvTensorRTRTXExecutionProvider", "coreml": "CoreMLExecutionProvider",
                    "dml": "DmlExecutionProvider"}


def _onnxruntime():
    """onnxruntime, or a one-line fix when this install lacks it."""
    try:
        import onnxruntime
    except ImportError:
        raise GlanceError("the onnxruntime backend needs onnxruntime: pip install 'glance-toolkit[onnxruntime]' "
                          "(on Jetson, onnxruntime-gpu from the Jetson AI Lab index)") from None
    return onnxruntime


def resolve_providers(requested: Sequence[str] | str | None) -> list[str]:
    """Full provider names in priority order, CPU last as the fallback; unknown or missing ones fail here."""
    available = _onnxruntime().get_available_providers()
    if requested is None:
        return ["CPUExecutionProvider"]
    names = [requested] if isinstance(requested, str) else list(requested)
    chosen = []
    for name in names:
        full = PROVIDER_ALIASES.get(name.lower(), name)
        if full not in available:
            raise GlanceError(f"execution provider {name!r} is not available in this onnxruntime "
                              f"(available: {', '.join(available)}); install the matching onnxruntime build")
        chosen.append(full)
    return chosen + ([] if "CPUExecutionProvider" in chosen else ["CPUExecutionProvider"])


_EXPORTED = ("artifacts were exported for", "re-export with `glance-export onnx`")


_NUMPY_NAMES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
                "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(uint8)": "uint8"}


def _io(values) -> list[tuple[str, str, list]]:
    """A session's inputs or outputs as the manifest records them: numpy dtype names, symbolic axes as names."""
    return [(v.name, _NUMPY_NAMES.get(v.type, v.type), list(v.shape)) for v in values]


class OrtGraph:
    """One session, run with its inputs and outputs bound at device addresses (no copies by ONNX Runtime).

    Its outputs' shapes for a pass (what a chain of parts sizes its buffers by, `graph_chain`) come from the
    shapes the graph declares, axis names bound from the inputs' and expressions evaluated (`shape_expr`):
    ONNX Runtime has no call that says them without running the graph."""

    def __init__(self, session, device: Device):
        self.session, self.device = session, device
        self.input_names = frozenset(i.name for i in session.get_inputs())
        self.binding = session.io_binding()
        self._inputs: dict[str, tuple] = {}  # name -> (address, shape, dtype) bound now
        self._outputs: dict[str, tuple] = {}
        self._declared = {v.name: list(v.shape) for v in (*session.get_inputs(), *session.get_outputs())}
        self.output_dtypes = {v.name: np.dtype(_NUMPY_NAMES.get(v.type, "float32")) for v in session.get_outputs()}

    def output_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        axes: dict[str, int] = {}
        for name, shape in shapes.items():
            bind(self._declared[name], shape, axes)
        out = {}
        for name in self.output_dtypes:
            if any(dim is None for dim in self._declared[name]):
                raise GlanceError(f"output {name} has a dim its graph does not declare; re-export the graph")
            out[name] = tuple(evaluate(dim, axes) for dim in self._declared[name])
        return out

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """Bind what changed since the last run (a binding stays until replaced), then run. A pass rebinds only
        the tensors whose address or shape moved: the KV pool, the pass's input buffers and most outputs sit
        where they sat, and binding costs microseconds a tensor, which on a small model is a tenth of a step."""
        kind, index = self.device.kind, self.device.device_id
        binding = self.binding
        if inputs.keys() != self._inputs.keys():
            binding.clear_binding_inputs()
            self._inputs = {}
        if outputs.keys() != self._outputs.keys():
            binding.clear_binding_outputs()
            self._outputs = {}
        for name, t in inputs.items():
            where = (t.buffer.ptr + t.offset, t.shape, t.dtype)
            if self._inputs.get(name) != where:
                binding.bind_input(name, kind, index, t.dtype.type, list(t.shape), where[0])
                self._inputs[name] = where
        for name, t in outputs.items():
            where = (t.buffer.ptr + t.offset, t.shape, t.dtype)
            if self._outputs.get(name) != where:
                binding.bind_output(name, kind, index, t.dtype.type, list(t.shape), where[0])
                self._outputs[name] = where
        if kind != "cpu":
            self.device.synchronize()  # our stream's uploads and copies land before ONNX Runtime's stream reads
        self.session.run_with_iobinding(binding)


def device_for(providers: list[str]) -> Device:
    """Where the first provider computes: CUDA memory for CUDA-based providers, else host memory."""
    if providers[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider"):
        return CudaDevice()
    return HostDevice()


class OrtBackend(GraphBackend):
    """Exported graphs in `artifacts_dir` (see glance_runtime.formats.graphs) driven by ONNX Runtime."""

    def __init__(self, artifacts_dir: str | Path, providers: Sequence[str] | str | None = None,
                 max_context: int | None = None, max_tree: int | None = None, threads: int | None = None,
                 max_batch: int = 1):
        """`max_batch` > 1: a KV pool for that many sequences, decoded together by the same graphs
        (`batch_rounds`)."""
        ort = _onnxruntime()
        path = Path(artifacts_dir)
        manifest = load_manifest(path)
        chosen = resolve_providers(providers)

        def options():
            made = ort.SessionOptions()
            if threads:
                made.intra_op_num_threads = threads
            made.log_severity_level = 3
            # Workers spin between the ops of a run (no wake-up per op) and stop when the run ends: a round
            # alternates four sessions, and idle workers left spinning would steal the cores the next
            # session's run needs (on 2 cores that doubled a step).
            made.add_session_config_entry("session.intra_op.allow_spinning", "1")
            made.add_session_config_entry("session.force_spinning_stop", "1")
            # A memory pattern plans one block for a run's intermediates per set of input shapes; a decode
            # meets a new context length every step, so each run plans anew and the arena keeps the blocks.
            # Without it the arena reuses freed chunks: 36-layer int4 peak 1.31x -> 1.29x its graphs' bytes,
            # steps as fast.
            made.enable_mem_pattern = False
            return made

        device = device_for(chosen)
        context = runtime_limit("--max-context", max_context, manifest.max_context, *_EXPORTED)
        if max_batch > 1:
            check_batch(manifest, max_batch)
        if isinstance(device, HostDevice):
            check_this_machine(manifest, context, max_batch)

        def session(graph: str) -> OrtGraph:
            try:
                opened = open_cached(ort, path / graph, manifest.file_hashes[graph].sha256, chosen, options)
            except Exception as exc:  # onnxruntime's load errors share no base class short of Exception
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise GlanceError(f"onnxruntime cannot load {path / graph} ({reason}); "
                                  "re-export with `glance-export onnx`") from None
            check_graph_io(manifest, Path(graph).stem, *(_io(values) for values in (opened.get_inputs(),
                                                                                    opened.get_outputs())))
            return OrtGraph(opened, device)

        # Vocabulary graphs first: while a session starts, the CPU provider holds a quantized LM head's stored
        # blocks beside their repacked copy, and that moment costs the least peak memory before the target loads.
        opened = {"vocab": session(VOCAB_GRAPH)}
        if manifest.draft_vocab_size:
            opened["draft_vocab"] = session(DRAFT_VOCAB_GRAPH)
        opened |= {"target": session(TARGET_GRAPH), "draft": session(DRAFT_GRAPH)}
        if manifest.is_vl:
            opened["vision"] = session(VISION_GRAPH)
        graphs = {name: opened[name] for name in ("target", "draft", "vocab", "vision", "draft_vocab")
                  if name in opened}
        super().__init__(manifest, device, graphs, name="onnxruntime", home=path, providers=tuple(chosen),
                         threads=threads,
                         max_context=context,
                         max_tree=runtime_limit("--max-tree", max_tree, manifest.max_tree, *_EXPORTED),
                         max_batch=max_batch, weight_bytes=weight_bytes(manifest))
