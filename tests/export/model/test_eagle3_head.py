"""EAGLE-3 heads as published: the layouts the loader takes (midlayer. keys, pytorch_model.bin, tied embeddings, a
second layer), malformed heads refused in one line naming the key or field (through the loader, the torch reference
and `glance-run`), and `glance-export init-head --arch eagle3`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from glance_export.cli import main as export_main
from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import load_eagle3
from glance_export.model.torch_backend import TorchBackend, greedy_reference, open_reference
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.errors import GlanceError
from support import tiny_eagle3_head

FAMILY = "qwen3"
GLANCE_RUN = [sys.executable, "-c", "import sys; from glance_runtime.cli.run import main; sys.exit(main(sys.argv[1:]))"]
DRAFT_VOCAB = 48


@pytest.fixture(scope="module")
def target(snapshot_dir) -> Path:
    return Path(snapshot_dir(FAMILY))


@pytest.fixture(scope="module")
def published(target, tmp_path_factory) -> Path:
    """A two-layer head with a draft vocabulary and its own embeddings, as `save_eagle3` writes it."""
    return tiny_eagle3_head(target, tmp_path_factory.mktemp("eagle3") / "head", draft_vocab=DRAFT_VOCAB,
                            own_embeddings=True, layers=2)


def _copy(head: Path, out: Path, config: Callable[[dict], None] = lambda c: None,
          state: Callable[[dict], None] = lambda s: None, legacy: bool = False) -> Path:
    """`head` rewritten at `out` with its config and weights edited in place by `config` and `state`."""
    out.mkdir(parents=True)
    cfg = json.loads((head / "config.json").read_text())
    config(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(head / "model.safetensors"))
    state(weights)
    if legacy:
        torch.save(weights, out / "pytorch_model.bin")
    else:
        save_file(weights, str(out / "model.safetensors"))
    return out


def _same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0, msg=key)


def test_published_layout_round_trips(published):
    keys = set(load_file(str(published / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "layers.1.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t",
            "t2d"} <= keys
    assert not any(k.startswith("layers.0.") for k in keys)
    head = load_eagle3(published)
    assert head.config.num_hidden_layers == 2 and head.config.draft_vocab_size == DRAFT_VOCAB
    assert head.layers[0].self_attn.q_proj.in_features == 2 * head.config.hidden_size
    assert head.layers[1].self_attn.q_proj.in_features == head.config.hidden_size


def test_pytorch_model_bin_loads_as_safetensors(published, tmp_path):
    legacy = _copy(published, tmp_path / "legacy", legacy=True)
    assert not (legacy / "model.safetensors").exists()
    _same_weights(load_eagle3(legacy), load_eagle3(published))


def test_tied_embeddings_give_the_draft_rows_of_the_embedding(published, tmp_path):
    def tie(cfg: dict) -> None:
        cfg["tie_word_embeddings"] = True

    tied = load_eagle3(_copy(published, tmp_path / "tied", tie, lambda s: s.pop("lm_head.weight")))
    rows = tied.target_ids(torch.arange(DRAFT_VOCAB))
    torch.testing.assert_close(tied.lm_head.weight, tied.embed_tokens.weight[rows])
    with pytest.raises(GlanceError, match="embed_tokens.weight"):
        load_eagle3(_copy(published, tmp_path / "bare", tie,
                          lambda s: [s.pop("lm_head.weight"), s.pop("embed_tokens.weight")]))


def _set(key: str, value) -> Callable[[dict], None]:
    return lambda d: d.__setitem__(key, value)


def _edit_d2t(edit: Callable[[torch.Tensor], None]) -> Callable[[dict], None]:
    def apply(state: dict) -> None:
        edit(state["d2t"])
    return apply


MALFORMED: dict[str, tuple[Callable[[dict], None], Callable[[dict], None], str]] = {  # config, state, error
    "missing_fc": (lambda c: None, lambda s: s.pop("fc.weight"), "lacks 'fc.weight'"),
    "q_proj_shape": (lambda c: None, lambda s: s.__setitem__("midlayer.self_attn.q_proj.weight", torch.zeros(64, 64)),
                     "midlayer.self_attn.q_proj.weight has shape (64, 64)"),
    "unknown_key": (lambda c: None, _set("midlayer.extra.weight", torch.zeros(2)), "holds 'midlayer.extra.weight'"),
    "missing_layer_1": (lambda c: None, lambda s: s.pop("layers.1.mlp.up_proj.weight"),
                        "lacks 'layers.1.mlp.up_proj.weight'"),
    "d2t_out_of_range": (lambda c: None, _edit_d2t(lambda d: d.__setitem__(-1, 10_000)),
                         "d2t maps a draft id outside"),
    "d2t_duplicate": (lambda c: None, _edit_d2t(lambda d: d.__setitem__(1, d[0] - 1)), "two draft ids to one target"),
    "t2d_mismatch": (lambda c: None, lambda s: s["t2d"].__setitem__(slice(None), ~s["t2d"]), "t2d does not mark"),
    "hidden_size_missing": (lambda c: c.pop("hidden_size"), lambda s: None, "lacks 'hidden_size'"),
    "hidden_size_text": (_set("hidden_size", "64"), lambda s: None, "hidden_size is '64', not an integer"),
    "hidden_size_float": (_set("hidden_size", 64.0), lambda s: None, "hidden_size is 64.0, not an integer"),
    "aux_beyond_target": (lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 2, 9]),
                          lambda s: None, "taps layer 9"),
}


@pytest.fixture(scope="module")
def malformed(published, tmp_path_factory):
    root = tmp_path_factory.mktemp("malformed")
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            config, state, _ = MALFORMED[case]
            made[case] = _copy(published, root / case, config, state)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_head_is_refused_in_one_line(target, malformed, case):
    """Through the torch reference's opener, the path glance-run, the API and the audit's oracle take."""
    with pytest.raises(GlanceError) as err:
        open_reference(target, malformed(case))
    message = str(err.value)
    assert MALFORMED[case][2] in message and "\n" not in message


RUN_CASES = [c if c in ("missing_fc", "d2t_duplicate", "aux_beyond_target") else pytest.param(c, marks=pytest.mark.slow)
             for c in MALFORMED]


@pytest.mark.parametrize("case", RUN_CASES)
def test_glance_run_refuses_a_malformed_head(target, malformed, case):
    run = subprocess.run([*GLANCE_RUN, "--backend", "torch", "--model", str(target),
                          "--head", str(malformed(case)), "--prompt", "Hello", "--max-new-tokens", "4"],
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert len(lines) == 1 and MALFORMED[case][2] in lines[0], run.stderr


def test_glance_run_decodes_with_a_published_head(target, published):
    run = subprocess.run([*GLANCE_RUN, "--backend", "torch", "--model", str(target),
                          "--head", str(published), "--prompt", "Hello", "--max-new-tokens", "6", "--budget", "15"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "6 tokens" in run.stderr


def test_init_head_writes_an_eagle3_head_that_decodes_losslessly(target, tmp_path, capsys):
    out = tmp_path / "head"
    assert export_main(["init-head", "--model", str(target), "--out", str(out), "--arch", "eagle3",
                        "--draft-vocab", str(DRAFT_VOCAB), "--layers", "2", "--seed", "4"]) == 0
    assert "EAGLE-3" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert "midlayer.fc.weight" not in load_file(str(out / "model.safetensors"))
    head = load_eagle3(out)
    assert head.target_ids(torch.arange(DRAFT_VOCAB)).tolist() == list(range(DRAFT_VOCAB)), "the first N ids"
    snap = Snapshot(target)
    backend = TorchBackend(snap, head)
    prompt = snap.build_prompt("What colour is the square?")
    truth = greedy_reference(backend.model, snap, prompt, 12, ())
    assert decode(backend, prompt, DecodeConfig(max_new_tokens=12, budget=15, branch_k=4)).tokens == truth

    whole = tmp_path / "whole"
    assert export_main(["init-head", "--model", str(target), "--out", str(whole), "--arch", "eagle3"]) == 0
    assert "draft_vocab_size" not in json.loads((whole / "config.json").read_text())
    assert load_eagle3(whole).config.num_hidden_layers == 1


def _exit_code(argv: list[str]) -> int:
    """glance-export's exit code, whether its parser or its command refused."""
    try:
        return export_main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize("args,error", [
    (["--arch", "eagle3", "--block-size", "8"], "--block-size is for GLANCE heads"),
    (["--arch", "eagle3", "--mask-token-id", "3"], "--mask-token-id is for GLANCE heads"),
    (["--arch", "eagle3", "--draft-vocab", "100000"], "--draft-vocab 100000 exceeds"),
    (["--arch", "eagle3", "--draft-vocab", "0"], "--draft-vocab must be >= 8"),
    (["--draft-vocab", "8"], "--draft-vocab is for --arch eagle3"),
    (["--arch", "medusa"], "invalid choice: 'medusa'"),
])
def test_init_head_refuses_flags_of_the_other_kind(target, tmp_path, capsys, args, error):
    out = tmp_path / "head"
    assert _exit_code(["init-head", "--model", str(target), "--out", str(out), *args]) != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and error in lines[0] and "Traceback" not in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("interleaved", [False, True])
