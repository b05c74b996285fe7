"""train-head --arch eagle3: the training-time test's unrolled rows equal the head run row by row as it drafts, a
short run on a tiny target lowers the loss and writes the published EAGLE-3 layout, resumes, trains from
prepared data of its own taps only, and settings of the other head kind are refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glance_export.audit.greedy_audit import audit
from glance_export.cli import main as export_main
from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import default_aux_layers, eagle3_config_for, init_eagle3, load_eagle3
from glance_export.train.eagle3_loss import make_eagle3_batch, ttt_logits, ttt_loss, ttt_visibility
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.loop import DecodeConfig
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime.formats.tasks import read as read_tasks
from support import image_tasks

STEPS = 3
MODELS = Path(__file__).resolve().parents[3] / "models"


def cli(argv: list) -> int:
    return export_main([str(a) for a in argv])


@pytest.fixture(scope="module")
def task_file(images, tmp_path_factory):
    return image_tasks(images, tmp_path_factory.mktemp("eagle3_train"))


def small_head(model, draft_vocab: int | None = None, layers: int = 1):
    """An untrained head with weights wide enough (std 0.2) that a wrong mask or input moves the logits."""
    cfg = eagle3_config_for(Snapshot(model), draft_vocab, layers)
    return init_eagle3(cfg, seed=3, draft_ids=torch.arange(0, 2 * draft_vocab, 2) if draft_vocab else None, std=0.2)


def row_by_row(head, embed, ids, taps, row: int, steps: int) -> list[torch.Tensor]:
    """Row `row`'s logits at steps 0..steps-1 as drafting computes them: the committed rows 0..row causally
    (default mask), then one row per step on the cache of everything before it, with its parent's output."""
    with torch.no_grad():
        rows = torch.arange(row + 1)
        normed, prenorm, past = head(embed(ids[1:row + 2])[None], head.fuse(taps[:row + 1])[None],
                                     rows[None, None].expand(3, 1, -1))
        out, hidden = [head.logits(normed[0, row])], prenorm[:, row:row + 1]
        for j in range(1, steps):
            position = torch.tensor([row + j])[None, None].expand(3, 1, 1)
            normed, hidden, new = head(embed(ids[row + 1 + j:row + 2 + j])[None], hidden, position, past)
            past = [(torch.cat([pk, k], 2), torch.cat([pv, v], 2)) for (pk, pv), (k, v) in zip(past, new)]
            out.append(head.logits(normed[0, 0]))
    return out


