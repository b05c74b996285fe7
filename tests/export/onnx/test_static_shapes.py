"""Shape reads of fixed sizes become constants; reads of symbolic sizes stay; the graph computes the same."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from glance_export.onnx.static_shapes import fold_static_shapes


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype=np.int64)))


def rotate_half_graph() -> onnx.ModelProto:
    """x [1, T, 4, 8]: its last half negated in front of its first half (sizes read from the tensor, as a trace
    records `x[..., : x.shape[-1] // 2]`), then flattened to [T, 32] by a shape built from the read T."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("i_last", 3), _const("i_seq", 1), _const("two", 2), _const("zero", [0]), _const("axis", [3]),
        _const("big", [1 << 30]), _const("minus1", [-1]),
        helper.make_node("Gather", ["shape", "i_last"], ["last"], axis=0),
        helper.make_node("Div", ["last", "two"], ["half"]),
        helper.make_node("Unsqueeze", ["half", "zero"], ["half_1d"]),
        helper.make_node("Slice", ["x", "zero", "half_1d", "axis"], ["x1"]),
        helper.make_node("Slice", ["x", "half_1d", "big", "axis"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["neg"]),
        helper.make_node("Concat", ["neg", "x1"], ["rotated"], axis=3),
        helper.make_node("Gather", ["shape", "i_seq"], ["seq"], axis=0),
        helper.make_node("Unsqueeze", ["seq", "zero"], ["seq_1d"]),
        helper.make_node("Concat", ["seq_1d", "minus1"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["rotated", "flat_shape"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "rotate_half",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 32])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_fixed_reads_fold_and_symbolic_reads_stay():
    model = rotate_half_graph()
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert fold_static_shapes(folded) == 1  # the last dim (8) is fixed; the sequence is not
    onnx.checker.check_model(folded, full_check=True)
    gathers = [n for n in folded.graph.node if n.op_type == "Gather"]
    assert [n.output[0] for n in gathers] == ["seq"]
    constant = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in folded.graph.node if n.op_type == "Constant"}
    assert int(constant["last"]) == 8
    assert any(n.op_type == "Shape" for n in folded.graph.node)  # still read for the sequence


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_folded_graph_computes_the_same(rows):
    model = rotate_half_graph()
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    fold_static_shapes(folded)
    x = np.random.default_rng(rows).standard_normal((1, rows, 4, 8)).astype(np.float32)
    expected = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1).reshape(rows, 32)
    np.testing.assert_array_equal(_run(model, x), expected)
    np.testing.assert_array_equal(_run(folded, x), expected)


def test_fully_fixed_shape_becomes_one_constant():
    model = rotate_half_graph()
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 5  # T fixed at 5
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 5
    assert fold_static_shapes(model) == 2  # both picks of it
    assert not [n for n in model.graph.node if n.op_type in ("Shape", "Gather")]
    x = np.ones((1, 5, 4, 8), np.float32)
    assert _run(model, x).shape == (5, 32)


def test_a_fixed_shape_read_whole_becomes_a_constant():
    """A reader other than a fixed pick (here Concat) gets the whole shape as a constant."""
    model = rotate_half_graph()
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 5
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 5
    model.graph.node.append(helper.make_node("Concat", ["shape", "zero"], ["shape_and_zero"], axis=0))
    model.graph.output.append(helper.make_tensor_value_info("shape_and_zero", TensorProto.INT64, [5]))
    assert fold_static_shapes(model) == 3  # the two picks and the shape
    assert not [n for n in model.graph.node if n.op_type == "Shape"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(["shape_and_zero"], {"x": np.ones((1, 5, 4, 8), np.float32)})[0],
                                  [1, 5, 4, 8, 0])


def test_nothing_to_fold_leaves_the_graph_alone():
    model = rotate_half_graph()
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "D"  # no fixed size is read
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "F"
    before = model.SerializeToString()
    assert fold_static_shapes(model) == 0
    assert model.SerializeToString() == before


def scaled_graph() -> onnx.ModelProto:
    """x [B, T, 8] scaled by 1/sqrt of its last dim, read as a Slice of its shape (how attention's default scale
    is traced), and by its batch, read the same way (a symbolic size)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("minus1", [-1]), _const("big", [1 << 62]), _const("zero", [0]), _const("one", [1]),
        helper.make_node("Slice", ["shape", "minus1", "big"], ["last"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["batch"]),
        helper.make_node("Cast", ["last"], ["last_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["batch"], ["batch_f"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["last_f"], ["root"]),
        helper.make_node("Div", ["x", "root"], ["scaled"]),
        helper.make_node("Mul", ["scaled", "batch_f"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "scaled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _folded(model: onnx.ModelProto, rewrites: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A folded copy of `model` (checked, `rewrites` shape reads rewritten) and its constants by output name."""
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert fold_static_shapes(folded) == rewrites
    onnx.checker.check_model(folded, full_check=True)
    return folded, {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in folded.graph.node
                    if n.op_type == "Constant"}


def test_a_slice_of_fixed_dims_folds_and_one_of_symbolic_dims_stays():
    model = scaled_graph()
    folded, constant = _folded(model, 1)
    assert constant["last"].tolist() == [8]
    assert [n.output[0] for n in folded.graph.node if n.op_type == "Slice"] == ["batch"]
    x = np.random.default_rng(0).normal(size=(3, 5, 8)).astype(np.float32)
    np.testing.assert_array_equal(_run(folded, x), _run(model, x))


def split_heads_graph() -> onnx.ModelProto:
    """x [B, T, 8] reshaped to [B, T, -1, 4] by sizes read off x itself (how attention splits its heads in a batched
    graph), and to [T, -1] by a size read off x at another place than it lands."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("i0", 0), _const("i1", 1), _const("zero", [0]), _const("minus1", [-1]), _const("four", [4]),
        helper.make_node("Gather", ["shape", "i0"], ["batch"], axis=0),
        helper.make_node("Gather", ["shape", "i1"], ["seq"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "zero"], ["batch_1d"]),
        helper.make_node("Unsqueeze", ["seq", "zero"], ["seq_1d"]),
        helper.make_node("Concat", ["batch_1d", "seq_1d", "minus1", "four"], ["heads_shape"], axis=0),
        helper.make_node("Reshape", ["x", "heads_shape"], ["heads"]),
        helper.make_node("Concat", ["seq_1d", "minus1"], ["moved_shape"], axis=0),
        helper.make_node("Reshape", ["x", "moved_shape"], ["moved"]),
    ]
    graph = helper.make_graph(nodes, "split_heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 8])],
                              [helper.make_tensor_value_info("heads", TensorProto.FLOAT, ["B", "T", 2, 4]),
                               helper.make_tensor_value_info("moved", TensorProto.FLOAT, ["T", None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sizes_a_reshape_reads_off_its_own_input_become_copies():
    model = split_heads_graph()
    folded, constant = _folded(model, 1)
    concat = next(n for n in folded.graph.node if n.output[0] == "heads_shape")
    assert [constant[name].tolist() for name in concat.input] == [[0], [0], [-1], [4]]
    assert next(n for n in folded.graph.node if n.output[0] == "moved_shape").input[0] == "seq_1d"  # T lands at 0
    session = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    before, after = session(model), session(folded)
    for batch, rows in ((1, 1), (3, 5), (2, 7)):
        x = np.random.default_rng(batch).normal(size=(batch, rows, 8)).astype(np.float32)
        for want, got in zip(before.run(None, {"x": x}), after.run(None, {"x": x})):
            np.testing.assert_array_equal(got, want)
