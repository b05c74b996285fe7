"""Bad input to the Python API and glance-run ends in one line naming the problem and the fix: a GlanceError
kind from the API (never a TypeError, ZeroDivisionError or RecursionError), one line and exit 2 from the
command. Wrong types of stop strings, prompts, images and counts; images without pixels or closed; messages
nested far past any real conversation; a model's placeholder tokens typed as text; settings that contradict
each other; and image paths that are directories or FIFOs (refused by what they are, never opened)."""
from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

import glance_runtime as gr
from glance_runtime.cli.run import main as run_main
from glance_runtime.errors import GlanceError, InputError
from support import RECEIPT, within

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

DEPTH = 100_000


def one_line(exc: BaseException, kind: type[GlanceError] = InputError) -> str:
    assert isinstance(exc, kind), f"{type(exc).__name__}: {exc}"
    assert str(exc) and "\n" not in str(exc)
    return str(exc)


def refused(call, kind: type[GlanceError] = InputError) -> str:
    """The one-line refusal `call` raises (any other exception, or none, fails the test)."""
    with pytest.raises(GlanceError) as caught:
        call()
    return one_line(caught.value, kind)


@pytest.fixture(scope="module")
def model():
    with gr.load(threads=1) as loaded:
        yield loaded


def _nested_lists(depth: int) -> list:
    deep: list = []
    for _ in range(depth):
        deep = [deep]
    return deep


def _nested_dicts(depth: int) -> dict:
    deep: dict = {}
    for _ in range(depth):
        deep = {"role": "user", "content": [{"type": "text", "text": deep}]}
    return deep


@pytest.mark.parametrize("stop", [5, 2.5, {"a": 1}, [5], [""], ["ok", None], ["\ud800"], "\udfff"])
def test_a_bad_stop_is_refused_in_one_line(model, stop):
    message = refused(lambda: model.generate("What is shown?", stop=stop, max_new_tokens=2))
    assert "stop" in message


def test_good_stops_still_work(model):
    plain = model.generate("What is shown?", max_new_tokens=4)
    for stop in ((), [], "\x00never", ["\x00never", "\x01never"], ("\x00never",)):
        assert model.generate("What is shown?", stop=stop, max_new_tokens=4).token_ids == plain.token_ids


@pytest.mark.parametrize("prompt", ["What is shown?", None, 5, b"ids", np.arange(4)])
def test_check_room_and_reuse_take_only_a_built_prompt(model, prompt):
    assert "model.build" in refused(lambda: model.check_room(prompt))
    assert "model.build" in refused(lambda: model.reuse().decode(prompt, max_new_tokens=2))
    model.check_room(model.build("What is shown?"), 2)


def test_a_closed_pil_image_is_refused(model):
    image = Image.open(RECEIPT)
    image.close()
    assert "PIL image" in refused(lambda: model.generate("What is shown?", images=[image], max_new_tokens=2))


@pytest.mark.parametrize("image", [np.zeros((0, 0, 3), np.uint8), np.zeros((0, 7, 3), np.uint8),
                                   np.zeros((7, 0), np.uint8), Image.new("RGB", (0, 5)), Image.new("L", (5, 0))])
def test_an_image_without_pixels_is_refused(model, image):
    message = refused(lambda: model.generate("What is shown?", images=[image], max_new_tokens=2))
    assert "nothing to see" in message


def test_a_video_frame_without_pixels_is_refused(model):
    frames = [np.zeros((0, 4, 3), np.uint8)] * 2
    assert "nothing to see" in refused(lambda: model.generate("What?", videos=[frames], max_new_tokens=2))


@pytest.mark.parametrize("messages", [
    lambda: [_nested_lists(DEPTH)],
    lambda: _nested_lists(DEPTH),
    lambda: [_nested_dicts(DEPTH)],
    lambda: [{"role": "user", "content": [_nested_lists(DEPTH)]}],
    lambda: [{"role": _nested_lists(DEPTH), "content": "hi"}],
    lambda: [{"role": "user", "content": [{"type": "video", "video": [RECEIPT], "fps": _nested_lists(DEPTH)}]}],
])
def test_deeply_nested_messages_are_refused_without_recursing(model, messages):
    given = messages()
    refused(lambda: model.generate(messages=given, max_new_tokens=2))
    refused(lambda: model.build(messages=given))


def test_deeply_nested_settings_and_system_are_refused_without_recursing(model):
    deep = _nested_lists(DEPTH)
    refused(lambda: model.generate("What is shown?", system=deep, max_new_tokens=2))
    refused(lambda: model.generate("What is shown?", stop=[deep], max_new_tokens=2))
    for setting in ("threads", "branch_k", "max_context", "backend", "speculative"):
        refused(lambda: gr.load(**{setting: deep}))


