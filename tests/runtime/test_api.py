"""The public API on the embedded default model: the same tokens as glance-run, streaming, stop strings,
conversations that keep their KV, refusals, and close()."""
from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import glance_runtime as gr
from glance_runtime.cli import run as cli
from glance_runtime.prompt.text_stream import TextStream

ROOT = Path(__file__).resolve().parents[2]
RECEIPT = ROOT / "examples" / "demo" / "receipt.png"
CHART = ROOT / "examples" / "demo" / "chart.png"


@pytest.fixture(scope="module")
def model():
    with gr.load() as m:
        yield m


def _glance_run(capsys, *args: str) -> dict:
    assert cli.main(["--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_generate_equals_glance_run(capsys, backend):
    with gr.load(backend=backend) as m:
        for prompt, image in (("What is the total?", RECEIPT), ("Which bar is highest?", CHART), ("Say hello.", None)):
            ran = _glance_run(capsys, "--backend", backend, "--prompt", prompt, *(["--image", str(image)] if image else []))
            out = m.generate(prompt, images=[image] if image else None)
            assert out.token_ids == ran["token_ids"] and out.text == ran["text"]
            assert out.stats["tokens"] == ran["tokens"] and out.stats["budget"] == ran["budget"]
            assert out.stats["prefill_tokens"] == out.stats["prompt_tokens"] > 0


@pytest.mark.edge
@pytest.mark.parametrize("budget", [None, 15])
def test_stream_joins_to_generate(model, budget):
    """The default (auto, whose trees follow this machine's round timings: tokens only), and a fixed budget, whose
    trees and so tau depend on the tokens alone."""
    with gr.load(budget=budget) if budget else contextlib.nullcontext(model) as m:
        out = m.generate("What is the total?", images=[RECEIPT])
        stream = m.stream("What is the total?", images=[RECEIPT])
        assert stream.output is None
        pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == out.text
    assert (stream.output.text, stream.output.token_ids) == (out.text, out.token_ids)
    assert stream.output.stats["finish"] == out.stats["finish"] == "eos"
    if budget:
        assert stream.output.tau == out.tau


@pytest.mark.edge
def test_stream_closed_early_has_no_output_and_frees_the_model(model):
    stream = model.stream("What is the total?", images=[RECEIPT], max_new_tokens=40)
    next(stream)
    stream.close()
    assert stream.output is None and list(stream) == []
    assert model.generate("Hi").text


@pytest.mark.edge
def test_chat_streams_its_turns(model):
    turns = (("What is the total?", [RECEIPT]), ("Is it more than 30?", None), ("Thanks.", None))
    sent = model.chat()
    answers = [sent.send(text, images) for text, images in turns]
    streamed = model.chat()
    for (text, images), out in zip(turns[:2], answers):
        stream = streamed.stream(text, images)
        assert "".join(stream) == out.text and stream.output.token_ids == out.token_ids
        assert stream.output.stats["finish"] == out.stats["finish"]
    assert stream.output.stats["prefill_tokens"] < stream.output.stats["prompt_tokens"] // 2  # kept its KV
    stream = streamed.stream("And the tax?", max_new_tokens=40)
    next(stream)
    stream.close()  # an answer ended early is not part of the conversation
    assert stream.output is None and streamed.messages == sent.messages[:4]
    last = streamed.send(*turns[2])
    assert last.token_ids == answers[2].token_ids and streamed.messages == sent.messages
    assert last.stats["prefill_tokens"] < last.stats["prompt_tokens"]  # the rows of the closed answer's prompt


@pytest.mark.edge
def test_stream_never_splits_a_character():
    """Pieces of an answer with multi-byte characters (CJK, an emoji, a euro sign) are whole characters and
    join to the tokenizer's decode; a stop string spanning pieces ends the text before it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "models" / "glance-vl-tiny" / "tokenizer.json"))
    text = "Total: 42.17€ — 東京 🍣 ünïcødé ✓ done"
    ids = tok.encode(text).ids
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces) and sum(1 for p in pieces if not p) >= 4  # bytes were held
    for stop in ("東京", "€ —", "done", "✓ d"):
        stream = TextStream(tok, [stop, "never"])
        assert "".join([stream.push(i) for i in ids] + [stream.finish()]) == text[:text.index(stop)]


@pytest.mark.edge
def test_stop_strings(model):
    full = model.generate("What is the total?", images=[RECEIPT])
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    assert len(stop) == 2
    out = model.generate("What is the total?", images=[RECEIPT], stop=[stop])
    assert out.text == full.text[:full.text.index(stop)] and out.stats["finish"] == "stop"
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert "".join(model.stream("What is the total?", images=[RECEIPT], stop=[stop])) == out.text


@pytest.mark.edge
def test_chat_keeps_its_kv(model):
    chat = model.chat(system="You are brief.")
    first = chat.send("What is the total?", images=[RECEIPT])
    assert first.stats["prefill_tokens"] == first.stats["prompt_tokens"]
    second = chat.send("Is it more than 30?")
    assert second.stats["prefill_tokens"] < second.stats["prompt_tokens"] // 2  # the image is not prefilled again
    fresh = model.generate(messages=chat.messages[:-1])
    assert second.token_ids == fresh.token_ids and second.text == fresh.text
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[-1]["content"] == second.text
    third = chat.send("And the tax?", stop=["\n"])  # the last call (generate) replaced the rows: no reuse
    assert third.stats["prefill_tokens"] == third.stats["prompt_tokens"]
    fourth = chat.send("Thanks.", images=[CHART])
    assert fourth.stats["prefill_tokens"] < fourth.stats["prompt_tokens"]
    assert fourth.token_ids == model.generate(messages=chat.messages[:-1]).token_ids
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "You are brief."}]


@pytest.mark.edge
def test_several_images_and_kinds(model):
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in (RECEIPT, CHART)]
    by_path = model.generate(messages=[{"role": "user", "content": [
        {"type": "image", "image": RECEIPT}, {"type": "image", "image": CHART}, {"type": "text", "text": "What changed?"}]}])
    by_array = model.generate("What changed?", images=arrays)
    by_bytes = model.generate("What changed?", images=[RECEIPT.read_bytes(), Image.open(CHART)])
    assert by_path.token_ids == by_array.token_ids == by_bytes.token_ids


@pytest.mark.edge
def test_context_overflow_is_refused():
    with gr.load(max_context=256) as m:
        chat = m.chat()
        first = chat.send("What is the total?", images=[RECEIPT], max_new_tokens=8)
        before = chat.messages
        with pytest.raises(gr.LimitError, match=r"context rows .* chat.reset\(\)"):
            chat.send("And this one?", images=[CHART], max_new_tokens=256 - first.stats["prompt_tokens"])
        assert chat.messages == before
        with pytest.raises(gr.LimitError, match="max_context"):
            m.generate("Hi", max_new_tokens=1000)


@pytest.mark.edge
def test_errors_are_glance_errors(model, tmp_path):
    for call, kind in ((lambda: model.generate(), gr.InputError),
                       (lambda: model.generate("Hi", messages=[{"role": "user", "content": "Hi"}]), gr.InputError),
                       (lambda: model.generate("Hi", images=[tmp_path / "missing.png"]), gr.GlanceError),
                       (lambda: model.generate("Hi", max_new_tokens=0), gr.InputError),
                       (lambda: model.generate("Hi", stop=[""]), gr.InputError),
                       (lambda: gr.load(model=tmp_path / "nowhere"), gr.InputError)):
        with pytest.raises(kind) as info:
            call()
        assert isinstance(info.value, gr.GlanceError) and "\n" not in str(info.value)


@pytest.mark.edge
def test_video_needs_a_template_that_renders_it(model):
    """The embedded default's template has no video branch: video is refused with the fix, on one line."""
    with pytest.raises(gr.InputError, match="video branch") as info:
        model.generate("What moves?", videos=[[RECEIPT, CHART]])  # two sizes: the template is refused first
    assert "\n" not in str(info.value)


@pytest.mark.edge
def test_concurrent_calls_are_refused(model):
    stream = model.stream("What is the total?", images=[RECEIPT])
    next(stream)  # the stream now holds the model
    failures = []
    worker = threading.Thread(target=lambda: failures.append(pytest.raises(gr.GlanceError, model.generate, "Hi")))
    worker.start()
    worker.join()
    assert failures and "not thread-safe" in str(failures[0].value)
    stream.close()
    assert model.generate("Hi").text  # usable again once the stream is closed


CYCLES = r"""
import gc, json, sys
from pathlib import Path
import onnxruntime
import glance_runtime as gr

def rss_mb():
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")) / 1024

marks = {}
for i in range(1, int(sys.argv[2]) + 1):
    with gr.load(max_context=256) as model:
        model.generate("Hi", images=[sys.argv[1]] if i % 2 else None, max_new_tokens=2)
    if i in (50, int(sys.argv[2])):
        gc.collect()
        marks[i] = rss_mb()
gc.collect()
print(json.dumps({"rss_mb": list(marks.values()),
                  "sessions": sum(isinstance(o, onnxruntime.InferenceSession) for o in gc.get_objects())}))
"""


@pytest.mark.edge
@pytest.mark.slow  # a thousand load + generate + close cycles
def test_close_frees_buffers():
    """A thousand load + generate + close cycles (every other one with an image, so the vision graph and its
    buffers come and go too) in a fresh process keep its resident memory flat: from cycle 50 to 1000 it may
    grow by allocator noise (measured: 6.5 MB), not by what one cycle holds (its sessions alone are over
    13 MB, its buffers about 1 MB, so a leak of either is hundreds of megabytes); no session outlives its
    model. A closed model refuses calls."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "runtime"), os.environ.get("PYTHONPATH", "")])}
    ran = subprocess.run([sys.executable, "-c", CYCLES, str(RECEIPT), "1000"], capture_output=True, text=True,
                         env=env, timeout=900)
    assert ran.returncode == 0, ran.stderr[-2000:]
    measured = json.loads(ran.stdout.splitlines()[-1])
    after_50, after_1000 = measured["rss_mb"]
    assert after_1000 - after_50 < 40, measured
    assert measured["sessions"] == 0
    m = gr.load()
    m.close()
    with pytest.raises(gr.GlanceError, match="closed"):
        m.generate("Hi")


@pytest.mark.edge
def test_a_turn_ended_by_a_stop_string_keeps_the_kv_consistent(model):
    chat = model.chat()
    full = model.generate("What is the total?", images=[RECEIPT])
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    first = chat.send("What is the total?", images=[RECEIPT], stop=[stop])
    assert first.stats["finish"] == "stop" and chat.messages[-1]["content"] == first.text
    second = chat.send("Is it more than 30?")
    assert 0 < second.stats["prefill_tokens"] < second.stats["prompt_tokens"]
    assert second.token_ids == model.generate(messages=chat.messages[:-1]).token_ids


@pytest.mark.edge
def test_damaged_artifacts_are_an_integrity_error(tmp_path):
    import shutil

    from glance_runtime.defaults import DEFAULT_ARTIFACTS

    copy = shutil.copytree(DEFAULT_ARTIFACTS, tmp_path / "art")
    graph = next(p for p in sorted(copy.glob("*.onnx")))
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    with pytest.raises(gr.IntegrityError, match="sha256"):
        gr.load(artifacts=copy)


@pytest.mark.edge
def test_glance_run_several_images_and_system(model, capsys):
    ran = _glance_run(capsys, "--prompt", "What changed?", "--image", str(RECEIPT), "--image", str(CHART),
                      "--system", "You are brief.")
    out = model.generate("What changed?", images=[RECEIPT, CHART], system="You are brief.")
    assert ran["token_ids"] == out.token_ids and ran["prefill_tokens"] == out.stats["prompt_tokens"]
    assert ran["token_ids"] != _glance_run(capsys, "--prompt", "What changed?", "--image", str(RECEIPT))["token_ids"]


@pytest.mark.edge
def test_glance_run_chat_keeps_the_kv(model, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Is it more than 30?\n/reset\nIs it more than 30?\n/exit\nignored\n"))
    assert cli.main(["--chat", "--prompt", "What is the total?", "--image", str(RECEIPT)]) == 0
    captured = capsys.readouterr()
    prefilled = [line.split("prefilled ")[1] for line in captured.err.splitlines() if "prefilled" in line]
    assert len(prefilled) == 3
    first, follow, after_reset = ([int(x) for x in p.split(" prompt")[0].split(" of ")] for p in prefilled)
    assert first[0] == first[1] and follow[0] < follow[1] and after_reset[0] == after_reset[1] < follow[1]
    chat = model.chat()
    answers = [chat.send("What is the total?", images=[RECEIPT]).text, chat.send("Is it more than 30?").text]
    chat.reset()
    answers.append(chat.send("Is it more than 30?").text)
    assert captured.out.splitlines() == answers
