"""The Python API under arbitrary arguments and text: every call either answers or raises one of the
GlanceError kinds (InputError, LimitError, IntegrityError) with a one-line message; never a TypeError,
ValueError, hang or crash. Text includes lone surrogates and control characters."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import glance_runtime as gr
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import InputError, IntegrityError, LimitError

pytestmark = pytest.mark.edge

KINDS = (InputError, LimitError, IntegrityError)
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(10**3, 10**12), st.floats(allow_nan=True),
                st.text(max_size=6), st.sampled_from(["auto", "lots", "2048", "7", "AUTO"]), st.lists(st.integers(), max_size=2))
TEXT = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                  st.characters(max_codepoint=0x1F)), max_size=40)


def _one_line(exc: BaseException) -> None:
    assert isinstance(exc, KINDS), f"{type(exc).__name__}: {exc}"
    assert str(exc) and "\n" not in str(exc)


@pytest.fixture(scope="module")
def model():
    with gr.load(threads=1, budget=7) as loaded:
        yield loaded


@SETTINGS
@given(threads=ANY, branch_k=ANY, budget=ANY, max_context=ANY, max_tree=ANY)
def test_load_takes_good_settings_and_refuses_the_rest_in_one_line(threads, branch_k, budget, max_context, max_tree):
    if branch_k is None:
        branch_k = 8
    try:
        loaded = gr.load(threads=threads, branch_k=branch_k, budget=budget, max_context=max_context, max_tree=max_tree)
    except Exception as exc:  # noqa: BLE001 - what is raised is what is checked
        _one_line(exc)
        return
    loaded.close()
    given_ints = [v for v in (threads, branch_k, max_context, max_tree) if v is not None]
    assert all(type(v) is int and v >= 1 for v in given_ints) and (budget in (None, "auto") or type(budget) is int)


@pytest.mark.parametrize("settings_, phrase", [
    ({"threads": 0}, "threads must be >= 1"), ({"threads": 100_000}, "threads 100000 is outside"),
    ({"branch_k": 0}, "branch_k must be >= 1"), ({"budget": "lots"}, "not a budget"),
    ({"max_context": "2048"}, "max_context must be an integer"), ({"speculative": "yes"}, "speculative"),
    ({"backend": "cuda"}, "backend 'cuda'"), ({"artifacts": DEFAULT_ARTIFACTS, "model": "."}, "would be ignored")])
def test_bad_settings_are_input_errors_naming_the_setting(settings_, phrase):
    with pytest.raises(InputError, match=phrase):
        gr.load(**settings_)


@SETTINGS
@given(text=TEXT, system=st.one_of(st.none(), TEXT))
def test_any_text_answers_or_is_one_input_error(model, text, system):
    try:
        out = model.generate(text, system=system, max_new_tokens=2)
    except Exception as exc:  # noqa: BLE001
        _one_line(exc)
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in text + (system or "")) or isinstance(exc, LimitError), exc
        return
    assert isinstance(out.text, str) and 1 <= len(out.token_ids) <= 2


@SETTINGS
@given(text=TEXT)
def test_a_chat_refuses_bad_text_and_carries_on(model, text):
    chat = model.chat()
    try:
        chat.send(text, max_new_tokens=2)
    except Exception as exc:  # noqa: BLE001
        _one_line(exc)
    assert chat.send("What is shown?", max_new_tokens=2).token_ids
