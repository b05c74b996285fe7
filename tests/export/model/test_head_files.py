"""Malformed heads of both kinds are refused in one line naming the file, the field or tensor and the fix: rope
settings, sizes, integer or non-finite weights, pickles the safe loader refuses, and head files that are a
directory, a FIFO or a symbolic link loop (which are named as such and never block). Through the library
(`gr.load`) and, for a representative subset, `glance-run` and `glance-export onnx` as subprocesses."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import glance_runtime as gr
from glance_runtime.errors import GlanceError
from support import GLANCE_RUN, KIND_WORDS, one_line_refusal, replace_with, tiny_eagle3_head, tiny_head, within

FAMILY = "qwen3"
CHILD_TIMEOUT_S = 120  # a head file that blocks fails its test here instead of hanging the run


class Unsafe:
    """A pickle that would run a command if it were unpickled unsafely."""

    def __reduce__(self):
        return os.system, ("true",)


def _config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(head: Path) -> None:
        cfg = json.loads((head / "config.json").read_text())
        edit(cfg)
        (head / "config.json").write_text(json.dumps(cfg))
    return apply


def _set(key: str, value) -> Callable[[Path], None]:
    return _config(lambda c: c.__setitem__(key, value))


def _rope(**fields) -> Callable[[Path], None]:
    return _config(lambda c: c["rope_parameters"].update(fields))


def _weights(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(head: Path) -> None:
        state = load_file(str(head / "model.safetensors"))
        edit(state)
        save_file(state, str(head / "model.safetensors"))
    return apply


def _poison(key: str, value: float) -> Callable[[Path], None]:
    """One row of `key` set to `value` (NaN or infinity)."""
    return _weights(lambda s: s[key][1].fill_(value))


def _int8(key: str) -> Callable[[Path], None]:
    return _weights(lambda s: s.__setitem__(key, s[key].to(torch.int8)))


def _legacy(payload: Callable[[dict], bytes | object]) -> Callable[[Path], None]:
    """The weights as pytorch_model.bin: raw bytes, or an object torch.save pickles."""
    def apply(head: Path) -> None:
        state = load_file(str(head / "model.safetensors"))
        (head / "model.safetensors").unlink()
        body = payload(state)
        if isinstance(body, bytes):
            (head / "pytorch_model.bin").write_bytes(body)
        else:
            torch.save(body, head / "pytorch_model.bin")
    return apply


def _shape(name: str, kind: str) -> Callable[[Path], None]:
    """The head's file `name` replaced by a directory, a FIFO or a symbolic link loop."""
    return lambda head: replace_with(head / name, kind)


