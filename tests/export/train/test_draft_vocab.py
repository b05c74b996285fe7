"""--draft-vocab N: the head drafts over the N tokens the target answers with most often, saved with it as
`draft_vocab_ids` (int64, ascending) and `draft_vocab_size` in config.json; it decodes losslessly."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from glance_export.audit.greedy_audit import audit
from glance_export.cli import main as export_main
from glance_export.model.head import load_head
from glance_export.train.draft_vocab import frequent_tokens
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.loop import DecodeConfig
from glance_runtime.formats.tasks import read as read_tasks


def test_frequent_tokens_are_the_most_common_ascending_and_always_n():
    answers = [torch.tensor([5, 5, 9, 2]), torch.tensor([9, 5, 7])]
    assert frequent_tokens(answers, 2, 20).tolist() == [5, 9]
    assert frequent_tokens(answers, 3, 20).tolist() == [2, 5, 9]  # 2 and 7 tie: the lower id
    assert frequent_tokens(answers, 6, 20).tolist() == [0, 1, 2, 5, 7, 9]  # unused ids fill the rest


def test_a_head_with_a_draft_vocabulary_saves_it_and_decodes_losslessly(snapshot_dir, images, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"image": str(images[n]), "prompt": "What is shown?"}) + "\n"
                             for n in ("wide", "tall")))
    out = tmp_path / "head"
    assert export_main(["train-head", "--model", str(model), "--data", str(tasks), "--out", str(out), "--block-size",
                        "6", "--steps", "40", "--lr", "1e-2", "--batch", "2", "--anchors", "8", "--max-new-tokens",
                        "16", "--draft-vocab", "24"]) == 0
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 24
    ids = load_file(str(out / "model.safetensors"))["draft_vocab_ids"]
    assert ids.dtype == torch.int64 and ids.tolist() == sorted(set(ids.tolist())) and len(ids) == 24
    head = load_head(out)
    assert torch.equal(head.draft_vocab_ids, ids)

    config = DecodeConfig(max_new_tokens=16, budget=15)
    report = audit(open_session(Source("torch", model=model, head=out), config), read_tasks(tasks))
    assert report["identical"] == report["n"] == 2 and report["tau"] > 2.0, report

    # exported, the draft projects through draft_vocab.onnx (the N rows and the map to target ids), and ONNX
    # Runtime drafts the trees the torch reference drafts: same tokens, same tau, fp32 and int4 alike
    for form, extra in (("fp32", []), ("int4", ["--quantize", "int4", "--group-size", "32"])):
        art = tmp_path / f"art-{form}"
        assert export_main(["onnx", "--model", str(model), "--head", str(out), "--out", str(art), "--max-tree", "16",
                            "--max-context", "256", "--quiet", *extra]) == 0
        graphs = json.loads((art / "manifest.json").read_text())["graphs"]
        assert graphs["draft_vocab"]["vocab_size"] == 24 and graphs["draft_vocab"]["file"] == "draft_vocab.onnx"
        session = open_session(Source("onnxruntime", artifacts=art), config)
        clock = session.backend.time_graphs()
        exported = audit(session, read_tasks(tasks))
        assert exported["identical"] == exported["n"] == 2, (form, exported)
        if form == "fp32":
            assert exported["tau"] == report["tau"], (exported, report)
        runs = clock.runs()  # a draft projects once; every round drafts but an answer's last with one token left
        assert runs["draft_vocab"] == runs["draft"], runs
        assert exported["rounds"] - exported["n"] <= runs["draft"] <= exported["rounds"], (runs, exported["rounds"])


def test_a_draft_vocabulary_larger_than_the_target_s_is_refused(snapshot_dir, images, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    rc = export_main(["train-head", "--model", str(snapshot_dir("qwen2_5_vl")), "--data", str(tasks), "--out",
                      str(tmp_path / "h"), "--draft-vocab", "10000000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "--draft-vocab 10000000" in err[0]
