"""manifest.json of an artifacts directory (`glance-export onnx`): everything a graph runtime needs besides
the graphs, checked before any graph is opened.

A graph runtime trusts the manifest for every size it allocates and every token id it compares, so a
stale, foreign, edited or incomplete export must fail here, in one line that says how to fix it, rather
than as a shape error deep inside ONNX Runtime or TensorRT, or as quietly different output. Three
layers: `content_sha256` covers every field (an edit, say `stop_token_ids: []`, is refused as an edit);
every field the runtime reads is range-checked (a manifest written with a matching hash still holds
only sizes and ids that fit together); `file_hashes` covers every file beside it.

Document (format_version 4): format, format_version, toolkit_version, family, is_vl, dtype, opset,
float_io_dtype, fp32_outputs, branch_k, block_size, mask_token_id, image_token_id, stop_token_ids,
limits {max_tree, max_context, max_batch (sequences one pass of the target and draft graphs serves: the B axis's
bound; 1 for an EAGLE-3 head)},
axes {name: [min, max]}, source {config_sha256, weights_sha256 {file: sha}},
head {config, weights_sha256}, head_kind ("glance" where absent, or "eagle3": the draft graph is an EAGLE-3
step, graphs.draft then also records kind, max_depth, mrope, tap_layer_ids, hidden_size, draft_vocab_size; its
block_size is max_depth + 1 and its mask_token_id 0, unused: the head has no mask token), rope {theta, mrope_section, vision_start_token_id, spatial_merge_size},
graphs {target|draft|vocab|vision|draft_vocab: {file, data_file, inputs/outputs {name: {dtype, shape}},
...sizes}} (vocab and draft_vocab also
record their vocab_size, whether the LM head is tied to the embedding, and the top-k baked in; draft_vocab is there only for a head with a reduced draft
vocabulary), vision.index_params (the `vision_indices` parameters), files (tokenizer/processor files copied
beside), file_hashes {file: {sha256, size}} of every file written beside the manifest, quantization (null,
or the weight-only scheme: bits, group size, accuracy_level (MatMulNBits' compute mode: 4 is int8
activations, 0 or absent fp32), library, per-graph ops and TensorRT-form files), and
content_sha256 (of all the rest). Version 4 gave the target and draft graphs a batch axis over the KV pool (one
graph per kind serves a lone sequence and a batch; version 3 had separate batched graphs with their own copy of
the weights); 3 added content_sha256; 2 moved the embedding and LM head into the vocab graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .._version import __version__
from ..store.atomic import write_file
from ..errors import GlanceError, IntegrityError
from .graphs import DRAFT_GRAPH, DRAFT_VOCAB_GRAPH, MANIFEST, TARGET_GRAPH, VISION_GRAPH, VOCAB_GRAPH
from .draft_ids import check_graph
from ..store.input_files import present
from ..store.integrity import file_digest, verify_files
from .common import (MAX_BATCH, Invalid, boolean, check_header, check_int, check_text, digest, dumps, guarded,
                     int_list, integer, obj, optional_int, read_json, stamped, text)

FORMAT = "glance-onnx"
VERSION = 4
FILE = MANIFEST
REEXPORT = "re-export with `glance-export onnx`"
WHAT = "GLANCE artifacts manifest"
HASH_FIELD = "content_sha256"
BIG = 1 << 24  # above any real vocabulary, context or layer count: a value past it is corrupt, not large
FLOAT_DTYPES = ("float16", "float32")
INT8_ACCURACY_LEVEL = 4  # MatMulNBits accuracy_level: int8 activations
HEAD_KINDS = ("glance", "eagle3")


@dataclass(frozen=True)
class Stack:
    """KV geometry of a layer stack (the target's or the head's)."""

    num_layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class GraphFile:
    """One exported graph as a builder reads it: its ONNX file, its external data, and its inputs."""

    file: str
    data_file: str | None
    inputs: dict[str, Any]  # name -> {dtype, shape (symbolic axes by name)}: what an engine's profiles bind


@dataclass(frozen=True)
class FileHash:
    """What the manifest records of a file beside it (checked before any graph is opened)."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Quantization:
    """A weight-only quantized export: its scheme, and the TensorRT form of each quantized graph."""

    scheme: str
    group_size: int | None
    tensorrt_opset: int  # the TensorRT form's (blocked DequantizeLinear)
    tensorrt_graphs: dict[str, GraphFile]  # graph -> its TensorRT-form files (under tensorrt/)
    accuracy_level: int = 0  # MatMulNBits' compute mode in the ONNX Runtime form; 0 where older manifests omit it

    @property
    def int8_activations(self) -> bool:
        """Quantized weights multiplied with int8 activations (accuracy_level 4): a tree pass may then differ
        from a one-row pass in the last bits, so GLANCE is gated against these graphs' own greedy decode as
        fp16 is. False for exact quantized graphs."""
        return self.accuracy_level == INT8_ACCURACY_LEVEL


