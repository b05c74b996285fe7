"""The reduced draft vocabulary an export gives a head trained without one: the tokenizer's added tokens and its
tokens in merge order, by default above a large vocabulary only, on request at any size; its coverage of the
answers is what the audit reports. The answers never change: only the drafts' vocabulary does."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from glance_export.audit.greedy_audit import audit
from glance_export.cli import main as export_main
from glance_export.model.adapters import Snapshot
from glance_export.model.vocab_choice import DEFAULT_SIZE, LARGE_VOCAB, frequent_ids, merge_ranks
from glance_export.onnx import export_artifacts
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.session import Settings
from glance_runtime.errors import GlanceError
from glance_runtime.formats import artifacts as artifacts_format
from glance_runtime.formats.draft_ids import graph_ids
from glance_runtime.formats.tasks import Task
from support import make_wide_snapshot, tiny_head

HAND = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "abc": 3, "bc": 4, "ab": 5},
                  "merges": ["a b", "ab c", "b c"]},
        "added_tokens": [{"id": 6, "content": "<end>"}]}


def _tokenizer(snapshot) -> dict:
    return json.loads(Snapshot(snapshot).tokenizer.backend_tokenizer.to_str())


def test_tokens_rank_by_the_merge_that_makes_them_after_the_alphabet():
    ranks, added = merge_ranks(HAND)
    assert ranks == {0: -3, 1: -2, 2: -1, 5: 0, 3: 1, 4: 2} and added == [6]
    listed = {**HAND, "model": {**HAND["model"], "merges": [["a", "b"], ["ab", "c"], ["b", "c"]]}}
    assert merge_ranks(listed) == (ranks, added)  # newer tokenizers list a merge's two sides
    # the added token and a stop id first, then by rank, then the lowest ids past the tokenizer's vocabulary
    assert frequent_ids(HAND, 9, 4).tolist() == [0, 1, 2, 6]
    assert frequent_ids(HAND, 9, 5, keep=[8]).tolist() == [0, 1, 2, 6, 8]
    assert frequent_ids(HAND, 9, 6).tolist() == [0, 1, 2, 3, 5, 6]
    assert frequent_ids(HAND, 9, 9).tolist() == list(range(9))


def test_a_tokenizer_without_merges_is_named():
    with pytest.raises(GlanceError, match="not a BPE tokenizer.*--draft-vocab all") as err:
        merge_ranks({"model": {"type": "WordPiece", "vocab": {"a": 0}}})
    assert "\n" not in str(err.value)


def test_the_choice_on_a_real_tokenizer(snapshot_dir):
    snapshot = snapshot_dir("qwen3")
    tokenizer = _tokenizer(snapshot)
    ranks, added = merge_ranks(tokenizer)
    vocab = Snapshot(snapshot).text_config["vocab_size"]
    ids = frequent_ids(tokenizer, vocab, 64, keep=Snapshot(snapshot).stop_token_ids)
    assert len(ids) == 64 == len(set(ids.tolist())) and (np.diff(ids) > 0).all()
    assert set(added) | set(Snapshot(snapshot).stop_token_ids) <= set(ids.tolist())
    chosen = [t for t in ids.tolist() if t not in added]
    left = [t for t in ranks if t not in ids]
    assert max(ranks[t] for t in chosen) <= min(ranks[t] for t in left)  # none left out ranks before one chosen
    # the tokenizer's rank is its merges' order: a merged token's parts both rank before it
    model = Tokenizer.from_str(json.dumps(tokenizer)).get_vocab()
    first = tokenizer["model"]["merges"][0]
    left_part, right_part = first.split(" ", 1) if isinstance(first, str) else first
    assert ranks[model[left_part + right_part]] == 0 and ranks[model[left_part]] < 0


def test_an_export_asked_for_n_tokens_drafts_over_those(snapshot_dir, tmp_path):
    snapshot = snapshot_dir("qwen3")
    head = tiny_head(snapshot, tmp_path / "head")
    lines = []
    out = export_artifacts(snapshot, head, tmp_path / "art", max_tree=8, max_context=64, draft_vocab=40,
                           progress=lines.append)
    manifest = artifacts_format.read(out)
    expected = frequent_ids(_tokenizer(snapshot), manifest.vocab_size, 40, Snapshot(snapshot).stop_token_ids)
    assert manifest.draft_vocab_size == 40 and graph_ids(out / "draft_vocab.onnx").tolist() == expected.tolist()
    assert any(line.startswith("the head drafts over 40 of the target's") for line in lines)
    tasks = [Task("What colour is the square?"), Task("Read the total: 42.17")]
    session = open_session(Source(backend="onnxruntime", artifacts=out), Settings(budget=7, max_new_tokens=12))
    report = audit(session, tasks)
    answers = [session.reference(session.prompt(t.prompt)) for t in tasks]
    tokens = np.concatenate(answers)
    assert report["passed"] and report["draft_vocab"] == {
        "size": 40, "coverage": round(float(np.isin(tokens, expected).mean()), 4)}
    # by default a small vocabulary is drafted whole, as before
    whole = export_artifacts(snapshot, head, tmp_path / "whole", max_tree=8, max_context=64, progress=lambda _: None)
    assert artifacts_format.read(whole).draft_vocab_size is None and not (whole / "draft_vocab.onnx").exists()
    assert audit(open_session(Source(backend="onnxruntime", artifacts=whole), Settings(budget=7, max_new_tokens=4)),
                 tasks[:1])["draft_vocab"] is None


def test_a_large_vocabulary_gets_a_reduced_draft_vocabulary_by_default(tmp_path):
    snapshot = make_wide_snapshot(tmp_path / "snap", "qwen3", {"hidden_size": 64, "vocab_size": LARGE_VOCAB + 8})
    head = tiny_head(snapshot, tmp_path / "head")
    out = export_artifacts(snapshot, head, tmp_path / "art", max_tree=8, max_context=64, progress=lambda _: None)
    manifest = artifacts_format.read(out)
    assert manifest.draft_vocab_size == DEFAULT_SIZE and manifest.vocab_size == LARGE_VOCAB + 8
    ids = graph_ids(out / "draft_vocab.onnx")
    assert set(Snapshot(snapshot).stop_token_ids) <= set(ids.tolist())
    rc = export_main(["onnx", "--model", str(snapshot), "--head", str(head), "--out", str(tmp_path / "all"),
                      "--max-tree", "8", "--max-context", "64", "--draft-vocab", "all", "--quiet"])
    assert rc == 0 and artifacts_format.read(tmp_path / "all").draft_vocab_size is None


def test_a_head_with_its_own_vocabulary_keeps_it(snapshot_dir, tmp_path, capsys):
    snapshot = snapshot_dir("qwen3")
    head = tiny_head(snapshot, tmp_path / "head", draft_vocab=32)
    out = export_artifacts(snapshot, head, tmp_path / "art", max_tree=8, max_context=64, draft_vocab=32,
                           progress=lambda _: None)
    assert artifacts_format.read(out).draft_vocab_size == 32
    rc = export_main(["onnx", "--model", str(snapshot), "--head", str(head), "--out", str(tmp_path / "other"),
                      "--draft-vocab", "48"])
    err = capsys.readouterr().err
    assert rc != 0 and "drafts over its own 32 tokens" in err and "Traceback" not in err
    assert not (tmp_path / "other").exists()
