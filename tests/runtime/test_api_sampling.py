"""Sampling through the Python API and glance-run on the embedded default: a seed reproduces an answer, a drawn
one is reported, speculation and batching leave the tokens as plain sampling's, and settings out of range are
refused in one line."""
from __future__ import annotations

import copy
import json
import threading
from dataclasses import replace

import pytest

import glance_runtime as gr
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.cli.run import main as run_main
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.decode.sampling import SamplingParams
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError, InputError
from glance_runtime.prompt.codec import exported_codec
from support import RECEIPT

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

MAX_TOKENS = 32
PROMPTS = ["What is the total?", {"prompt": "What is the date?", "images": [str(RECEIPT)]}, "Describe this.",
           "Name a colour."]
HOT = {"temperature": 1.4, "top_p": 0.95}


def _kwargs(item) -> dict:
    return {"prompt": item} if isinstance(item, str) else dict(item)


@pytest.fixture(scope="module")
def spec():
    with gr.load(threads=1) as model:
        yield model


@pytest.fixture(scope="module")
def plain():
    with gr.load(threads=1, speculative=False) as model:
        yield model


@pytest.fixture(scope="module")
def batched():
    with gr.load(threads=1, max_batch=4) as model:
        yield model


def test_a_seed_gives_plain_samplings_answer_draft_on_or_off(spec, plain):
    answers = set()
    for item in PROMPTS[:2]:
        for seed in range(6):
            alone = plain.generate(**_kwargs(item), max_new_tokens=MAX_TOKENS, seed=seed, **HOT)
            drafted = spec.generate(**_kwargs(item), max_new_tokens=MAX_TOKENS, seed=seed, **HOT)
            assert drafted.token_ids == alone.token_ids and drafted.seed == alone.seed == seed
            answers.add(tuple(alone.token_ids))
    assert len(answers) >= 4, "seeds must give different answers where the distribution is wide"
    greedy = spec.generate("What is the total?", max_new_tokens=MAX_TOKENS)
    assert greedy.seed is None and greedy.token_ids == plain.generate("What is the total?",
                                                                      max_new_tokens=MAX_TOKENS).token_ids


def test_a_drawn_seed_is_reported_and_reproduces_the_answer(spec):
    first = spec.generate("Describe this.", max_new_tokens=MAX_TOKENS, temperature=1.0)
    assert isinstance(first.seed, int) and 0 <= first.seed < 2**63
    again = spec.generate("Describe this.", max_new_tokens=MAX_TOKENS, temperature=1.0, seed=first.seed)
    assert again.token_ids == first.token_ids
    streamed = spec.stream("Describe this.", max_new_tokens=MAX_TOKENS, temperature=1.0, seed=first.seed)
    assert "".join(streamed) == first.text and streamed.output.seed == first.seed


def test_a_batch_samples_each_answer_as_alone_greedy_and_sampled_mixed(batched, plain):
    """A list sampled from one seed gives prompt i the seed + i; threads asking greedy and sampled answers at once
    are decoded together, each the answer it gets alone."""
    together = batched.generate(PROMPTS, max_new_tokens=MAX_TOKENS, seed=40, **HOT)
    for i, (item, out) in enumerate(zip(PROMPTS, together)):
        alone = plain.generate(**_kwargs(item), max_new_tokens=MAX_TOKENS, seed=40 + i, **HOT)
        assert (out.token_ids, out.seed) == (alone.token_ids, 40 + i), i
    got: list = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def call(i: int) -> None:
        barrier.wait()
        got[i] = batched.generate(**_kwargs(PROMPTS[i]), max_new_tokens=MAX_TOKENS,
                                  **({"seed": 7 * i, **HOT} if i % 2 else {}))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in enumerate(got):
        alone = plain.generate(**_kwargs(PROMPTS[i]), max_new_tokens=MAX_TOKENS,
                               **({"seed": 7 * i, **HOT} if i % 2 else {}))
        assert out.token_ids == alone.token_ids, i


def test_a_chat_samples_each_turn(spec):
    chat = spec.chat()
    first = chat.send("Name a colour.", max_new_tokens=MAX_TOKENS, temperature=0.9, seed=3)
    assert first.seed == 3
    again = spec.chat().send("Name a colour.", max_new_tokens=MAX_TOKENS, temperature=0.9, seed=3)
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("setting,named", [({"temperature": -0.5}, "temperature"), ({"temperature": 1.0, "top_p": 0},
                                           "top_p"), ({"top_k": -1}, "top_k"), ({"min_p": 1.0}, "min_p"),
                                          ({"temperature": 1.0, "seed": -1}, "seed"),
                                          ({"temperature": float("nan")}, "temperature"),
                                          ({"temperature": "hot"}, "temperature")])
def test_settings_out_of_range_are_refused_in_one_line(spec, setting, named):
    with pytest.raises(InputError, match=named) as err:
        spec.generate("Hello", max_new_tokens=4, **setting)
    assert "\n" not in str(err.value)


def test_glance_run_samples_reproducibly_and_refuses_bad_settings(capsys):
    argv = ["--prompt", "Describe this.", "--json", "--threads", "1", "--max-new-tokens", str(MAX_TOKENS)]
    assert run_main([*argv, "--temperature", "1.2", "--top-k", "20"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert isinstance(first["seed"], int)
    assert run_main([*argv, "--temperature", "1.2", "--top-k", "20", "--seed", str(first["seed"]), "--no-spec"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]
    assert run_main([*argv, "--temperature", "1.2", "--top-p", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_sampling_params_name_what_they_hold():
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5).check()
    assert not params.greedy and SamplingParams().greedy


def test_graphs_exported_before_sampling_refuse_it_in_one_line_and_still_decode_greedily(tmp_path):
    """A manifest whose vocab graph declares no logits (as every export before sampling): a sampled decode names
    the re-export; a greedy one runs as before."""
    backend = OrtBackend(DEFAULT_ARTIFACTS, threads=1)
    raw = copy.deepcopy(backend.manifest.raw)
    del raw["graphs"]["vocab"]["outputs"]["logits"]
    backend.manifest = replace(backend.manifest, raw=raw)
    prompt = exported_codec(backend.manifest).turn("Describe this.", None)
    greedy = decode(backend, prompt, DecodeConfig(max_new_tokens=8, speculative=False))
    assert len(greedy.tokens) >= 1
    with pytest.raises(GlanceError, match="exported before sampling.*re-export it with `glance-export onnx`") as err:
        decode(backend, prompt, DecodeConfig(max_new_tokens=8, sampling=SamplingParams(temperature=0.8, seed=1)))
    assert "\n" not in str(err.value)
    backend.close()