@dataclass(frozen=True)
class Manifest:
    path: Path
    toolkit_version: str
    family: str
    is_vl: bool
    dtype: str  # the export's precision (fp32, fp16)
    opset: int
    float_dtype: str  # numpy name of the graphs' float inputs/outputs
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int | None  # the head drafts over this many target tokens, projected by draft_vocab.onnx
    tap_width: int  # n_taps * hidden: a row of the target's `taps`, the draft's `context_taps`
    target: Stack
    head: Stack
    deepstack_layers: int
    block_size: int
    branch_k: int
    mask_token_id: int
    image_token_id: int | None
    stop_token_ids: tuple[int, ...]
    max_tree: int
    max_context: int
    spatial_merge_size: int | None
    vision_index_params: dict[str, Any] | None
    source: dict[str, Any]
    axes: dict[str, tuple[int, int]]  # every symbolic axis's [min, max], which engine profiles are sized from
    graphs: dict[str, GraphFile]
    head_weights_sha256: str | None  # of the draft head's weights the graphs were exported with
    quantization: Quantization | None
    file_hashes: dict[str, FileHash]  # every file beside the manifest
    raw: dict[str, Any]  # the whole checked document, for the graph I/O and file-hash checks
    head_kind: str = "glance"  # "eagle3": the draft graph is an autoregressive head's step (drafter "steps")
    head_mrope: bool = False  # the EAGLE-3 head rotates with the target's three M-RoPE axes
    max_batch: int = 1  # sequences one pass of the target and draft graphs serves (limits.max_batch)

    @property
    def sampling(self) -> bool:
        """Whether the vocab graph returns its rows' logits, which sampling reads (exports before sampling do not)."""
        return "logits" in ((self.raw.get("graphs") or {}).get("vocab") or {}).get("outputs", {})

    @property
    def short_blocks(self) -> bool:
        """Whether the draft graph drafts a block of any length up to block_size (axes.Bk), not only a whole one:
        graphs exported before it could not."""
        return self.head_kind == "glance" and "Bk" in self.axes


def _version(value: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in str(value).split(".")[:2])
    except ValueError:
        raise GlanceError(f"manifest toolkit_version {value!r} is not a version; {REEXPORT}") from None
    return major, minor


def check_version(exported: str, runtime: str = __version__) -> None:
    """Same major version (same minor while 0.x), and never an export newer than this runtime."""
    e, r = _version(exported), _version(runtime)
    same_series = e[0] == r[0] and (e[0] > 0 or e[1] == r[1])
    if not same_series or e > r:
        raise GlanceError(f"artifacts were exported by toolkit {exported} but this runtime is {runtime}; "
                          f"{REEXPORT} {runtime} (or install toolkit {exported})")


def _name(value: Any, field: str) -> str:
    """A file name inside the artifacts directory: relative, never climbing out of it."""
    name = check_text(value, field)
    parts = PurePosixPath(name).parts
    if not name or "\x00" in name or name.startswith("/") or "\\" in name or ".." in parts:
        raise Invalid(f"{field} is {name!r}; it must name a file inside the artifacts directory")
    return name


def _stack(entry: dict[str, Any], where: str) -> Stack:
    return Stack(integer(entry, "num_layers", 1, 4096, where), integer(entry, "num_kv_heads", 1, 4096, where),
                 integer(entry, "head_dim", 1, 65536, where))


