"""A head's draft vocabulary is checked where the head is read: a bad `draft_vocab_size` in its config.json or bad
`draft_vocab_ids` in its weights is one line naming the file, the key and the fix, for the library, the torch
backend and `glance-export onnx` alike. A draft_vocab graph already exported from such a head is refused when its
artifacts are read, by the same rule."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file, save_file

from glance_export.cli import main as export_main
from glance_export.model.head import load_head
from glance_export.onnx import export_artifacts
from glance_runtime.cli.run import main as run_main
from glance_runtime.defaults import BRANCH_K
from glance_runtime.errors import GlanceError, IntegrityError
from glance_runtime.formats import artifacts as artifacts_format
from glance_runtime.formats.draft_ids import check_graph, graph_ids
from glance_runtime.store.integrity import record
from support import make_snapshot, tiny_head

N = 16


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(snapshot, a head drafting over N tokens, its vocabulary size)."""
    root = tmp_path_factory.mktemp("draft_vocab_checks")
    snap = make_snapshot(root / "snap", "qwen2")
    head = tiny_head(snap, root / "head", draft_vocab=N)
    return snap, head, json.loads((head / "config.json").read_text())["vocab_size"]


def one_line(capsys, code: int) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


def edited_config(head, tmp_path, value):
    bad = tmp_path / "bad_head"
    shutil.copytree(head, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["draft_vocab_size"] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def edited_ids(head, tmp_path, change):
    bad = tmp_path / "bad_head"
    shutil.copytree(head, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["draft_vocab_ids"] = change(state["draft_vocab_ids"]).contiguous()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


SIZES = {"zero": 0, "below-the-branching": BRANCH_K - 1, "above-the-vocabulary": 10**6, "a-string": str(N),
         "a-float": N + 0.5, "a-bool": True}
IDS = {"duplicate": lambda ids: torch.cat([ids[:1], ids[:-1]]),
       "negative": lambda ids: torch.cat([ids[:-1], torch.tensor([-1])]),
       "past-the-vocabulary": lambda ids: torch.cat([ids[:-1], torch.tensor([10**6])]),
       "floats": lambda ids: ids.float(),
       "shorter": lambda ids: ids[:-1],
       "longer": lambda ids: torch.cat([ids, ids[-1:] - 1])}


EDITS = {**{f"size-{case}": (edited_config, value, "config.json", "draft_vocab_size") for case, value in SIZES.items()},
         **{f"ids-{case}": (edited_ids, edit, "model.safetensors", "draft_vocab_ids") for case, edit in IDS.items()}}


@pytest.mark.parametrize("case", EDITS)
def test_a_bad_draft_vocabulary_is_refused_naming_its_file_and_key(case, made, tmp_path):
    _, head, _ = made
    edit, value, file, key = EDITS[case]
    bad = edit(head, tmp_path, value)
    with pytest.raises(GlanceError) as refused:
        load_head(bad)
    line = str(refused.value)
    assert str(bad / file) in line and key in line and "\n" not in line, line


def test_the_torch_backend_and_the_export_refuse_a_bad_head_in_one_line(made, tmp_path, capsys):
    snap, head, _ = made
    bad = edited_ids(head, tmp_path, IDS["duplicate"])
    line = one_line(capsys, run_main(["--backend", "torch", "--model", str(snap), "--head", str(bad), "--prompt", "Hi",
                                      "--max-new-tokens", "2"]))
    assert "draft_vocab_ids" in line and "more than once" in line, line
    line = one_line(capsys, export_main(["onnx", "--model", str(snap), "--head", str(bad), "--out",
                                         str(tmp_path / "art"), "--quiet"]))
    assert "draft_vocab_ids" in line and not (tmp_path / "art").exists(), line


def test_the_torch_backend_serves_no_top_k_above_the_draft_vocabulary(made, capsys):
    snap, head, _ = made
    line = one_line(capsys, run_main(["--backend", "torch", "--model", str(snap), "--head", str(head), "--prompt", "Hi",
                                      "--max-new-tokens", "2", "--branch-k", str(N + 1)]))
    assert f"--branch-k {N + 1}" in line, line


def restamped(art, ids: np.ndarray) -> None:
    """The export as the exporter wrote it from a head with these ids: the graph's id map replaced, the file
    hashes and the manifest's content hash written anew."""
    graph = art / "draft_vocab.onnx"
    model = onnx.load(str(graph))
    (target,) = [t for t in model.graph.initializer if t.name == "target_ids"]
    target.CopyFrom(numpy_helper.from_array(ids.astype(np.int64), "target_ids"))
    onnx.save(model, str(graph))
    raw = json.loads((art / "manifest.json").read_text())
    raw["file_hashes"].update(record(art, ["draft_vocab.onnx"]))
    artifacts_format.write(art, raw)


def test_an_export_of_a_head_with_bad_ids_is_refused_at_load(made, tmp_path, capsys):
    snap, head, vocab = made
    art = export_artifacts(snap, head, tmp_path / "art", max_tree=16, max_context=128, progress=lambda _: None)
    ids = graph_ids(art / "draft_vocab.onnx")
    assert ids.tolist() == load_head(head).draft_vocab_ids.tolist()
    restamped(art, ids)
    assert artifacts_format.read(art).draft_vocab_size == N  # the rewrite alone changes nothing
    for bad, phrase in ((np.concatenate([ids[:1], ids[:-1]]), "more than once"),
                        (np.concatenate([ids[:-1], [vocab]]), "outside the target's vocabulary")):
        restamped(art, bad)
        with pytest.raises(IntegrityError, match=phrase):
            artifacts_format.read(art)
        line = one_line(capsys, run_main(["--backend", "onnxruntime", "--artifacts", str(art), "--prompt", "Hi",
                                          "--max-new-tokens", "2"]))
        assert "draft_vocab.onnx" in line and phrase in line and "re-export" in line, line


def gather_graph(ids: np.ndarray, output: str = "topk_ids") -> onnx.ModelProto:
    node = helper.make_node("Gather", ["target_ids", "indices"], [output])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("indices", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info(output, TensorProto.INT64, [None])],
                              [numpy_helper.from_array(ids, "target_ids")])
    return helper.make_model(graph)


def test_ids_are_read_from_external_data_and_a_graph_without_them_is_refused(tmp_path):
    ids = np.arange(3, 3 + 4 * N, 4, dtype=np.int64)
    onnx.save(gather_graph(ids), str(tmp_path / "g.onnx"), save_as_external_data=True, location="g.onnx.data",
              size_threshold=0)
    assert (tmp_path / "g.onnx.data").is_file() and graph_ids(tmp_path / "g.onnx").tolist() == ids.tolist()
    check_graph(tmp_path / "g.onnx", N, 1000, "re-export")
    with pytest.raises(IntegrityError, match=f"not the {N + 1} of draft_vocab_size"):
        check_graph(tmp_path / "g.onnx", N + 1, 1000, "re-export")
    onnx.save(gather_graph(ids, "other"), str(tmp_path / "h.onnx"))
    with pytest.raises(IntegrityError, match="cannot read the draft vocabulary's ids"):
        check_graph(tmp_path / "h.onnx", N, 1000, "re-export")
    (tmp_path / "i.onnx").write_bytes(b"\xff" * 64)
    with pytest.raises(IntegrityError, match="cannot read the draft vocabulary's ids"):
        check_graph(tmp_path / "i.onnx", N, 1000, "re-export")
