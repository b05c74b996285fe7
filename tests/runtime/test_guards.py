"""Property tests of the guards every command goes through: output directories, the cache location, images
as viewers show them, and trees cut to the context left. Whatever the input, the outcome is a correct
result or one GlanceError, and a refused output directory is left exactly as it was."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from glance_export.model.adapters import Snapshot
from glance_runtime.store.atomic import MARKER, atomic_directory, check_output, output_directory
from glance_runtime.store.cache import cache_root
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import read as load_manifest
from glance_runtime.prompt.images import load_image, to_rgb
from glance_runtime.prompt.codec import exported_codec
from glance_runtime.decode.tree import build_tree, fit

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
STATES = ("absent", "empty", "same", "other", "unmarked", "file", "link_to_unmarked")
RELATIONS = ("unrelated", "is_input", "holds_input", "inside_input")


def _tree_state(path: Path) -> dict[str, bytes] | str | None:
    if path.is_symlink():
        return f"link to {os.readlink(path)}"
    if not path.exists():
        return None
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _make(root: Path, state: str) -> Path:
    out = root / "out"
    if state == "empty":
        out.mkdir()
    elif state in ("same", "other"):
        out.mkdir()
        (out / "weights.bin").write_bytes(b"w")
        (out / MARKER).write_text(json.dumps({"format": "fmt-a" if state == "same" else "fmt-b", "made_by": "t"}))
    elif state == "unmarked":
        out.mkdir()
        (out / "config.json").write_text("{}")
    elif state == "file":
        out.write_text("a file")
    elif state == "link_to_unmarked":
        (root / "elsewhere").mkdir()
        (root / "elsewhere" / "notes.txt").write_text("someone's")
        out.symlink_to(root / "elsewhere")
    return out


@pytest.mark.edge
@FAST
@given(state=st.sampled_from(STATES), relation=st.sampled_from(RELATIONS), via_link=st.booleans())
def test_an_output_is_replaced_only_when_it_is_ours_and_no_input(tmp_path_factory, state, relation, via_link):
    root = tmp_path_factory.mktemp("guard")
    out = _make(root, state)
    source = {"unrelated": root / "input", "is_input": out, "holds_input": out / "model",
              "inside_input": root}[relation]
    if relation == "unrelated":
        source.mkdir()
    if via_link:  # the input named through a symlink: compared by real path all the same
        (root / "alias").symlink_to(source)
        source = root / "alias"
    before = {p: _tree_state(p) for p in (out, root / "elsewhere")}
    ours = state in ("absent", "empty", "same") and relation == "unrelated"
    try:
        check_output(out, "fmt-a", [source])
        refused = None
    except GlanceError as exc:
        refused = str(exc)
    assert {p: _tree_state(p) for p in before} == before
    assert (refused is None) == ours, (state, relation, refused)
    if refused is not None:
        assert "\n" not in refused and "pick" in refused


@pytest.mark.edge
@FAST
@given(state=st.sampled_from(("absent", "empty", "same")))
def test_outputs_carry_their_marker(tmp_path_factory, state):
    root = tmp_path_factory.mktemp("mark")
    out = _make(root, state)
    with atomic_directory(out, "fmt-a", "glance-test write") as tmp:
        (tmp / "data.txt").write_text("new")
    assert json.loads((out / MARKER).read_text()) == {"format": "fmt-a", "made_by": "glance-test write",
                                                      "entries": ["data.txt"]}
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "data.txt"])
    with pytest.raises(GlanceError, match="is a fmt-a output, not a fmt-b"):
        output_directory(out, "fmt-b", "glance-test other")


# Relative values and ~ (HOME is under the test's directory): a value never reaches outside it.
CACHE_TEXT = st.lists(st.sampled_from(list("ab~./-_ é") + ["file", "dir", "/"]), max_size=8).map("".join).filter(
    lambda v: not v.startswith("/") and ".." not in v.split("/") and not v.startswith("~/.."))


@pytest.mark.edge
@FAST
@given(value=CACHE_TEXT, home=st.sampled_from(("dir", "file", "missing")))
def test_the_cache_location_is_a_writable_directory_or_one_line(tmp_path_factory, monkeypatch, value, home):
    root = tmp_path_factory.mktemp("cache")
    (root / "file").write_text("not a directory")
    (root / "dir").mkdir()
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(root / home))
    monkeypatch.setenv("GLANCE_CACHE", value)
    try:
        found = cache_root()
    except GlanceError as exc:
        assert "\n" not in str(exc) and "GLANCE_CACHE" in str(exc)
        return
    assert found.is_absolute() and found.is_dir() and os.access(found, os.W_OK)
    if value == "":
        assert found == root / home / ".cache" / "glance"  # empty means unset, never the current directory
    assert not list(found.glob(".glance-probe.*"))


def _png(path: Path, array: np.ndarray) -> Path:
    """uint8 [h, w] is L, [h, w, 4] RGBA; uint16 is a 16-bit grey PNG."""
    Image.fromarray(array).save(path)
    return path


GREYS = st.integers(2, 24).flatmap(lambda h: st.integers(2, 24).flatmap(
    lambda w: st.lists(st.integers(0, 255), min_size=h * w, max_size=h * w).map(
        lambda v: np.array(v, np.uint8).reshape(h, w))))


@pytest.mark.edge
@FAST
@given(grey=GREYS)
def test_wide_and_float_images_look_like_their_8_bit_selves(tmp_path_factory, grey):
    root = tmp_path_factory.mktemp("img")
    eight = np.asarray(load_image(_png(root / "g8.png", grey)))
    sixteen = load_image(_png(root / "g16.png", grey.astype(np.uint16) * 257))
    assert np.array_equal(np.asarray(sixteen), eight)
    as_float = Image.fromarray(grey.astype(np.float32) / 255)
    as_float.save(root / "f.tiff")
    assert np.array_equal(np.asarray(load_image(root / "f.tiff")), eight)
    assert np.array_equal(np.asarray(to_rgb(Image.open(root / "g16.png"))), eight)


@pytest.mark.edge
@FAST
@given(grey=GREYS, hole=st.integers(0, 255))
def test_transparency_shows_as_white(tmp_path_factory, grey, hole):
    root = tmp_path_factory.mktemp("alpha")
    palette = Image.fromarray(grey).convert("P")
    palette.save(root / "p.png", transparency=hole)
    shown = np.asarray(load_image(root / "p.png"))
    opaque = np.asarray(Image.open(root / "p.png").convert("RGB"))
    index = np.asarray(Image.open(root / "p.png"))
    assert np.all(shown[index == hole] == 255)
    assert np.array_equal(shown[index != hole], opaque[index != hole])
    rgba = np.dstack([np.repeat(grey[..., None], 3, 2), np.zeros_like(grey)])
    assert np.all(np.asarray(load_image(_png(root / "clear.png", rgba))) == 255)


def test_a_16_bit_image_prompts_like_its_8_bit_self_on_every_path(snapshot_dir, tmp_path):
    """The torch oracle's prompt (through transformers' processor) and the runtime's torch-free builder see one picture."""
    grey = (np.arange(90 * 130).reshape(90, 130) * 7 % 256).astype(np.uint8)
    eight, sixteen = _png(tmp_path / "g8.png", grey), _png(tmp_path / "g16.png", grey.astype(np.uint16) * 257)
    snapshot = Snapshot(snapshot_dir("qwen2_5_vl"))
    codec = exported_codec(load_manifest(DEFAULT_ARTIFACTS))
    for build in (snapshot.build_prompt, codec.turn):
        a, b = build("Hi", eight), build("Hi", sixteen)
        np.testing.assert_array_equal(a.pixel_values, b.pixel_values)
    np.testing.assert_array_equal(snapshot.build_prompt("Hi", sixteen).pixel_values,
                                  snapshot.build_prompt("Hi", Image.open(sixteen)).pixel_values)