def _kv_io(entry: dict[str, Any], stack: Stack, where: str, inputs: str, outputs: str) -> None:
    """The KV tensors a graph's recorded inputs and outputs name are one key and one value per layer of
    `stack`, each [..., rows, num_kv_heads, head_dim]: what the runtime allocates from the stack's numbers."""
    for side, prefix in (("inputs", inputs), ("outputs", outputs)):
        recorded = entry.get(side)
        if recorded is None:
            continue
        if not isinstance(recorded, dict):
            raise Invalid(f"{where}{side} must be an object")
        found = sorted(n for n in recorded if isinstance(n, str) and n.startswith((f"{prefix}key_", f"{prefix}value_")))
        wanted = sorted(f"{prefix}{kind}_{layer}" for kind in ("key", "value") for layer in range(stack.num_layers))
        if found != wanted:
            raise Invalid(f"{where}num_layers is {stack.num_layers} but {where}{side} hold {len(found)} KV tensors "
                          f"({prefix}key_*/{prefix}value_*), not {len(wanted)}")
        for name in found:
            shape = recorded[name].get("shape") if isinstance(recorded[name], dict) else None
            if not isinstance(shape, list) or shape[-2:] != [stack.kv_heads, stack.head_dim]:
                raise Invalid(f"{where}{side}.{name} has shape {shape!r:.60}, not [..., rows, num_kv_heads "
                              f"{stack.kv_heads}, head_dim {stack.head_dim}]")


def _graph_files(raw: dict[str, Any], graphs: dict[str, Any], needed: dict[str, str]) -> list[str]:
    names = []
    for key, name in needed.items():
        entry = obj(graphs, key, "graphs.")
        if _name(entry.get("file"), f"graphs.{key}.file") != name:
            raise Invalid(f"graphs.{key}.file is {entry.get('file')!r}; the {key} graph is always {name}")
        names.append(name)
        if entry.get("data_file") is not None:
            names.append(_name(entry["data_file"], f"graphs.{key}.data_file"))
    files = raw.get("files", [])
    if not isinstance(files, list):
        raise Invalid("files must be a list of file names")
    names += [_name(f, f"files[{i}]") for i, f in enumerate(files)]
    hashes = obj(raw, "file_hashes")
    for name, entry in hashes.items():
        _name(name, "a file_hashes name")
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or \
                type(entry.get("size")) is not int or entry["size"] < 0:
            raise Invalid(f"file_hashes[{name!r}] must be {{\"sha256\": hex digest, \"size\": bytes}}")
    return names


def _vision_params(value: Any, merge_size: int) -> dict[str, Any]:
    """Sizes the vision indices divide by are at least 1; grid_per_side is 0 where the family has none."""
    if not isinstance(value, dict):
        raise Invalid("graphs.vision.index_params must be an object")
    where = "graphs.vision.index_params."
    family = check_text(value.get("family"), f"{where}family")
    if check_int(value.get("merge_size"), f"{where}merge_size", 1, 64) != merge_size:
        raise Invalid(f"{where}merge_size differs from rope.spatial_merge_size")
    patch = check_int(value.get("patch_size"), f"{where}patch_size", 1, 4096)
    for key in ("window_size", "grid_per_side"):
        if value.get(key) is not None:
            check_int(value[key], f"{where}{key}", 0, 1 << 16)
    if family == "qwen2_5_vl":  # windows of window_size // merge // patch merged tokens: at least one
        check_int(value.get("window_size"), f"{where}window_size", merge_size * patch, 1 << 16)
    if family == "qwen3_vl":  # position embeddings interpolated from a grid_per_side square
        check_int(value.get("grid_per_side"), f"{where}grid_per_side", 1, 1 << 16)
    return value


def _axes(raw: dict[str, Any]) -> dict[str, tuple[int, int]]:
    axes = raw.get("axes") or {}
    if not isinstance(axes, dict):
        raise Invalid("axes must be an object")
    out = {}
    for name, bounds in axes.items():
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise Invalid(f"axes.{name} must be [min, max]")
        lo, hi = (check_int(v, f"axes.{name}", 0, BIG) for v in bounds)
        if lo > hi:
            raise Invalid(f"axes.{name} is [{lo}, {hi}]: min above max")
        out[name] = (lo, hi)
    return out


