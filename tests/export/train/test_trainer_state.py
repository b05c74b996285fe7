"""The trainer state beside a head: written without pickle, read back whole, and a damaged one refused in one
line that says to delete or restore it (never unpickled as arbitrary objects, never silently overwritten)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from glance_export.cli import main as export_main
from glance_export.train.checkpoint import PICKLED_FILE, STATE_FILE, capture, load_state, restore, writer
from glance_export.train.head_trainer import _schedule
from glance_runtime.errors import GlanceError


def trained(steps: int = 2, seed: int = 0):
    """A small parameter set, its AdamW and schedule after `steps` steps."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    sched = _schedule(opt, 10)
    for _ in range(steps):
        opt.zero_grad()
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
        sched.step()
    return params, opt, sched


def assert_same(a: dict, b: dict) -> None:
    """Two optimizers' per-parameter state, tensor for tensor."""
    assert a.keys() == b.keys()
    for index in a:
        assert a[index].keys() == b[index].keys()
        assert all(torch.equal(a[index][key], b[index][key]) for key in a[index]), index


def plain(groups: list[dict]) -> list[dict]:
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def test_the_state_round_trips_without_pickle(tmp_path):
    _, opt, sched = trained()
    writer(capture("sig", 2, opt, sched))(tmp_path)
    assert not (tmp_path / STATE_FILE).read_bytes().startswith(b"PK")  # not torch.save's zipped pickle
    assert load_state(tmp_path, "another run") is None
    state = load_state(tmp_path, "sig")
    _, fresh_opt, fresh_sched = trained(steps=0)
    assert restore(state, fresh_opt, fresh_sched) == 2
    assert_same(fresh_opt.state_dict()["state"], opt.state_dict()["state"])
    assert plain(fresh_opt.state_dict()["param_groups"]) == plain(opt.state_dict()["param_groups"])
    assert fresh_sched.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"] == 2
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_a_state_in_the_earlier_pickled_form_is_still_read(tmp_path):
    _, opt, sched = trained()
    torch.save({"signature": "sig", "step": 2, "opt": opt.state_dict(), "sched": sched.state_dict()},
               tmp_path / PICKLED_FILE)
    _, fresh_opt, fresh_sched = trained(steps=0)
    assert restore(load_state(tmp_path, "sig"), fresh_opt, fresh_sched) == 2
    assert_same(fresh_opt.state_dict()["state"], opt.state_dict()["state"])


class Payload:
    """Unpickling this would run code: a state must never be read that way."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def damage(tmp_path, how: str):
    _, opt, sched = trained()
    if how == "pickle-with-code":
        torch.save({"signature": "sig", "step": 2, "opt": Payload(str(tmp_path / "ran")), "sched": {}},
                   tmp_path / PICKLED_FILE)
        return tmp_path / PICKLED_FILE
    if how.startswith("pickle"):
        path = tmp_path / PICKLED_FILE
        torch.save({"signature": "sig", "step": 2, "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    else:
        path = tmp_path / STATE_FILE
        writer(capture("sig", 2, opt, sched))(tmp_path)
    data = path.read_bytes()
    if how.endswith("random"):
        path.write_bytes(os.urandom(len(data)))
    elif how.endswith("truncated"):
        path.write_bytes(data[:len(data) // 2])
    elif how.endswith("empty"):
        path.write_bytes(b"")
    return path


@pytest.mark.parametrize("how", ["random", "truncated", "empty", "pickle-random", "pickle-truncated", "pickle-empty",
                                 "pickle-with-code"])
def test_a_damaged_state_is_refused_in_one_line(how, tmp_path):
    path = damage(tmp_path, how)
    with pytest.raises(GlanceError) as refused:
        load_state(tmp_path, "sig")
    line = str(refused.value)
    assert line.startswith(f"cannot read trainer state {path}") and "delete it" in line and "\n" not in line, line
    assert not (tmp_path / "ran").exists()


def test_a_state_with_edited_fields_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, opt, sched = trained()
    writer(capture("sig", 2, opt, sched))(tmp_path)
    with safe_open(str(tmp_path / STATE_FILE), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    rest = json.loads(meta["state"])
    rest["step"] = "two"
    save_file(tensors, str(tmp_path / STATE_FILE), metadata={**meta, "state": json.dumps(rest)})
    with pytest.raises(GlanceError, match="cannot read trainer state"):
        load_state(tmp_path, "sig")


def test_a_state_of_other_shapes_is_refused_at_restore(tmp_path):
    _, opt, sched = trained()
    writer(capture("sig", 2, opt, sched))(tmp_path)
    other = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(5))]
    other_opt = torch.optim.AdamW(other, lr=1e-2)
    with pytest.raises(GlanceError, match="does not fit the head beside it"):
        restore(load_state(tmp_path, "sig"), other_opt, _schedule(other_opt, 10))


def test_train_head_refuses_a_damaged_state_and_keeps_it(snapshot_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Count to five.", "Name a colour.")))
    out = tmp_path / "head"
    argv = ["train-head", "--model", str(snapshot_dir("qwen2_5_vl")), "--data", str(tasks), "--out", str(out),
            "--block-size", "4", "--steps", "3", "--batch", "2", "--anchors", "2", "--max-new-tokens", "6",
            "--checkpoint-every", "1", "--time-budget", "0", "--threads", "1"]
    assert export_main(argv) == 0
    assert "time budget reached after 1 steps" in capsys.readouterr().out and (out / STATE_FILE).is_file()
    garbage = os.urandom(256)
    (out / STATE_FILE).write_bytes(garbage)
    assert export_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read trainer state" in err[0] and "delete it" in err[0], err
    assert (out / STATE_FILE).read_bytes() == garbage
