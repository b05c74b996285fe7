"""Log-probs through the Python API on the embedded default: every answered token is reported (its log-prob and the
best alternatives at its position), the same with the draft on or off, streamed or not, alone or in a batch, and a
bad setting is refused in one line."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest

import glance_runtime as gr
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.cli.run import main as run_main
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError, InputError
from glance_runtime.prompt.codec import exported_codec
from glance_runtime.prompt.token_bytes import TokenBytes
from support import RECEIPT

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

MAX_TOKENS = 24
ASKS = [{"prompt": "What is the total?", "images": [str(RECEIPT)]}, {"prompt": "Describe this."}]
HOT = {"temperature": 1.4, "top_p": 0.95, "seed": 21}


@pytest.fixture(scope="module")
def spec():
    with gr.load(threads=1, budget=15) as model:
        yield model


@pytest.fixture(scope="module")
def plain():
    with gr.load(threads=1, speculative=False) as model:
        yield model


def _flat(out: gr.Output) -> tuple[list[int], np.ndarray, list[list[int]], np.ndarray]:
    return (out.token_ids, np.array([r.logprob for r in out.logprobs]), [[t for t, _ in r.top] for r in out.logprobs],
            np.array([[v for _, v in r.top] for r in out.logprobs]))


def _same(a: gr.Output, b: gr.Output) -> None:
    ids_a, lp_a, top_a, val_a = _flat(a)
    ids_b, lp_b, top_b, val_b = _flat(b)
    assert ids_a == ids_b and top_a == top_b
    # float32 rounding apart at most: passes of other shapes (a tree, a batch) may round a row's logits otherwise
    assert np.allclose(lp_a, lp_b, rtol=1e-5, atol=1e-5) and np.allclose(val_a, val_b, rtol=1e-5, atol=1e-5)


def test_every_token_is_reported_the_same_draft_on_or_off(spec, plain):
    taus = []
    for ask in ASKS:
        for kw in ({}, HOT):
            drafted = spec.generate(**ask, max_new_tokens=MAX_TOKENS, logprobs=4, **kw)
            alone = plain.generate(**ask, max_new_tokens=MAX_TOKENS, logprobs=4, **kw)
            _same(drafted, alone)
            assert len(drafted.logprobs) == len(drafted.token_ids)
            taus.append(drafted.tau)
            for token, report in zip(drafted.token_ids, drafted.logprobs):
                values = [v for _, v in report.top]
                assert len(report.top) == 4 and values == sorted(values, reverse=True) and report.logprob <= 0
                assert report.logprob <= values[0] + 1e-6
                if not kw:  # greedy: the token is the best alternative
                    assert report.top[0] == (token, report.logprob)
            assert drafted.token_ids == spec.generate(**ask, max_new_tokens=MAX_TOKENS, **kw).token_ids
    assert max(taus) > 1.5, "no answer took several tokens a round"


def test_streams_chats_and_batches_report_what_generate_does(spec):
    want = spec.generate(**ASKS[0], max_new_tokens=MAX_TOKENS, logprobs=2, **HOT)
    stream = spec.stream(**ASKS[0], max_new_tokens=MAX_TOKENS, logprobs=2, **HOT)
    assert "".join(stream) == want.text
    _same(stream.output, want)
    _same(spec.chat().send("What is the total?", [str(RECEIPT)], max_new_tokens=MAX_TOKENS, logprobs=2, **HOT), want)
    with gr.load(threads=1, max_batch=3) as batched:
        outs = batched.generate([ASKS[1], ASKS[0], "Name a colour."], max_new_tokens=MAX_TOKENS, logprobs=2,
                                temperature=1.4, top_p=0.95, seed=20)
    _same(outs[1], want)
    assert len(outs[2].logprobs) == len(outs[2].token_ids)


def test_no_report_unless_asked_and_a_stop_string_keeps_them_aligned(spec):
    assert spec.generate(**ASKS[0], max_new_tokens=8).logprobs is None
    full = spec.generate(**ASKS[1], max_new_tokens=MAX_TOKENS, logprobs=0)
    assert all(r.top == () for r in full.logprobs)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    cut = spec.generate(**ASKS[1], max_new_tokens=MAX_TOKENS, logprobs=0, stop=stop)
    assert len(cut.logprobs) == len(cut.token_ids) < len(full.token_ids)
    assert cut.logprobs == full.logprobs[:len(cut.token_ids)]


@pytest.mark.parametrize("value", [21, -1, "3", 2.0, True])
def test_a_bad_logprobs_setting_is_refused_in_one_line(spec, value):
    with pytest.raises(InputError, match="logprobs") as err:
        spec.generate("Hello", max_new_tokens=4, logprobs=value)
    assert "\n" not in str(err.value)


def test_graphs_exported_before_log_probs_refuse_them_in_one_line():
    backend = OrtBackend(DEFAULT_ARTIFACTS, threads=1)
    raw = copy.deepcopy(backend.manifest.raw)
    del raw["graphs"]["vocab"]["outputs"]["logits"]
    backend.manifest = replace(backend.manifest, raw=raw)
    prompt = exported_codec(backend.manifest).turn("Describe this.", None)
    try:
        with pytest.raises(GlanceError, match="log-probs.*re-export it with `glance-export onnx`") as err:
            decode(backend, prompt, DecodeConfig(max_new_tokens=8, logprobs=1))
        assert "\n" not in str(err.value)
    finally:
        backend.close()


def test_glance_run_prints_the_apis_reports_and_refuses_them_without_json(spec, capsys):
    argv = ["--prompt", "Describe this.", "--json", "--threads", "1", "--max-new-tokens", str(MAX_TOKENS),
            "--temperature", "1.4", "--top-p", "0.95", "--seed", "21"]
    assert run_main([*argv, "--logprobs", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = spec.generate(**ASKS[1], max_new_tokens=MAX_TOKENS, logprobs=3, **HOT)
    spelling = TokenBytes(spec.session.codec.tokenizer)
    assert printed["token_ids"] == want.token_ids and len(printed["logprobs"]) == len(want.token_ids)
    for entry, token, report in zip(printed["logprobs"], want.token_ids, want.logprobs):
        assert entry["token"] == spelling.text(token) and bytes(entry["bytes"]) == spelling.bytes(token)
        assert entry["logprob"] == pytest.approx(report.logprob, rel=1e-5, abs=1e-5)
        assert [(e["token"], e["logprob"]) for e in entry["top_logprobs"]] == \
            [(spelling.text(t), pytest.approx(v, rel=1e-5, abs=1e-5)) for t, v in report.top]
    plain = [a for a in argv if a != "--json"]
    for extra, named in ((["--json", "--logprobs", "21"], "--logprobs 21"), (["--logprobs", "2"], "--json"),
                         (["--chat", "--json", "--logprobs", "2"], "--json")):
        assert run_main([*plain, *extra]) == 2
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