@pytest.mark.parametrize("count", [np.int64(3), np.int32(3), np.uint8(3), 3])
def test_numpy_integers_are_answer_lengths(model, count):
    out = model.generate("What is shown?", max_new_tokens=count)
    assert out.token_ids == model.generate("What is shown?", max_new_tokens=3).token_ids
    assert model.chat().send("What is shown?", max_new_tokens=count).token_ids == out.token_ids


@pytest.mark.parametrize("count", [True, 3.0, np.float64(3), "3", np.int64(0), -1, None])
def test_other_answer_lengths_are_refused(model, count):
    assert "max_new_tokens" in refused(lambda: model.generate("What is shown?", max_new_tokens=count))


@pytest.mark.parametrize("images", [str(RECEIPT), RECEIPT, {"image": str(RECEIPT)}, np.zeros((8, 8, 3), np.uint8),
                                    RECEIPT.read_bytes(), Image.new("RGB", (8, 8))])
def test_one_image_not_in_a_list_is_refused_as_the_wrong_type(model, images):
    message = refused(lambda: model.generate("What is shown?", images=images, max_new_tokens=2))
    assert "images must be a list" in message and "does not exist" not in message
    assert "images must be a list" in refused(lambda: model.chat().send("What is shown?", images, max_new_tokens=2))
    assert "videos must be a list" in refused(lambda: model.generate("What?", videos=images, max_new_tokens=2))


def test_a_list_of_one_image_path_is_one_image(model):
    one = model.build("What is shown?", images=[str(RECEIPT)])
    assert one.image_grid_thw is not None and len(one.image_grid_thw) == 1
    assert len(model.build("What is shown?", images=(RECEIPT,)).image_grid_thw) == 1


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|video_pad|>"])
def test_a_placeholder_token_in_the_text_is_named_not_blamed_on_the_template(model, token):
    for call in (lambda: model.generate(f"What is {token} here?", max_new_tokens=2),
                 lambda: model.generate(f"What is {token} here?", images=[RECEIPT], max_new_tokens=2),
                 lambda: model.generate("What is shown?", system=f"see {token}", max_new_tokens=2),
                 lambda: model.chat().send(f"{token}", max_new_tokens=2)):
        message = refused(call)
        assert token in message and "placeholder token" in message and "chat template" not in message


def test_vision_markers_without_a_placeholder_are_plain_text(model):
    assert model.generate("What is <|vision_start|><|vision_end|> here?", max_new_tokens=2).token_ids


@pytest.mark.parametrize("settings", [{"budget": 8, "speculative": False}, {"budget": "auto", "speculative": False},
                                      {"budget": 0, "speculative": False}, {"remeasure": True, "speculative": False},
                                      {"remeasure": True, "budget": 8}, {"remeasure": True, "budget": np.int64(0)}])
def test_contradicting_settings_are_refused_by_the_api_and_the_command(settings, capsys):
    message = refused(lambda: gr.load(**settings))
    assert "drop" in message
    argv = ["--prompt", "hi", "--threads", "1"]
    argv += ["--no-spec"] if settings.get("speculative") is False else []
    argv += ["--remeasure"] if settings.get("remeasure") else []
    argv += ["--budget", str(settings["budget"])] if "budget" in settings else []
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop" in err and "Traceback" not in err


def test_settings_that_agree_still_load():
    for settings in ({"speculative": False}, {"remeasure": False, "budget": 8}, {"budget": "auto"}):
        with gr.load(threads=1, **settings) as loaded:
            assert loaded.budget == (0 if settings.get("speculative") is False else settings["budget"])


@pytest.fixture
def not_files(tmp_path):
    """A directory and a FIFO where an image file is expected."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.png"
    folder.mkdir()
    return {"a directory": folder, "a named pipe": fifo}


def test_a_directory_or_fifo_is_named_for_what_it_is_by_the_api(model, not_files):
    for what, path in not_files.items():
        for given in (path, str(path)):
            def call() -> None:
                message = refused(lambda: model.generate("What is shown?", images=[given], max_new_tokens=2))
                assert what in message and "not an image file" in message and "does not exist" not in message
            within(60, call)
        within(60, lambda: refused(lambda: model.generate("What?", videos=[[path, RECEIPT]], max_new_tokens=2)))


def test_a_directory_or_fifo_is_named_for_what_it_is_by_glance_run(not_files, capsys):
    for what, path in not_files.items():
        for flag in ("--image", "--video"):
            codes: list[int] = []
            within(60, lambda: codes.append(run_main(["--prompt", "What is shown?", flag, str(path)])))
            err = capsys.readouterr().err
            assert codes == [2] and what in err and "not an image file" in err and err.count("\n") == 1