def _graph_file(entry: dict[str, Any], file: str, data_file: str, where: str) -> GraphFile:
    inputs = entry.get("inputs") or {}
    if not isinstance(inputs, dict):
        raise Invalid(f"{where}inputs must be an object")
    data = entry.get(data_file)
    return GraphFile(text(entry, file, where), None if data is None else text(entry, data_file, where), inputs)


def _quantization(raw: dict[str, Any]) -> Quantization | None:
    q = raw.get("quantization")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise Invalid("quantization must be an object or null")
    graphs = obj(q, "graphs", "quantization.")
    return Quantization(text(q, "scheme", "quantization."), optional_int(q, "group_size", 1, BIG, "quantization."),
                        integer(q, "tensorrt_opset", 1, 99, "quantization."),
                        {name: _graph_file(obj(graphs, name, "quantization.graphs."), "tensorrt_file",
                                           "tensorrt_data_file", f"quantization.graphs.{name}.")
                         for name in graphs},
                        optional_int(q, "accuracy_level", 0, 4, "quantization.") or 0)


def _head_weights(raw: dict[str, Any]) -> str | None:
    head = raw.get("head") or {}
    if not isinstance(head, dict):
        raise Invalid("head must be an object")
    value = head.get("weights_sha256")
    return None if value is None else text(head, "weights_sha256", "head.")