# case -> (head kind, how the head is spoiled, what its one line says)
CASES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "eagle3_rope_theta_zero": ("eagle3", _set("rope_theta", 0), "rope_theta is 0, not a positive number"),
    "eagle3_rope_theta_negative": ("eagle3", _set("rope_theta", -1.5), "rope_theta is -1.5, not a positive number"),
    "eagle3_rope_theta_string": ("eagle3", _set("rope_theta", "1e4"), "rope_theta is '1e4', not a positive number"),
    "eagle3_rope_scaling_unknown": ("eagle3", _set("rope_scaling", {"rope_type": "ntk-magic", "factor": 2.0}),
                                    "rope_scaling.rope_type is 'ntk-magic', not one of"),
    "eagle3_rope_scaling_no_factor": ("eagle3", _set("rope_scaling", {"rope_type": "linear"}),
                                      "rope_scaling of rope_type 'linear' lacks 'factor'"),
    "eagle3_rope_scaling_string": ("eagle3", _set("rope_scaling", "linear"),
                                   "rope_scaling is 'linear', not an object"),
    "eagle3_rope_scaling_list": ("eagle3", _set("rope_scaling", [2.0]), "rope_scaling is [2.0], not an object"),
    "eagle3_mrope_section_float": ("eagle3", _set("rope_scaling", {"rope_type": "default",
                                                                   "mrope_section": [2.5, 2.5, 3]}),
                                   "rope_scaling.mrope_section is [2.5, 2.5, 3], not three non-negative integers"),
    "eagle3_mrope_section_negative": ("eagle3", _set("rope_scaling", {"rope_type": "default",
                                                                      "mrope_section": [-2, 6, 4]}),
                                      "rope_scaling.mrope_section is [-2, 6, 4], not three non-negative integers"),
    "eagle3_hidden_not_multiple": ("eagle3", _set("hidden_size", 66),
                                   "hidden_size 66 is not a multiple of num_attention_heads"),
    "eagle3_tie_not_boolean": ("eagle3", _set("tie_word_embeddings", "yes"),
                               "tie_word_embeddings is 'yes', not true or false"),
    "eagle3_vocab_size_huge": ("eagle3", _set("vocab_size", 10**12), "embed_tokens.weight has shape (328, 64), but"),
    "eagle3_layers_million": ("eagle3", _set("num_hidden_layers", 10**6), "holds 2 layers but"),
    "eagle3_intermediate_huge": ("eagle3", _set("intermediate_size", 10**12), "midlayer.mlp.up_proj.weight has shape"),
    "eagle3_fc_int8": ("eagle3", _int8("fc.weight"), "fc.weight is stored as int8, not as floating-point"),
    "eagle3_lm_head_nan": ("eagle3", _poison("lm_head.weight", float("nan")), "lm_head.weight holds"),
    "eagle3_midlayer_inf": ("eagle3", _poison("midlayer.mlp.down_proj.weight", float("inf")),
                            "midlayer.mlp.down_proj.weight holds"),
    "eagle3_bin_empty": ("eagle3", _legacy(lambda s: b""), "pytorch_model.bin are an empty file"),
    "eagle3_bin_garbage": ("eagle3", _legacy(lambda s: b"\x80\x02garbage\x00"),
                           "pytorch_model.bin are not a pickle of tensors"),
    "eagle3_bin_list": ("eagle3", _legacy(lambda s: list(s.values())), "pytorch_model.bin hold a list"),
    "eagle3_bin_ints": ("eagle3", _legacy(lambda s: {k: 3 for k in s}), "is of type int, not a tensor"),
    "eagle3_bin_unsafe": ("eagle3", _legacy(lambda s: {**s, "fc.weight": Unsafe()}),
                          "hold a Python object (posix.system) besides tensors"),
    "eagle3_bin_raw_pickle": ("eagle3", _legacy(lambda s: pickle.dumps(Unsafe())),
                              "pytorch_model.bin are not a pickle of tensors"),
    "glance_rope_theta_zero": ("glance", _rope(rope_theta=0), "rope_theta is 0, not a positive number"),
    "glance_hidden_not_multiple": ("glance", _set("num_attention_heads", 5),
                                   "is not a multiple of num_attention_heads 5"),
    "glance_layers_million": ("glance", _set("num_hidden_layers", 10**6), "holds 2 layers but"),
    "glance_intermediate_huge": ("glance", _set("intermediate_size", 10**12), "layers.0.mlp.up_proj.weight has shape"),
    "glance_fc_int8": ("glance", _int8("fc.weight"), "fc.weight is stored as int8, not as floating-point"),
    "glance_fc_nan": ("glance", _poison("fc.weight", float("nan")), "fc.weight holds"),
    "glance_norm_inf": ("glance", _poison("layers.0.mlp.up_proj.weight", float("-inf")),
                        "layers.0.mlp.up_proj.weight holds"),
    **{f"{kind}_{name.split('.')[0].replace('model', 'weights')}_{shape}":
       (kind, _shape(name, shape), f"{name} {KIND_WORDS[shape]}")
       for kind in ("eagle3", "glance") for name in ("config.json", "model.safetensors")
       for shape in ("dir", "fifo", "loop")},
}
UNSAFE_ADVICE = "weights_only=False"


@pytest.fixture(scope="module")
def target(snapshot_dir) -> Path:
    return Path(snapshot_dir(FAMILY))


