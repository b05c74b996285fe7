"""One picture file, one answer on every surface: the demo chart saved in every mode Pillow can save (bilevel,
grey, grey with alpha or a transparent grey, palettes with and without a transparent entry, palette with
alpha, RGB with and without a transparent colour, RGBA, CMYK, YCbCr, LAB, 16-bit greys little- and
big-endian, with and without a transparent value, 32-bit integer greys in the 16-bit and the full range, float
greys) is answered with the Python API's tokens by glance-run, by glance-serve given it as a data URL and as
a file:// path, by the API given the file's bytes or the opened image, and through the Triton model's image
decoding (starting tritonserver is too slow for the default run; tests/export/triton runs it).

Each file is made so that a conversion that ignores its encoding shows another picture (transparent
background over black, greys scaled wrong), and the shipped model answers such a picture otherwise. The
pictures themselves are checked too: a file whose encoding is lossless shows exactly the chart (or its grey)."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

import glance_runtime as gr
from glance_runtime.prompt.images import to_rgb
from support import MODEL_NAME, REPO, data_url, glance_run, start_server, user

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

CHART = REPO / "examples" / "demo" / "chart.png"
PROMPT = json.loads((REPO / "examples" / "demo" / "prompts.json").read_text())["chart.png"]
MAX_NEW = 24
REQUEST_TIMEOUT_S = 120


def _pictures() -> tuple[np.ndarray, np.ndarray]:
    """The chart as RGB, and as grey with black lifted to 1 (so black can mark the transparent background)."""
    with Image.open(CHART) as chart:
        return np.asarray(chart.convert("RGB")), np.maximum(np.asarray(chart.convert("L")), 1)


def _modes() -> dict[str, tuple[Image.Image, str, dict, str | None]]:
    """name -> (the picture in that mode, the format it is saved in, save options, the picture the file shows
    exactly: "colour", "grey", or None where its encoding is lossy). The chart's white background is made
    transparent over black, or over a colour marked transparent, where the mode can say so."""
    rgb, grey = _pictures()
    background = (rgb == 255).all(axis=2)
    clear = np.where(background, 0, 255).astype(np.uint8)
    on_black = np.where(background[..., None], 0, rgb).astype(np.uint8)
    grey_on_black = np.where(background, 0, grey).astype(np.uint8)
    assert not (rgb == (1, 2, 3)).all(axis=2).any()
    marked = np.where(background[..., None], np.uint8([1, 2, 3]), rgb).astype(np.uint8)
    assert background[0, 0]  # the corner marks the palette's transparent entry
    palette = Image.fromarray(marked).convert("P", palette=Image.Palette.ADAPTIVE, colors=256)
    rgba = Image.fromarray(np.dstack([on_black, clear]), "RGBA")
    wide = grey.astype(np.uint16) * 257
    return {
        "1": (Image.fromarray(grey).convert("1"), "png", {}, None),
        "L": (Image.fromarray(grey), "png", {}, "grey"),
        "LA": (Image.fromarray(np.dstack([grey_on_black, clear]), "LA"), "png", {}, "grey"),
        "L transparent": (Image.fromarray(grey_on_black), "png", {"transparency": 0}, "grey"),
        "P": (Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=256), "png", {}, "colour"),
        "P transparent": (palette, "png", {"transparency": palette.getpixel((0, 0))}, "colour"),
        "PA": (rgba.convert("PA"), "tiff", {}, "colour"),
        "RGB": (Image.fromarray(rgb), "png", {}, "colour"),
        "RGB transparent": (Image.fromarray(marked), "png", {"transparency": (1, 2, 3)}, "colour"),
        "RGBA": (rgba, "png", {}, "colour"),
        "CMYK": (Image.fromarray(rgb).convert("CMYK"), "tiff", {}, "colour"),
        "YCbCr": (Image.fromarray(rgb).convert("YCbCr"), "tiff", {}, None),
        "LAB": (Image.fromarray(rgb).convert("LAB"), "tiff", {}, None),
        "I;16": (Image.fromarray(wide), "png", {}, "grey"),
        "I;16 transparent": (Image.fromarray(np.where(background, 0, wide).astype(np.uint16)), "png",
                             {"transparency": 0}, "grey"),
        "I;16B": (Image.frombytes("I;16B", grey.shape[::-1], wide.astype(">u2").tobytes()), "tiff", {}, "grey"),
        "I 16-bit range": (Image.fromarray(wide.astype(np.int32)), "tiff", {}, "grey"),
        "I full range": (Image.fromarray((grey.astype(np.int64) * (2**31 - 1) // 255).astype(np.int32)), "tiff", {},
                         "grey"),
        "F": (Image.fromarray(grey.astype(np.float32) / 255), "tiff", {}, "grey"),
    }


MODES = list(_modes())
LOSSLESS = [mode for mode, (*_, shows) in _modes().items() if shows is not None]
BLIND = ["LA", "L transparent", "P transparent", "PA", "RGB transparent", "RGBA", "I;16", "I;16 transparent", "I;16B",
         "I 16-bit range", "I full range", "F"]  # the modes Pillow's convert("RGB") shows otherwise
MIME = {"png": "image/png", "tiff": "image/tiff"}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """name -> (the file, the picture it shows exactly or None), every file in one media directory."""
    root = tmp_path_factory.mktemp("modes")
    out = {}
    for i, (name, (image, fmt, options, shows)) in enumerate(_modes().items()):
        path = root / f"{i:02d}.{fmt}"
        image.save(path, **options)
        with Image.open(path) as saved:  # the file holds the mode it was made in
            assert saved.mode == image.mode, (name, saved.mode)
        out[name] = (path, shows)
    return out


@pytest.fixture(scope="module")
def model():
    with gr.load(threads=1) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def api(model, files) -> dict[str, gr.Output]:
    """The Python API's answer to the chart question, for each file by its path."""
    return {name: model.generate(PROMPT, images=[path], max_new_tokens=MAX_NEW) for name, (path, _) in files.items()}