@pytest.mark.parametrize("layers", [1, 2])
def test_unrolled_steps_equal_the_head_run_row_by_row(snapshot_dir, layers):
    model = snapshot_dir("qwen2_5_vl")
    head = small_head(model, layers=layers)
    gen = torch.Generator().manual_seed(0)
    vocab, width = head.config.vocab_size, head.fc.in_features
    embed = torch.nn.Embedding(vocab, head.config.hidden_size)
    torch.nn.init.normal_(embed.weight, std=1.0, generator=gen)
    seqs = [torch.randint(vocab, (length,), generator=gen) for length in (12, 9)]
    taps = [torch.randn(len(s), width, generator=gen) for s in seqs]
    batch = make_eagle3_batch(seqs, taps, [4, 3])
    with torch.no_grad():
        unrolled = ttt_logits(head, embed, batch.ids, batch.taps, STEPS)
    for b, (ids, tap) in enumerate(zip(seqs, taps)):
        for row in range(len(ids) - STEPS - 1):  # rows whose every step reads a real token
            expected = row_by_row(head, embed, ids, tap, row, STEPS)
            for j in range(STEPS):
                torch.testing.assert_close(unrolled[j][b, row], expected[j], atol=1e-5, rtol=1e-4)
    # the mask: causal over step 0's keys, then only the row's own key of every later step
    assert ttt_visibility(3, 2).int().tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0],
                                                   [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_loss_scores_answer_rows_only_and_learns_no_token_outside_the_draft_vocabulary(snapshot_dir):
    model = snapshot_dir("qwen2_5_vl")
    head = small_head(model, draft_vocab=16)  # the even ids 0..30
    with torch.random.fork_rng():  # the embedding's draw, not the tests run before this one, decides the hits
        torch.manual_seed(0)
        embed = torch.nn.Embedding(head.config.vocab_size, head.config.hidden_size)
    ids = torch.tensor([5, 7, 9, 2, 4, 6, 8, 3, 10, 12])  # answer from row 4; the odd 3 cannot be drafted
    taps = torch.randn(len(ids), head.fc.in_features, generator=torch.Generator().manual_seed(1))
    stats = ttt_loss(head, embed, make_eagle3_batch([ids], [taps], [4]), STEPS, 0.8)
    # step j scores labels at rows 5..9 that row i + 2 + j reaches: 5 rows at every step here
    assert stats.counts.tolist() == [5, 5, 5]
    stats.loss.backward()
    assert head.fc.weight.grad.abs().sum() > 0 and torch.isfinite(stats.loss)
    # a label outside the draft vocabulary is scored a miss and learnt from nowhere: which one it is (the last
    # token, which no scored row reads as input) does not move the loss
    losses = []
    for last in (1, 3):
        changed = ids.clone()
        changed[-1] = last
        losses.append(ttt_loss(head, embed, make_eagle3_batch([changed], [taps], [4]), STEPS, 0.8))
    assert losses[0].loss == losses[1].loss and losses[0].hits[0] == 0


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss_and_writes_the_published_layout(snapshot_dir, task_file, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    out = tmp_path / "head"
    assert cli(["train-head", "--arch", "eagle3", "--model", model, "--data", task_file, "--out", out,
                        "--steps", "40", "--lr", "1e-2", "--batch", "3", "--max-new-tokens", "16",
                        "--draft-vocab", "24", "--log-every", "10", "--eval-data", task_file, "--eval-budget", "31",
                        "--threads", "1"]) == 0
    log = capsys.readouterr().out
    assert "unrolled 7 steps" in log and "step 40/40" in log and "drafting over the 24 tokens" in log
    records = metrics(out)
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert records[-1]["loss"] < 0.5 * records[0]["loss"] and len(records[-1]["accuracy"]) == 7
    # held-out acceptance is the real loop on the torch reference's step drafter: the audit finds the same tau
    held_out = records[-1]["held_out"]
    report = audit(open_session(Source("torch", model=model, head=out), DecodeConfig(max_new_tokens=16, budget=31)),
                   read_tasks(task_file))
    assert report["identical"] == report["n"] == 3 and held_out["tau"]["31"] == pytest.approx(report["tau"], abs=1e-3)
    assert len(held_out["accept"]) == EAGLE3_DEPTH and held_out["accept"][0] > 0

    config = json.loads((out / "config.json").read_text())
    depth = Snapshot(model).text_config["num_hidden_layers"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 24
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == default_aux_layers(depth)
    keys = set(load_file(str(out / "model.safetensors")))
    layer = {f"midlayer.{k}.weight" for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                              "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert keys == layer | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}  # embeddings borrowed
    head = load_eagle3(out)
    targets = head.target_ids(torch.arange(24))
    assert head.t2d.sum() == 24 and head.t2d[targets].all() and "EAGLE-3 draft head" in (out / "README.md").read_text()
    assert not (out / "trainer_state.safetensors").exists()


def test_an_interrupted_run_resumes_where_it_stopped(snapshot_dir, task_file, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    out = tmp_path / "head"
    argv = ["train-head", "--arch", "eagle3", "--model", model, "--data", task_file, "--out", out, "--steps", "4",
            "--batch", "2", "--max-new-tokens", "8", "--log-every", "1", "--threads", "1"]
    assert cli(argv + ["--time-budget", "0"]) == 0
    assert (out / "trainer_state.safetensors").exists() and [r["step"] for r in metrics(out)] == [1]
    capsys.readouterr()
    assert cli(argv) == 0
    assert "resuming from the checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4] and not (out / "trainer_state.safetensors").exists()


def test_prepared_data_must_hold_the_eagle3_taps(snapshot_dir, task_file, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    prepared = {}
    for arch in ("glance", "eagle3"):
        prepared[arch] = tmp_path / f"prep_{arch}"
        assert cli(["prepare-head-data", "--arch", arch, "--model", model, "--data", task_file, "--out",
                            prepared[arch], "--max-new-tokens", "8", "--threads", "1"]) == 0
    depth = Snapshot(model).text_config["num_hidden_layers"]
    assert json.loads((prepared["eagle3"] / "index.json").read_text())["target_layer_ids"] == default_aux_layers(depth)
    train = ["train-head", "--arch", "eagle3", "--model", model, "--steps", "2", "--batch", "2", "--threads", "1"]
    assert cli(train + ["--prepared", prepared["eagle3"], "--out", tmp_path / "h"]) == 0
    assert load_eagle3(tmp_path / "h").config.aux_layer_ids == default_aux_layers(depth)
    capsys.readouterr()
    assert cli(train + ["--prepared", prepared["glance"], "--out", tmp_path / "h2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prepare-head-data --arch eagle3" in err[0] and not (tmp_path / "h2").exists()


@pytest.mark.parametrize("argv, named", [
    (["--arch", "eagle3", "--block-size", "8"], "--block-size"),
    (["--arch", "eagle3", "--anchors", "4", "--gamma", "3"], "--anchors and --gamma"),
    (["--ttt-steps", "3"], "--ttt-steps"),
    (["--arch", "eagle3", "--ttt-steps", "8"], "--ttt-steps"),
    (["--arch", "eagle3", "--ttt-decay", "1.5"], "--ttt-decay"),
    (["--arch", "eagle3", "--ttt-decay", "0"], "--ttt-decay"),
    (["--arch", "medusa"], "--arch"),
])
def test_settings_of_the_other_head_kind_are_refused(argv, named, task_file, tmp_path, capsys):
    out = tmp_path / "out"
    try:
        code = cli(["train-head", "--model", tmp_path / "model", "--data", task_file, "--out", out, *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


def test_a_head_of_the_other_kind_is_not_resumed(snapshot_dir, task_file, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    assert cli(["init-head", "--model", model, "--out", tmp_path / "glance", "--block-size", "4"]) == 0
    capsys.readouterr()
    assert cli(["train-head", "--arch", "eagle3", "--model", model, "--data", task_file, "--out",
                        tmp_path / "out", "--resume", tmp_path / "glance"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a glance head but --arch is eagle3" in err[0]
    assert cli(["prepare-head-data", "--arch", "eagle3", "--layers", "2", "--model", model, "--data",
                        task_file, "--out", tmp_path / "prep"]) == 2
    assert "drop --layers" in capsys.readouterr().err


def test_the_shipped_head_drafts_for_the_embedded_target_losslessly():
    """models/glance-vl-tiny-eagle3 loads as published, fits the embedded target and accepts long drafts."""
    head = load_eagle3(MODELS / "glance-vl-tiny-eagle3")
    assert head.embed_tokens is None and head.config.aux_layer_ids == default_aux_layers(4)
    tasks = read_tasks(MODELS.parent / "examples" / "receipt" / "tasks.jsonl")[:3]
    session = open_session(Source("torch", model=MODELS / "glance-vl-tiny", head=MODELS / "glance-vl-tiny-eagle3"),
                           DecodeConfig(max_new_tokens=32, budget=15))
    report = audit(session, tasks)
    assert report["identical"] == report["n"] == 3 and report["tau"] > 2.5, report
