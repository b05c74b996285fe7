"""Training data in the formats users have: TASKS.jsonl, LLaVA JSON/JSONL and OpenAI messages JSONL, several
images and turns a row, image paths relative to the file; unusable rows counted, too many refused."""
from __future__ import annotations

import json
import shutil

import pytest

from glance_export.cli import main as export_main
from glance_export.train.data_files import Tally, read_samples
from glance_runtime.errors import GlanceError


@pytest.fixture
def data_dir(images, tmp_path):
    (tmp_path / "img").mkdir()
    for name in ("wide", "tall"):
        shutil.copy(images[name], tmp_path / "img" / f"{name}.png")
    return tmp_path


def _llava_row(n_turns=2):
    turns = [{"from": "human", "value": "<image>\nWhat is left? <image> And right?"}, {"from": "gpt", "value": "A."}]
    turns += [{"from": "human", "value": "More?"}, {"from": "gpt", "value": "B."}][:2 * (n_turns - 1)]
    return {"image": ["img/wide.png", "img/tall.png"], "conversations": turns}


def _openai_row():
    return {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "img/wide.png"}},
                                                      {"type": "text", "text": "Colour?"}]},
                         {"role": "assistant", "content": "Red."},
                         {"role": "user", "content": [{"type": "image", "image": "img/tall.png"},
                                                      {"type": "text", "text": "And this one?"}]},
                         {"role": "assistant", "content": "Blue."}]}


def test_each_assistant_turn_is_a_sample_with_the_turns_before_it_as_written(data_dir):
    (data_dir / "llava.json").write_text(json.dumps([_llava_row()]))
    (data_dir / "chat.jsonl").write_text(json.dumps(_openai_row()) + "\n")
    (data_dir / "tasks.jsonl").write_text(json.dumps({"prompt": "What is shown?", "image": "img/wide.png"}) + "\n")
    tally = Tally()
    samples = read_samples([data_dir / "llava.json", data_dir / "chat.jsonl", data_dir / "tasks.jsonl"], tally)
    assert tally.rows == 3 and tally.bad == 0
    assert len(samples) == 5  # 2 LLaVA turns, 2 OpenAI turns, 1 task
    first, second = samples[0].messages, samples[1].messages
    parts = first[0]["content"]
    assert [p["type"] for p in parts] == ["image", "text", "image", "text"]
    assert parts[0]["image"] == str(data_dir / "img" / "wide.png") and parts[2]["image"].endswith("tall.png")
    assert len(first) == 1 and [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "A."  # earlier turns stay as written
    chat = samples[3].messages
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user"]
    assert chat[3]["content"][0] == {"type": "image", "image": str(data_dir / "img" / "tall.png")}
    assert samples[4].messages[0]["content"][0]["image"] == str(data_dir / "img" / "wide.png")


def test_bad_rows_are_counted_with_reasons_and_too_many_refused(data_dir):
    good = [json.dumps(_llava_row(1))] * 9
    bad_image = dict(_llava_row(1), image="img/missing.png")
    bad_image["conversations"][0]["value"] = "<image> What?"
    rows = good + [json.dumps(bad_image)]
    (data_dir / "ten.jsonl").write_text("\n".join(rows) + "\n")
    tally = Tally()
    assert len(read_samples([data_dir / "ten.jsonl"], tally)) == 9
    assert tally.bad == 1 and "missing.png does not exist" in tally.summary()
    tally.check()  # 1 of 10 is allowed

    no_user = {"messages": [{"role": "assistant", "content": "hi"}]}
    url = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}
    (data_dir / "worse.jsonl").write_text("\n".join([json.dumps(no_user), json.dumps(url), "{not json"] + good) + "\n")
    tally = Tally()
    read_samples([data_dir / "worse.jsonl"], tally)
    assert tally.bad == 3 and tally.rows == 12
    summary = tally.summary()
    assert "before any user turn" in summary and "nothing is downloaded" in summary and "not JSON" in summary
    with pytest.raises(GlanceError, match="3 of 12 training rows cannot be used"):
        tally.check()


def test_train_head_on_llava_and_openai_files_together(snapshot_dir, data_dir, capsys):
    (data_dir / "llava.jsonl").write_text(json.dumps(_llava_row()) + "\n")
    (data_dir / "chat.jsonl").write_text(json.dumps(_openai_row()) + "\n")
    out = data_dir / "head"
    assert export_main(["train-head", "--model", str(snapshot_dir("qwen2_5_vl")), "--data", str(data_dir / "llava.jsonl"),
                        "--data", str(data_dir / "chat.jsonl"), "--out", str(out), "--block-size", "4", "--steps", "2",
                        "--batch", "2", "--anchors", "4", "--max-new-tokens", "8", "--gen-batch", "3"]) == 0
    log = capsys.readouterr().out
    assert "read 2 rows, skipped 0" in log and "on 4 sequences" in log and "step 2/2" in log
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("device, words", [("cuda:99", "cuda:99"), ("tpu", "pass cpu, cuda")])
def test_a_device_this_machine_cannot_train_on_is_refused_in_one_line(snapshot_dir, data_dir, capsys, device, words):
    (data_dir / "tasks.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    rc = export_main(["train-head", "--model", str(snapshot_dir("qwen2_5_vl")), "--data", str(data_dir / "tasks.jsonl"),
                      "--out", str(data_dir / "head"), "--steps", "1", "--device", device])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and words in err[0] and "--device" in err[0], err
    assert not (data_dir / "head").exists()