@pytest.fixture(scope="module")
def server(files):
    srv = start_server("--media-dir", str(next(iter(files.values()))[0].parent))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def triton_model():
    """The Triton model file as `glance-export triton` copies it. Triton's stub module is needed only to import it
    (its image decoding never calls it), so an empty one stands in while it is imported."""
    spec = importlib.util.spec_from_file_location("glance_triton_model", REPO / "glance_export" / "triton" /
                                                  "python_model.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
        spec.loader.exec_module(module)
    return module


def _ask(server, url: str) -> dict:
    body = {"model": MODEL_NAME, "messages": user(PROMPT, url), "max_tokens": MAX_NEW}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def _same_answer(reply: dict, want: gr.Output) -> None:
    assert reply["choices"][0]["message"]["content"] == want.text
    assert reply["usage"]["completion_tokens"] == len(want.token_ids)


@pytest.mark.parametrize("mode", LOSSLESS)
def test_each_lossless_file_shows_its_picture(files, mode):
    """Lossless encodings show exactly the chart (or its grey), transparency as white."""
    path, shows = files[mode]
    rgb, grey = _pictures()
    want = rgb if shows == "colour" else np.repeat(grey[..., None], 3, axis=2)
    with Image.open(path) as image:
        np.testing.assert_array_equal(np.asarray(to_rgb(image)), want)


def test_the_shipped_model_answers_each_picture_as_its_lossless_twin(api, files):
    """The answers are real: every file that shows the chart exactly gets the chart's answer, every one that shows
    its grey the grey's."""
    for mode, (_, shows) in files.items():
        if shows is not None:
            assert api[mode].token_ids == api["RGB" if shows == "colour" else "L"].token_ids, mode


def test_a_conversion_blind_to_the_encoding_gets_other_answers(model, api, files):
    """What makes the surface checks able to fail: Pillow's plain convert("RGB") (transparency dropped, wide greys
    clipped) shows these files otherwise, and the model answers otherwise."""
    for mode in BLIND:
        with Image.open(files[mode][0]) as image:
            pixels = np.asarray(image.convert("RGB"))  # without the info that marks a colour transparent
        plain = model.generate(PROMPT, images=[pixels], max_new_tokens=MAX_NEW)
        assert plain.token_ids != api[mode].token_ids, mode


@pytest.mark.parametrize("mode", MODES)
def test_glance_run_answers_as_the_api(api, files, mode):
    assert glance_run(PROMPT, files[mode][0], MAX_NEW)["token_ids"] == api[mode].token_ids


@pytest.mark.parametrize("mode", MODES)
def test_the_api_given_bytes_or_an_open_image_answers_as_given_the_path(model, api, files, mode):
    path = files[mode][0]
    assert model.generate(PROMPT, images=[path.read_bytes()], max_new_tokens=MAX_NEW).token_ids == api[mode].token_ids
    with Image.open(path) as image:
        assert model.generate(PROMPT, images=[image], max_new_tokens=MAX_NEW).token_ids == api[mode].token_ids


@pytest.mark.parametrize("mode", MODES)
def test_glance_serve_answers_a_data_url_as_the_api(server, api, files, mode):
    path = files[mode][0]
    _same_answer(_ask(server, data_url(path, MIME[path.suffix[1:]])), api[mode])


@pytest.mark.parametrize("mode", MODES)
def test_glance_serve_answers_a_file_url_as_the_api(server, api, files, mode):
    _same_answer(_ask(server, f"file://{files[mode][0]}"), api[mode])


@pytest.mark.parametrize("mode", MODES)
def test_the_triton_models_image_decoding_answers_as_the_api(triton_model, model, api, files, mode):
    image = triton_model.decoded_image(files[mode][0].read_bytes())
    assert model.generate(PROMPT, images=[image], max_new_tokens=MAX_NEW).token_ids == api[mode].token_ids


def test_an_rgba_array_shows_as_its_png(model, files):
    """An HxWx4 uint8 array is RGBA: the API shows it as the same pixels saved as a PNG."""
    with Image.open(files["RGBA"][0]) as image:
        array = np.asarray(image)
    np.testing.assert_array_equal(model.build(PROMPT, images=[array]).pixel_values,
                                  model.build(PROMPT, images=[files["RGBA"][0]]).pixel_values)
