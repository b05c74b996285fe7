"""The TensorRT backend's logic without a GPU: which profile a pass runs in, which engines it refuses,
and that `glance-run --backend tensorrt` on real TensorRT-RTX engines fails in one line where there is
no GPU. Running the engines needs a GPU (marked `gpu`, skipped here with the reason)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support import TENSORRT_RTX_MISSING, check_mixed, config, cutting, cuda_unavailable, median_surprisal, skipping
from glance_export.cli import main as export_main
from glance_runtime.decode.auto_budget import auto_budget
from glance_runtime.backends.trt_backend import check_engines, pick_profile
from glance_runtime.formats.engines import FILE as ENGINE_MANIFEST, EnginesRecord, read as read_engines_record
from glance_runtime.cli.run import main as run_main
from glance_runtime.errors import GlanceError

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

DEFAULT_ARTIFACTS = Path(__file__).parents[3] / "models" / "glance-vl-tiny-onnx"
HIDDEN = 64


def _target_profiles(max_context: int, max_tree: int) -> list[dict]:
    """Ranges per input as a built target engine reports them: prefill first, then verify."""
    def ranges(t_max: int, img_max: int) -> dict:
        return {"inputs_embeds": ((1, HIDDEN), (t_max, HIDDEN)), "tree_mask": ((1, 1), (t_max, t_max)),
                "image_embeds": ((0, HIDDEN), (img_max, HIDDEN)), "past_key_0": ((0, 2, 16), (max_context - 1, 2, 16))}
    return [ranges(max_context, 256), ranges(max_tree, 1)]


@pytest.mark.parametrize("rows,images,expected", [(1, 0, 1), (32, 0, 1), (33, 0, 0), (9, 4, 0), (200, 16, 0)])
def test_target_passes_pick_the_tightest_profile(rows, images, expected):
    shapes = {"inputs_embeds": (rows, HIDDEN), "tree_mask": (rows, rows), "image_embeds": (images, HIDDEN),
              "past_key_0": (100, 2, 16)}
    assert pick_profile(_target_profiles(2048, 32), shapes) == expected


def test_vocab_runs_pick_embed_or_project():
    embed = {"ids": ((1,), (2048,)), "hidden": ((1, HIDDEN), (1, HIDDEN))}
    project = {"ids": ((1,), (1,)), "hidden": ((1, HIDDEN), (64, HIDDEN))}
    profiles = [embed, project]
    assert pick_profile(profiles, {"ids": (300,), "hidden": (1, HIDDEN)}) == 0
    assert pick_profile(profiles, {"ids": (1,), "hidden": (15, HIDDEN)}) == 1


def test_a_pass_no_profile_holds_is_one_line():
    with pytest.raises(GlanceError, match="no engine profile holds") as err:
        pick_profile(_target_profiles(256, 32), {"inputs_embeds": (300, HIDDEN), "past_key_0": (0, 2, 16)})
    assert "\n" not in str(err.value)


def _record(module="tensorrt", version="10.3.0", cc="8.7", runs_on=None) -> EnginesRecord:
    """Built on a GPU of `cc`, or ahead of time for every capability in `runs_on`."""
    return EnginesRecord(Path("engines"), module, version, (cc,) if cc else tuple(runs_on or ()), "fp16", 256, 64,
                         None, None, {}, {})


def test_engines_for_this_tensorrt_and_gpu_are_accepted():
    check_engines(_record(), "tensorrt", "10.3.0", "8.7")
    check_engines(_record("tensorrt_rtx", "1.7.1", None, ["8.6", "8.9", "12.0"]), "tensorrt_rtx", "1.7.1", "8.9")


@pytest.mark.parametrize("record,here,message", [
    (_record(version="10.3.0"), ("tensorrt", "10.7.0", "8.7"), "built with tensorrt 10.3.0 but this machine has "
                                                               "tensorrt 10.7.0"),
    (_record(cc="8.7"), ("tensorrt", "10.3.0", "11.0"), "built for compute capability 8.7 but this GPU is 11.0"),
    (_record("tensorrt_rtx", "1.7.1", None, ["8.6", "8.9"]), ("tensorrt_rtx", "1.7.1", "7.5"),
     "compute capability 8.6, 8.9 but this GPU is 7.5"),
    (_record("tensorrt_rtx", "1.7.1"), ("tensorrt", "1.7.1", "8.7"), "built with tensorrt_rtx"),
])
def test_engines_for_another_tensorrt_or_gpu_are_refused(record, here, message):
    with pytest.raises(GlanceError, match=message) as err:
        check_engines(record, *here)
    assert "glance-export build" in str(err.value) and "\n" not in str(err.value)


def test_engine_manifest_errors(tmp_path):
    with pytest.raises(GlanceError, match="does not exist"):
        read_engines_record(tmp_path / "missing")
    with pytest.raises(GlanceError, match=f"no {ENGINE_MANIFEST}"):
        read_engines_record(tmp_path)
    (tmp_path / ENGINE_MANIFEST).write_text(json.dumps({"tensorrt": {}}))
    with pytest.raises(GlanceError, match="is not a GLANCE engine manifest"):
        read_engines_record(tmp_path)


@pytest.fixture(scope="module")
def rtx_engines(tmp_path_factory):
    """The embedded default model built with TensorRT-RTX's CPU builder (what `--target rtx` ships)."""
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    out = tmp_path_factory.mktemp("rtx") / "engines"
    assert export_main(["build", "--target", "rtx", "--artifacts", str(DEFAULT_ARTIFACTS), "--out", str(out)]) == 0
    return out


