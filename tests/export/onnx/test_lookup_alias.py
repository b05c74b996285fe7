"""The quantized vocab graph's lookups read a tied matrix through aliases of their own where the weights live in
a data file: the same bytes stored once, the same outputs, and an ONNX Runtime session that no longer keeps
the stored matrix resident beside the LM head's repacked copy."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from glance_export.onnx.lookup_alias import SUFFIX
from glance_export.onnx.quantize import check_scheme, quantize_graph

ROOT = Path(__file__).resolve().parents[3]


def _vocab_graph(out: Path, vocab: int, hidden: int, *, tied: bool = True, external: bool = True) -> Path:
    """The vocab graph's shape of things: an embedding Gather and an LM head Gemm (on the same matrix when tied)."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(rng.normal(size=(vocab, hidden)).astype(np.float32), "embed.weight")]
    head = "embed.weight"
    if not tied:
        head = "lm_head.weight"
        inits.append(numpy_helper.from_array(rng.normal(size=(vocab, hidden)).astype(np.float32), head))
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "ids"], ["embeds"]),
         helper.make_node("Gemm", ["hidden", head], ["logits"], transB=1)], "vocab",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["m", hidden])],
        [helper.make_tensor_value_info("embeds", TensorProto.FLOAT, ["n", hidden]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["m", vocab])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = out / "vocab.onnx"
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="vocab.onnx.data", size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    return out


def _quantized(tmp_path: Path, name: str, vocab: int = 96, hidden: int = 64, **kw) -> onnx.ModelProto:
    out = _vocab_graph(tmp_path / name, vocab, hidden, **kw)
    quantize_graph(out, "vocab", check_scheme("int4", 32, hidden, "fp32"), lambda _: None)
    return onnx.load(str(out / "vocab.onnx"), load_external_data=False)


def _shared(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with its lookups put back on the shared matrix (what the export wrote before aliasing)."""
    shared = onnx.ModelProto()
    shared.CopyFrom(model)
    graph = shared.graph
    scales = next(n for n in graph.node if n.op_type == "GatherBlockQuantized").input[2].removesuffix(SUFFIX)
    for node in graph.node:
        if node.op_type == "GatherBlockQuantized":
            node.input[0] = node.input[0].removesuffix(SUFFIX)
            node.input[2] = f"{scales}_blocks"
    graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), "axis"))
    nodes = [helper.make_node("Unsqueeze", [scales, "axis"], [f"{scales}_blocks"]), *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    keep = [t for t in graph.initializer if not t.name.endswith(SUFFIX)]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return shared


def _external(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def test_a_tied_matrix_in_a_data_file_is_looked_up_through_aliases_of_the_same_bytes(tmp_path):
    model = _quantized(tmp_path, "tied")
    inits = {t.name: t for t in model.graph.initializer}
    lookups = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    head = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    assert len(lookups) == 1 and "Unsqueeze" not in {n.op_type for n in model.graph.node}
    for lookup in lookups:
        packed, scales = inits[lookup.input[0]], inits[lookup.input[2]]
        assert packed.name == f"{head.input[1]}{SUFFIX}" and scales.name == f"{head.input[2]}{SUFFIX}"
        assert _external(packed) == _external(inits[head.input[1]])  # the same offset and length: stored once
        assert _external(scales) == _external(inits[head.input[2]])
        assert list(scales.dims) == [*inits[head.input[2]].dims, 1]
    path = tmp_path / "tied" / "vocab.onnx"
    onnx.checker.check_model(str(path))
    shared_path = path.with_name("shared.onnx")
    onnx.save_model(_shared(model), str(shared_path))
    feed = {"ids": np.array([0, 7, 95, 7], np.int64),
            "hidden": np.random.default_rng(2).normal(size=(3, 64)).astype(np.float32)}
    ours, before = (ort.InferenceSession(str(p)).run(None, feed) for p in (path, shared_path))
    for a, b in zip(ours, before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kw", [{"tied": False}, {"external": False}], ids=["untied", "embedded"])
def test_no_alias_where_nothing_repacks_the_table_or_no_data_file_holds_it(tmp_path, kw):
    model = _quantized(tmp_path, "g", **kw)
    assert not [t for t in model.graph.initializer if t.name.endswith(SUFFIX)]
    assert "GatherBlockQuantized" in {n.op_type for n in model.graph.node}


RSS_SCRIPT = """
import sys
import numpy as np
import onnxruntime as ort

def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) * 1024

options = ort.SessionOptions()
options.intra_op_num_threads = 1
before = rss()
session = ort.InferenceSession(sys.argv[1], options)
session.run(None, {"ids": np.array([3, 9], np.int64), "hidden": np.ones((2, int(sys.argv[2])), np.float32)})
print(rss() - before)
"""


def _session_bytes(path: Path, hidden: int) -> int:
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path), str(hidden)], capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    return int(done.stdout.split()[-1])


def test_a_session_keeps_only_the_repacked_matrix_resident(tmp_path):
    """65,536 x 1,024 at int4: 34 MB of packed rows. With the lookups on the shared tensor a session holds them
    beside the LM head's repacked copy; with aliases it lets them go after repacking, keeping only the pages its
    lookups map (a kernel may map up to a large folio around each: half the matrix is left as slack)."""
    vocab, hidden = 65536, 1024
    model = _quantized(tmp_path, "big", vocab, hidden)
    path = tmp_path / "big" / "vocab.onnx"
    shared_path = path.with_name("shared.onnx")
    onnx.save_model(_shared(model), str(shared_path))
    packed = vocab * hidden // 2
    aliased, shared = _session_bytes(path, hidden), _session_bytes(shared_path, hidden)
    assert aliased < shared - 0.5 * packed, json.dumps({"aliased": aliased, "shared": shared, "packed": packed})