@pytest.mark.edge
@FAST
@given(data=st.data())
def test_a_tree_cut_to_the_room_left_is_the_best_tree_that_fits(data):
    offsets, k = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ids = np.stack([rng.permutation(50)[:k] for _ in range(offsets)])
    logp = np.sort(np.log(rng.dirichlet(np.ones(50), offsets)[:, :k]), axis=1)[:, ::-1]
    budget = data.draw(st.integers(0, 40))
    tree = build_tree(3, ids, logp, budget)
    room = data.draw(st.integers(-3, 50))
    cut = fit(tree, room)
    assert cut.size == max(1, min(tree.size, room))
    assert np.array_equal(cut.tokens, tree.tokens[: cut.size]) and np.all(cut.parents[1:] < np.arange(1, cut.size))
    best = build_tree(3, ids, logp, cut.size - 1)
    assert np.array_equal(best.tokens, cut.tokens) and np.array_equal(best.parents, cut.parents)


@pytest.mark.edge
def test_a_huge_prompt_is_refused_before_its_buffers(tmp_path):
    """120,000 characters against the shipped export: refused from the token count, before any buffer sized by it."""
    # VmHWM, not getrusage: a child's ru_maxrss also counts the forking parent's peak (Linux folds the
    # replaced address space's high-water mark into it at exec), which is pytest's after a long session.
    code = ("import sys; from glance_runtime.cli.run import main; rc = main(sys.argv[1:]); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr); "
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "--prompt", "x" * 120_000, "--budget", "8"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "GLANCE_CACHE": str(tmp_path)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "longer than --max-context" in lines[0] and len(lines) == 2, proc.stderr
    assert int(lines[1]) < 1_500_000, lines[1]  # KiB: under 1.5 GiB


@pytest.fixture
def mounts(tmp_path):
    """A 128 KiB tmpfs (smaller than any export) and a read-only one, for a full disk and a read-only cache; mounting needs root."""
    made = []
    for name, options in (("small", "size=128k"), ("ro", "ro,size=128k")):
        point = tmp_path / name
        point.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True).returncode:
            for done in made:
                subprocess.run(["umount", str(done)], check=False)
            pytest.skip("mounting a tmpfs needs root (a full disk and a read-only cache are checked where it can)")
        made.append(point)
    yield tmp_path
    for point in made:
        subprocess.run(["umount", str(point)], check=False)


def test_a_full_disk_and_a_read_only_cache_are_one_line(mounts, snapshot_dir):
    base = [sys.executable, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"]
    model = snapshot_dir("qwen3")
    head = mounts / "head"
    assert subprocess.run(base + ["init-head", "--model", str(model), "--out", str(head)]).returncode == 0
    full = subprocess.run(base + ["onnx", "--model", str(model), "--head", str(head), "--out", str(mounts / "small" / "art"),
                                  "--quiet"], capture_output=True, text=True, timeout=300)
    assert full.returncode == 2 and full.stderr.strip().splitlines() == [
        "glance-export: error: no space left on the device; free space (or pick another place to write) and run again"]
    assert list((mounts / "small").iterdir()) == []  # nothing half-written
    run = [sys.executable, "-c", "import sys; from glance_runtime.cli.run import main; sys.exit(main(sys.argv[1:]))",
           "--prompt", "hi"]
    ro = subprocess.run(run, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "GLANCE_CACHE": str(mounts / "ro" / "cache")})
    assert ro.returncode == 2 and len(ro.stderr.strip().splitlines()) == 1 and "read-only file system" in ro.stderr
