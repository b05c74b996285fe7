"""GLANCE answers wherever greedy decoding does: at every context size from the prompt length up and every
budget (auto included), the shipped model's ONNX graphs give greedy's answer, or both refuse in the same words
because the answer cannot fit. A round near the end of the context verifies a smaller tree (`tree.fit`), so no
room is held back for trees."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glance_runtime as gr
from glance_runtime.cli import run as cli
from glance_runtime.decode.limits import answer_rows

pytestmark = pytest.mark.edge

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "models" / "glance-vl-tiny-onnx"
RECEIPT = ROOT / "examples" / "demo" / "receipt.png"
PROMPTS = {"receipt": ("What is the total?", [RECEIPT]), "text": ("Say hello.", None)}
LONGEST = 40  # answer tokens asked for at most: past the end of the shipped model's answers to both prompts


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """The shipped graphs in a folder of the test's own, so auto's cost profile is measured once, at the full
    context, and stored there (then every smaller context reads it, as after a user's first run)."""
    copy = tmp_path_factory.mktemp("shipped") / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    with gr.load(copy, budget="auto") as model:
        model.generate("Hi", max_new_tokens=2)
    return copy


@pytest.fixture(scope="module")
def greedy(artifacts) -> dict[str, tuple[int, gr.Output]]:
    """Each prompt's length and its greedy answer at the built context."""
    with gr.load(artifacts, speculative=False) as model:
        return {name: (model.build(text, images=images).length, model.generate(text, images=images,
                                                                               max_new_tokens=LONGEST))
                for name, (text, images) in PROMPTS.items()}


def _answer(artifacts: Path, name: str, context: int, answer: int, **options) -> tuple[str, list[int], str] | str:
    """(text, ids, finish), or the refusal's words."""
    text, images = PROMPTS[name]
    with gr.load(artifacts, max_context=context, **options) as model:
        try:
            out = model.generate(text, images=images, max_new_tokens=answer)
        except gr.LimitError as refused:
            return str(refused)
        return out.text, out.token_ids, out.stats["finish"]


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(PROMPTS)), answer=st.integers(1, LONGEST), over=st.integers(-2, 80),
       budget=st.one_of(st.just("auto"), st.integers(0, 63)), branch_k=st.integers(1, 8))
def test_glance_answers_wherever_greedy_does(artifacts, greedy, name, answer, over, budget, branch_k):
    """`over`: context rows beyond what the answer needs (below 0: too few, refused with and without GLANCE)."""
    length, full = greedy[name]
    context = max(length, answer_rows(length, answer) + over)
    plain = _answer(artifacts, name, context, answer, speculative=False)
    glance = _answer(artifacts, name, context, answer, budget=budget, branch_k=branch_k)
    assert glance == plain
    if answer_rows(length, answer) > context:
        assert "context rows" in glance
    else:
        assert glance[1] == full.token_ids[:answer]


def test_a_prompt_that_cannot_fit_is_refused_the_same_way(artifacts, greedy):
    length, _ = greedy["receipt"]
    refusals = {_answer(artifacts, "receipt", length - 1, 1, **options)
                for options in ({"speculative": False}, {"budget": "auto"}, {"budget": 63})}
    assert len(refusals) == 1 and "prompt longer than --max-context" in refusals.pop()


def test_glance_run_answers_at_the_smallest_context_that_fits(artifacts, greedy, capsys):
    """The command line, at the context the prompt and answer need exactly, with and without GLANCE."""
    length, full = greedy["receipt"]
    args = ["--artifacts", str(artifacts), "--image", str(RECEIPT), "--prompt", PROMPTS["receipt"][0],
            "--max-context", str(answer_rows(length, 11)), "--max-new-tokens", "11", "--json"]
    answers = []
    for extra in ([], ["--no-spec"], ["--budget", "63"]):
        assert cli.main([*args, *extra]) == 0
        answers.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert answers == [full.token_ids[:11]] * 3


def test_auto_measures_its_costs_within_a_context_smaller_than_its_probe(tmp_path, greedy):
    """On first use auto times rounds on a probe prompt; a context too small for the probe still answers."""
    copy = tmp_path / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    length, full = greedy["text"]
    assert _answer(copy, "text", answer_rows(length, 3), 3, budget="auto")[1] == full.token_ids[:3]