def _parse(path: Path, raw: dict[str, Any]) -> tuple[Manifest, dict[str, str], list[str]]:
    """The typed manifest, the graphs it needs and every file it names; Invalid on the first bad field."""
    is_vl = boolean(raw, "is_vl")
    graphs = obj(raw, "graphs")
    needed = {"target": TARGET_GRAPH, "draft": DRAFT_GRAPH, "vocab": VOCAB_GRAPH,
              **({"vision": VISION_GRAPH} if is_vl else {}),
              **({"draft_vocab": DRAFT_VOCAB_GRAPH} if "draft_vocab" in graphs else {})}
    limits = obj(raw, "limits")
    integer(limits, "max_context", 2, BIG, "limits.")  # a missing context is named before the batch it bounds
    max_batch = integer(limits, "max_batch", 1, MAX_BATCH, "limits.")
    names = _graph_files(raw, graphs, needed)
    target, draft, vocab = (obj(graphs, key, "graphs.") for key in ("target", "draft", "vocab"))
    target_stack = _stack(target, "graphs.target.")
    _kv_io(target, target_stack, "graphs.target.", "pool_", "present_")
    head_kind = text(raw, "head_kind", choices=HEAD_KINDS) if "head_kind" in raw else "glance"
    if draft.get("kind", "glance") != head_kind:
        raise Invalid(f"graphs.draft.kind is {draft.get('kind')!r} but head_kind is {head_kind!r}")
    _kv_io(draft, _stack(draft, "graphs.draft."), "graphs.draft.",
           *(("past_", "present_") if head_kind == "eagle3" else ("pool_ctx_", "ctx_")))
    if head_kind == "eagle3" and max_batch != 1:
        raise Invalid(f"limits.max_batch is {max_batch} but an EAGLE-3 head decodes one sequence at a time")
    hidden = integer(target, "hidden_size", 1, BIG, "graphs.target.")
    vocab_size = integer(target, "vocab_size", 2, BIG, "graphs.target.")
    if integer(vocab, "vocab_size", 2, BIG, "graphs.vocab.") != vocab_size:
        raise Invalid("graphs.vocab.vocab_size differs from graphs.target.vocab_size")
    tap_width = integer(draft, "context_width", hidden, BIG, "graphs.draft.")
    if tap_width % hidden:
        raise Invalid(f"graphs.draft.context_width {tap_width} is not a whole number of hidden rows ({hidden})")
    block = integer(raw, "block_size", 1, 1024)
    branch_k = integer(raw, "branch_k", 1, min(vocab_size, 1024))
    if vocab.get("branch_k") is not None and vocab["branch_k"] != branch_k:
        raise Invalid(f"branch_k {branch_k} differs from the top-k the vocab graph was exported with "
                      f"({vocab['branch_k']!r})")
    draft_vocab = None
    if "draft_vocab" in graphs:
        reduced = obj(graphs, "draft_vocab", "graphs.")
        draft_vocab = integer(reduced, "vocab_size", branch_k, vocab_size, "graphs.draft_vocab.")
        if reduced.get("branch_k") != branch_k:
            raise Invalid(f"branch_k {branch_k} differs from the top-k the draft_vocab graph was exported with "
                          f"({reduced.get('branch_k')!r})")
    token = vocab_size - 1
    max_context = integer(limits, "max_context", 2, BIG, "limits.")
    max_tree = integer(limits, "max_tree", 1, max_context - 1, "limits.")
    rope = raw.get("rope") or {}
    if not isinstance(rope, dict):
        raise Invalid("rope must be an object")
    vision = obj(graphs, "vision", "graphs.") if is_vl else {}
    merge = (integer(rope, "spatial_merge_size", 1, 64, "rope.") if is_vl
             else optional_int(rope, "spatial_merge_size", 1, 64, "rope."))
    source = raw.get("source") or {}
    if not isinstance(source, dict):
        raise Invalid("source must be an object")
    manifest = Manifest(
        path=path.parent, toolkit_version=text(raw, "toolkit_version"), family=text(raw, "family"), is_vl=is_vl,
        dtype=text(raw, "dtype"), opset=integer(raw, "opset", 1, 99),
        float_dtype=text(raw, "float_io_dtype", choices=FLOAT_DTYPES), hidden_size=hidden, vocab_size=vocab_size,
        draft_vocab_size=draft_vocab,
        tap_width=tap_width, target=target_stack, head=_stack(draft, "graphs.draft."),
        deepstack_layers=optional_int(target, "deepstack_layers", 0, target_stack.num_layers, "graphs.target.") or 0,
        block_size=block, branch_k=branch_k, mask_token_id=integer(raw, "mask_token_id", 0, token),
        image_token_id=(integer(raw, "image_token_id", 0, token) if is_vl
                        else optional_int(raw, "image_token_id", 0, token)),
        stop_token_ids=int_list(raw, "stop_token_ids", 0, token), max_tree=max_tree, max_context=max_context,
        spatial_merge_size=merge,
        vision_index_params=_vision_params(vision.get("index_params"), merge) if is_vl else None,
        source=source, axes=_axes(raw),
        graphs={name: _graph_file(obj(graphs, name, "graphs."), "file", "data_file", f"graphs.{name}.")
                for name in graphs},
        head_weights_sha256=_head_weights(raw), quantization=_quantization(raw),
        file_hashes={name: FileHash(e["sha256"], e["size"]) for name, e in raw["file_hashes"].items()}, raw=raw,
        head_kind=head_kind, head_mrope=head_kind == "eagle3" and boolean(draft, "mrope", "graphs.draft."),
        max_batch=max_batch)
    return manifest, needed, names


def read(artifacts_dir: str | Path) -> Manifest:
    """Parse, version-, content- and range-check `artifacts_dir/manifest.json`, then every file it records; what
    fails is the files' fault (IntegrityError)."""
    try:
        return _read(Path(artifacts_dir))
    except IntegrityError:
        raise
    except GlanceError as exc:
        raise IntegrityError(str(exc)) from None