NO_CUDA = cuda_unavailable()


@pytest.mark.skipif(NO_CUDA is None, reason="checks the refusal on a machine without a GPU")
def test_run_on_engines_without_a_gpu_is_one_line(rtx_engines, capsys):
    code = run_main(["--backend", "tensorrt", "--engines", str(rtx_engines), "--prompt", "What is the total?"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "CUDA" in err[0] and "Traceback" not in err[0]


def test_a_damaged_engine_is_named_before_anything_loads(rtx_engines, tmp_path, capsys):
    import shutil

    copy = Path(shutil.copytree(rtx_engines, tmp_path / "engines"))
    engine = copy / "target.engine"
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    engine.write_bytes(bytes(data))
    assert run_main(["--backend", "tensorrt", "--engines", str(copy), "--prompt", "What is the total?"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "target.engine" in err[0] and "glance-export build" in err[0]


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA is not None, reason=f"running TensorRT engines needs CUDA buffers: {NO_CUDA}")
def test_engines_answer_like_onnxruntime(rtx_engines):
    """The same loop on TensorRT engines and on ONNX Runtime gives the same tokens (fp32 engines), with fixed
    budgets and with auto: as `glance-run` builds it (a profile measured on these engines), and with policies
    forcing skipped drafts and small cuts (tests/support.py)."""
    from glance_runtime.backends.registry import Source, open_session
    from glance_runtime.decode.loop import DecodeConfig, decode

    trt = open_session(Source("tensorrt", engines=rtx_engines))
    ort = open_session(Source("onnxruntime", artifacts=DEFAULT_ARTIFACTS))
    image = Path(__file__).parents[3] / "examples" / "demo" / "receipt.png"
    prompt = ort.prompt("What is the total?", image)
    for cfg in (DecodeConfig(max_new_tokens=32, speculative=False), DecodeConfig(max_new_tokens=32, budget=15)):
        ours = decode(trt.backend, prompt, cfg, trt.stop_ids)
        assert ours.tokens == decode(ort.backend, prompt, cfg, ort.stop_ids).tokens
    assert np.isfinite(ours.tau)

    prompt = ort.prompt("Describe the image.", image)  # the default model is least sure here
    truth = decode(ort.backend, prompt, DecodeConfig(max_new_tokens=32, budget=15), ort.stop_ids).tokens
    measured, cost_path, _ = auto_budget(trt, branch_k=8)
    assert cost_path.parent == rtx_engines and measured.cost.device.startswith("tensorrt")
    split, block = median_surprisal(trt.backend, prompt, 32), trt.backend.block_size
    policies = {"measured": measured, "cutting": cutting(split, block, measured.max_nodes),
                "skipping": skipping(split, block, max_nodes=measured.max_nodes)}  # constructed costs: its skips forced
    results = {name: decode(trt.backend, prompt, config(policy, 32), trt.stop_ids)
               for name, policy in policies.items()}
    assert {name: r.tokens for name, r in results.items()} == dict.fromkeys(policies, truth)
    check_mixed(results["skipping"], "skipping", seeded=False)
