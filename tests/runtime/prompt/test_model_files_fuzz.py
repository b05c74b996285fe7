"""A model's prompt files edited to arbitrary values: the prompt builder either opens them and builds a prompt
from an image and text, or refuses them in one line when loaded (IntegrityError); never a crash at the first
image, and never a template that runs unbounded."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError, IntegrityError
from glance_runtime.prompt.messages import user_turn
from glance_runtime.prompt.prompt_builder import PromptBuilder

pytestmark = pytest.mark.edge

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NUMBER = st.one_of(st.integers(-2, 70), st.integers(10**6, 10**13), st.floats(allow_nan=True, allow_infinity=True),
                   st.booleans(), st.none(), st.text(max_size=3))
VALUES = st.fixed_dictionaries({}, optional={
    key: NUMBER for key in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels",
                            "resample", "rescale_factor", "do_resize", "do_normalize")} | {
    "image_std": st.one_of(NUMBER, st.lists(NUMBER, max_size=4)), "image_mean": st.lists(NUMBER, max_size=4),
    "size": st.one_of(NUMBER, st.fixed_dictionaries({}, optional={"shortest_edge": NUMBER, "longest_edge": NUMBER}))})
TEMPLATES = st.sampled_from([
    "{% for m in messages %}{{ m['content'] }}{% endfor %}<|vision_start|><|image_pad|><|vision_end|>",
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 100000000 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ 2 ** 100000000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x'|center(10**10) }}", "{{ '{:>999999999}'.format(1) }}", "{{ '%0999999999d' % 1 }}",
    "{% for i in range(100000) %}{{ 'x' * 4000000 }}{% endfor %}",
    "{{ messages[0].content.__class__ }}", "{{ raise_exception('no') }}", "{% for %}", ""])


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "img.png"
    Image.new("RGB", (60, 40), (10, 200, 30)).save(path)
    return path


def _files(root: Path) -> Path:
    files = root / "files"
    files.mkdir()
    for name in FILES:
        shutil.copy(DEFAULT_ARTIFACTS / name, files / name)
    return files


def _open_and_build(files: Path, image: Path) -> None:
    manifest = json.loads((DEFAULT_ARTIFACTS / "manifest.json").read_text())
    try:
        builder = PromptBuilder(files, image_token_id=manifest["image_token_id"])
    except IntegrityError as exc:
        assert "\n" not in str(exc)
        return
    try:
        prompt = builder.build_messages([user_turn("What is shown?", [image])])
    except GlanceError as exc:  # a template that renders the probe but not this conversation
        assert "\n" not in str(exc) and not isinstance(exc, RecursionError)
        return
    assert prompt.length > 0


@SETTINGS
@given(values=VALUES)
def test_any_preprocessor_values_build_a_prompt_or_are_refused_when_loaded(tmp_path_factory, image, values):
    files = _files(tmp_path_factory.mktemp("pre"))
    raw = json.loads((files / "preprocessor_config.json").read_text())
    (files / "preprocessor_config.json").write_text(json.dumps({**raw, **values}))
    _open_and_build(files, image)


@SETTINGS
@given(template=TEMPLATES)
def test_any_chat_template_renders_within_its_budget_or_is_refused(tmp_path_factory, image, template):
    files = _files(tmp_path_factory.mktemp("tpl"))
    (files / "chat_template.jinja").write_text(template)
    _open_and_build(files, image)


@pytest.mark.parametrize("junk", [b"", b"{}", b"[1, 2]", b'{"model": {"type": "BPE", "vocab": 5}}', b"\xff\xfe",
                                  b'{"a": ' * 200 + b"1" + b"}" * 200])
def test_a_junk_tokenizer_is_refused_in_one_line(tmp_path, image, junk):
    files = _files(tmp_path)
    (files / "tokenizer.json").write_bytes(junk)
    with pytest.raises(IntegrityError, match="tokenizer.json"):
        PromptBuilder(files, image_token_id=1).build_messages([user_turn("hi")])