def test_m_rope_angles_are_the_targets_own(interleaved):
    """A head with `mrope_section` rotates as its Qwen-VL target does: contiguous sections (Qwen2-VL, Qwen2.5-VL)
    or every third column (`mrope_interleaved`, Qwen3-VL), checked against transformers' own rotary classes."""
    import torch
    from transformers import Qwen2VLTextConfig, Qwen3VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from glance_export.model.eagle3 import Eagle3Config, init_eagle3

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    if interleaved:
        rope["mrope_interleaved"] = True
    shape = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    head = init_eagle3(Eagle3Config(**shape, intermediate_size=96, vocab_size=300, rope=rope), seed=0)
    positions = torch.stack([torch.arange(5), torch.arange(5) * 2 + 1, torch.arange(5) * 3 + 2])[:, None]
    cos, sin = head.rope(torch.zeros(1, 5, 64), positions)
    reference = (Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(**shape, rope_parameters=rope)) if interleaved
                 else Qwen2VLRotaryEmbedding(Qwen2VLTextConfig(**shape, rope_parameters=rope)))
    want_cos, want_sin = reference(torch.zeros(1), positions)
    assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    flat = head.rope(torch.zeros(1, 5, 64), positions[:1].expand(3, 1, 5))
    assert not torch.equal(flat[0], cos)  # the height and width axes do move the angles
