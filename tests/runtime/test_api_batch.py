"""A Model loaded with max_batch > 1: a list of prompts, calls from several threads and a conversation's turns
are decoded together, each answer token for token the one decoded alone; bad batch settings are one-line
refusals."""
from __future__ import annotations

import threading

import pytest

import glance_runtime as gr
from glance_runtime.errors import GlanceError, InputError
from support import RECEIPT

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

MAX_TOKENS = 40
PROMPTS = ["What is the total?", {"prompt": "What is the date?", "images": [str(RECEIPT)]}, "Describe this.",
           {"messages": [{"role": "user", "content": "Hello"}]}, "Name a colour.",
           {"prompt": "What is the total?", "images": [str(RECEIPT)]}]


def _one(model, item):
    return model.generate(**({"prompt": item} if isinstance(item, str) else item), max_new_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def alone():
    with gr.load(threads=1) as model:
        yield model


@pytest.fixture(scope="module")
def batched():
    with gr.load(threads=1, max_batch=4) as model:
        yield model


@pytest.fixture(scope="module")
def answers(alone):
    return [_one(alone, item) for item in PROMPTS]


def test_a_list_of_prompts_gets_the_one_by_one_answers_in_order(batched, alone, answers):
    together = batched.generate(PROMPTS, max_new_tokens=MAX_TOKENS)
    assert [o.token_ids for o in together] == [a.token_ids for a in answers]
    assert [o.text for o in together] == [a.text for a in answers]
    assert all(o.stats["finish"] == a.stats["finish"] and o.stats["tokens"] == a.stats["tokens"]
               for o, a in zip(together, answers))
    assert [o.text for o in alone.generate(PROMPTS[:2], max_new_tokens=MAX_TOKENS)] == [a.text for a in answers[:2]]


def test_calls_from_several_threads_are_decoded_together_each_as_alone(batched, answers):
    got: list = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def call(i: int) -> None:
        barrier.wait()
        if i % 2:
            stream = batched.stream(**({"prompt": PROMPTS[i]} if isinstance(PROMPTS[i], str) else PROMPTS[i]),
                                    max_new_tokens=MAX_TOKENS)
            text = "".join(stream)
            got[i] = (text, stream.output.token_ids)
        else:
            out = _one(batched, PROMPTS[i])
            got[i] = (out.text, out.token_ids)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [(a.text, a.token_ids) for a in answers]


def test_a_conversation_on_a_batched_model_keeps_its_rows(batched, alone):
    chat, reference = batched.chat(), alone.chat()
    for turn in range(2):
        text, images = ("What is the total?", [str(RECEIPT)]) if turn == 0 else ("And the date?", None)
        out = chat.send(text, images, max_new_tokens=MAX_TOKENS)
        assert out.token_ids == reference.send(text, images, max_new_tokens=MAX_TOKENS).token_ids
    assert out.stats["prefill_tokens"] < out.stats["prompt_tokens"]


def test_stop_strings_and_on_text_work_per_request(batched, alone):
    seen: list[str] = []
    out = batched.generate("Describe this.", max_new_tokens=MAX_TOKENS, stop=[" "], on_text=seen.append)
    ref = alone.generate("Describe this.", max_new_tokens=MAX_TOKENS, stop=[" "])
    assert out.text == ref.text == "".join(seen) and out.stats["finish"] == ref.stats["finish"]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch": 0}, "max_batch"), ({"max_batch": 2.0}, "max_batch"),
    ({"max_batch": 2, "backend": "torch"}, "one request at a time")])
def test_bad_batch_settings_are_one_line_refusals(kwargs, message):
    with pytest.raises((InputError, GlanceError), match=message) as caught:
        gr.load(**kwargs)
    assert "\n" not in str(caught.value)


def test_a_list_refuses_arguments_meant_for_one_prompt(batched):
    with pytest.raises(InputError, match="own dict"):
        batched.generate(["a", "b"], images=[str(RECEIPT)])
    with pytest.raises(InputError, match="prompt 1"):
        batched.generate(["a", {"text": "b"}])