@pytest.fixture(scope="module")
def spoiled(target, tmp_path_factory) -> Callable[[str], Path]:
    """case -> a head of its kind, spoiled as the case says (made once per module)."""
    root = tmp_path_factory.mktemp("spoiled")
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            kind, spoil, _ = CASES[case]
            out = root / case
            if kind == "eagle3":
                tiny_eagle3_head(target, out, draft_vocab=48, own_embeddings=True, layers=2)
            else:
                tiny_head(target, out)
            spoil(out)
            made[case] = out
        return made[case]

    return get


def _one_line(run: subprocess.CompletedProcess, words: str) -> str:
    assert UNSAFE_ADVICE not in run.stderr
    return one_line_refusal(run, words)


@pytest.mark.parametrize("case", list(CASES))
def test_the_library_refuses_a_malformed_head_in_one_line(target, spoiled, case):
    """Under a deadline: a regression that opens a FIFO fails here instead of hanging."""
    head = spoiled(case)
    with pytest.raises(GlanceError) as err:
        within(CHILD_TIMEOUT_S, lambda: gr.load(model=target, head=head, backend="torch"))
    message = str(err.value)
    assert CASES[case][2] in message and str(head) in message, message
    assert "\n" not in message and UNSAFE_ADVICE not in message


def test_a_glance_head_for_another_vocabulary_is_refused(target, tmp_path):
    """Its draft ids are checked against its own vocab_size, so one the target lacks would index past its LM head."""
    head = tiny_head(target, tmp_path / "head")
    _set("vocab_size", 10**12)(head)
    with pytest.raises(GlanceError, match="vocab_size 1000000000000, but"):
        gr.load(model=target, head=head, backend="torch")


def _wide(cases: list[str], default: set[str]) -> list:
    """Each command's cases: those in `default` in the default run, the rest (a child each, seconds apiece) slow."""
    return [c if c in default else pytest.param(c, marks=pytest.mark.slow) for c in cases]


GLANCE_EXPORT = [sys.executable, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"]

RUN_SUBSET = _wide(["eagle3_rope_theta_string", "eagle3_lm_head_nan", "eagle3_bin_unsafe", "eagle3_config_fifo",
                    "glance_fc_nan", "glance_weights_loop"], {"eagle3_config_fifo"})
ONNX_SUBSET = _wide(["eagle3_rope_scaling_no_factor", "eagle3_fc_int8", "eagle3_bin_garbage", "eagle3_config_fifo",
                     "glance_weights_fifo", "glance_config_dir"], {"eagle3_fc_int8"})


@pytest.mark.parametrize("case", RUN_SUBSET)
def test_glance_run_refuses_a_malformed_head_in_one_line(target, spoiled, case):
    run = subprocess.run([*GLANCE_RUN, "--backend", "torch", "--model", str(target), "--head", str(spoiled(case)),
                          "--prompt", "Hello", "--max-new-tokens", "4"],
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    _one_line(run, CASES[case][2])


@pytest.mark.parametrize("case", ONNX_SUBSET)
def test_glance_export_onnx_refuses_a_malformed_head_in_one_line(target, spoiled, case, tmp_path):
    out = tmp_path / "artifacts"
    run = subprocess.run([*GLANCE_EXPORT, "onnx", "--model", str(target), "--head", str(spoiled(case)),
                          "--out", str(out)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    _one_line(run, CASES[case][2])
    assert not out.exists()


GLANCE_SERVE = [sys.executable, "-c",
                "import sys; from glance_runtime.cli.serve import main; sys.exit(main(sys.argv[1:]))"]


@pytest.mark.parametrize("case", _wide(["eagle3_bin_unsafe", "eagle3_config_fifo", "glance_fc_nan"],
                                       {"eagle3_bin_unsafe"}))
def test_glance_serve_refuses_a_malformed_head_in_one_line(target, spoiled, case):
    """The server says where it listens, then fails its load in one error line (no torch text advising an
    unsafe load) and exits."""
    run = subprocess.run([*GLANCE_SERVE, "--backend", "torch", "--model", str(target), "--head", str(spoiled(case)),
                          "--port", "0"], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert run.returncode != 0 and "Traceback" not in run.stderr and UNSAFE_ADVICE not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("glance-serve: error:")]
    assert len(errors) == 1 and CASES[case][2] in errors[0], run.stderr