def _read(path: Path) -> Manifest:
    file = path / FILE
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise GlanceError(f"artifacts directory {path} {what}; create it with `glance-export onnx`")
    if not present(file, WHAT, REEXPORT):
        raise GlanceError(f"{path} has no {FILE}; {REEXPORT}")
    raw = read_json(file, WHAT, REEXPORT)
    check_header(raw, file, WHAT, FORMAT, VERSION, REEXPORT)
    check_version(raw.get("toolkit_version", "?"))
    if raw.get(HASH_FIELD) != digest(raw, leave_out=HASH_FIELD):
        raise GlanceError(f"{file} was edited after export (its fields no longer match the content_sha256 it "
                          f"records, and they set the sizes and token ids its graphs were exported with); "
                          f"copy the directory again or {REEXPORT}")
    manifest, needed, names = guarded(file, REEXPORT, lambda: _parse(file, raw))
    for key, name in needed.items():
        if not present(path / name, f"the {key} graph", REEXPORT):
            raise GlanceError(f"{path} lacks the {key} graph ({name}); {REEXPORT}")
    copy = f"copy the whole directory or {REEXPORT}"
    for name in names:
        if not present(path / name, "exported file", copy):
            raise GlanceError(f"{path} lacks {name}, listed in its manifest; {copy}")
    hashes = raw["file_hashes"]
    for name in hashes:  # typed before any is hashed or opened (one missing is verify_files' to name)
        present(path / name, "exported file", copy)
    unrecorded = [n for n in names if n not in hashes]
    if unrecorded:
        raise GlanceError(f"{file} records no hash for {unrecorded[0]}; {REEXPORT}")
    verify_files(path, hashes, f"copy the directory again or {REEXPORT}")
    if manifest.draft_vocab_size:
        check_graph(path / DRAFT_VOCAB_GRAPH, manifest.draft_vocab_size, manifest.vocab_size, REEXPORT)
    return manifest


def write(artifacts_dir: str | Path, document: dict[str, Any]) -> Path:
    """Write the manifest (whole or not at all) under its header and with its content hash."""
    file = Path(artifacts_dir) / FILE
    write_file(file, dumps(stamped(document, FORMAT, VERSION, HASH_FIELD), indent=2))
    return file


def check_graph_io(manifest: Manifest, graph: str, inputs: list[tuple[str, str, list]],
                   outputs: list[tuple[str, str, list]]) -> None:
    """A graph file as a runtime opened it ((name, numpy dtype, shape) per input and output, symbolic axes as
    strings) against what the manifest records for it: a graph swapped in from another export, its hashes
    rewritten, is refused here rather than failing (or answering) inside the runtime."""
    entry = manifest.raw["graphs"][graph]
    for side, found in (("inputs", inputs), ("outputs", outputs)):
        recorded = entry.get(side)
        if not isinstance(recorded, dict):
            continue  # nothing recorded to compare with
        names = {name for name, _, _ in found}
        if names != set(recorded):
            raise GlanceError(f"{manifest.path / entry['file']} has {side} {sorted(names)} but its manifest records "
                              f"{sorted(recorded)}; copy the directory again or {REEXPORT}")
        for name, dtype, shape in found:
            want = recorded[name] if isinstance(recorded[name], dict) else {}
            dims = want.get("shape") or []
            fixed = [(a, b) for a, b in zip(shape, dims) if isinstance(a, int) and isinstance(b, int)]
            if want.get("dtype") != dtype or len(shape) != len(dims) or any(a != b for a, b in fixed):
                raise GlanceError(f"{manifest.path / entry['file']} {side[:-1]} {name} is {dtype} {shape} but its "
                                  f"manifest records {want.get('dtype')} {want.get('shape')}; copy the directory "
                                  f"again or {REEXPORT}")


def check_source(manifest: Manifest, model_dir: str | Path) -> None:
    """Refuse to compare artifacts against a model directory other than the one they were exported from."""
    model = Path(model_dir)
    expected = manifest.source.get("weights_sha256") or {}
    config_sha = manifest.source.get("config_sha256")
    fix = f"pass the original model directory or {REEXPORT}"
    if config_sha and (not present(model / "config.json", "model config", fix)
                       or file_digest(model / "config.json") != config_sha):
        raise GlanceError(f"{model}/config.json differs from the one {manifest.path} was exported from; "
                          f"pass the original model directory or {REEXPORT}")
    for name, sha in expected.items():
        if not present(model / name, "model weights", fix) or file_digest(model / name) != sha:
            raise GlanceError(f"{model}/{name} differs from the weights {manifest.path} was exported from; "
                              f"pass the original model directory or {REEXPORT}")
