"""The TensorRT backend's logic without a GPU: which profile of the one target engine a pass runs in (a lone
prefill, a lone verify, a batched round), which engines and batches it refuses, and that `glance-run --backend tensorrt` on real TensorRT-RTX engines fails in one line where there is
no GPU. Running the engines needs a GPU (marked `gpu`, skipped here with the reason)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support import TENSORRT_RTX_MISSING, check_mixed, config, cutting, cuda_unavailable, median_surprisal, skipping
from glance_export.cli import main as export_main
from glance_runtime.decode.auto_budget import auto_budget
from glance_runtime.backends.trt_backend import check_engine_batch, check_engines, pick_profile
from glance_runtime.formats import engines as engines_format
from glance_runtime.formats.common import stamped
from glance_runtime.formats.engines import FILE as ENGINE_MANIFEST, EnginesRecord, read as read_engines_record
from glance_runtime.cli.run import main as run_main
from glance_runtime.errors import GlanceError

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

DEFAULT_ARTIFACTS = Path(__file__).parents[3] / "models" / "glance-vl-tiny-onnx"
HIDDEN = 64


def _target_profiles(max_context: int, max_tree: int, max_batch: int = 1) -> list[dict]:
    """Ranges per input as the one built target engine reports them: prefill, verify, then (max_batch above 1)
    batch; every profile over a pool of 1 to max_batch slots of 1 to max_context rows."""
    pool = ((1, 1, 2, 16), (max_batch, max_context, 2, 16))

    def ranges(b_max: int, t_max: int, img_max: int) -> dict:
        return {"inputs_embeds": ((1, 1, HIDDEN), (b_max, t_max, HIDDEN)), "tree_mask": ((1, 1, 1), (b_max, t_max, t_max)),
                "image_embeds": ((0, HIDDEN), (img_max, HIDDEN)), "slots": ((1,), (b_max,)),
                "past_rows": ((0,), (max_context - 1,)), "pool_key_0": pool}
    lone = [ranges(1, max_context, 256), ranges(1, max_tree, 1)]
    return lone + ([ranges(max_batch, max_tree, 1)] if max_batch > 1 else [])


PREFILL, VERIFY, BATCH = range(3)


@pytest.mark.parametrize("batch,rows,images,slots,expected", [
    (1, 1, 0, 1, VERIFY), (1, 32, 0, 1, VERIFY), (1, 33, 0, 1, PREFILL), (1, 9, 4, 1, PREFILL),
    (1, 200, 16, 1, PREFILL), (1, 1, 0, 8, VERIFY), (1, 300, 0, 8, PREFILL), (2, 1, 0, 8, BATCH),
    (8, 32, 0, 8, BATCH)])
def test_target_passes_pick_the_tightest_profile(batch, rows, images, slots, expected):
    """A lone sequence's passes run in the prefill or verify profile whatever the pool's slots (a batching runtime
    prefills a new sequence alone); only a pass of several sequences runs in the batch profile."""
    shapes = {"inputs_embeds": (batch, rows, HIDDEN), "tree_mask": (batch, rows, rows), "image_embeds": (images, HIDDEN),
              "slots": (batch,), "past_rows": (100,), "pool_key_0": (slots, 2048, 2, 16)}
    assert pick_profile(_target_profiles(2048, 32, max_batch=8), shapes) == expected


def test_a_lone_runtime_holds_a_short_one_slot_pool():
    """A runtime decoding one sequence at a lower --max-context: a pool of one slot of that many rows."""
    shapes = {"inputs_embeds": (1, 5, HIDDEN), "tree_mask": (1, 5, 5), "image_embeds": (0, HIDDEN), "slots": (1,),
              "past_rows": (100,), "pool_key_0": (1, 512, 2, 16)}
    assert pick_profile(_target_profiles(2048, 32, max_batch=8), shapes) == VERIFY
    assert pick_profile(_target_profiles(2048, 32), shapes) == VERIFY


def test_a_batch_the_engines_have_no_profile_for_is_one_line():
    """Several sequences on engines built without a batch profile, or more rows each than max_tree."""
    shapes = {"inputs_embeds": (2, 4, HIDDEN), "slots": (2,), "pool_key_0": (2, 2048, 2, 16)}
    with pytest.raises(GlanceError, match="no engine profile holds") as err:
        pick_profile(_target_profiles(2048, 32), shapes)
    assert "\n" not in str(err.value)
    with pytest.raises(GlanceError, match="no engine profile holds"):
        pick_profile(_target_profiles(2048, 32, max_batch=8), {**shapes, "inputs_embeds": (2, 33, HIDDEN)})


def test_vocab_runs_pick_embed_or_project():
    embed = {"ids": ((1,), (2048,)), "hidden": ((1, HIDDEN), (1, HIDDEN))}
    project = {"ids": ((1,), (1,)), "hidden": ((1, HIDDEN), (64, HIDDEN))}
    profiles = [embed, project]
    assert pick_profile(profiles, {"ids": (300,), "hidden": (1, HIDDEN)}) == 0
    assert pick_profile(profiles, {"ids": (1,), "hidden": (15, HIDDEN)}) == 1


def test_a_pass_no_profile_holds_is_one_line():
    with pytest.raises(GlanceError, match="no engine profile holds") as err:
        pick_profile(_target_profiles(256, 32), {"inputs_embeds": (1, 300, HIDDEN), "past_rows": (0,)})
    assert "\n" not in str(err.value)


def _record(module="tensorrt", version="10.3.0", cc="8.7", runs_on=None, max_batch=1) -> EnginesRecord:
    """Built on a GPU of `cc`, or ahead of time for every capability in `runs_on`."""
    return EnginesRecord(Path("engines"), module, version, (cc,) if cc else tuple(runs_on or ()), "fp16", 256, 64,
                         None, None, {}, {}, max_batch)


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


def test_a_batch_up_to_the_engines_is_served():
    """The pool's slots span 1 to the build's max_batch: any batch up to it runs on the same engines."""
    for asked in (1, 2, 8):
        check_engine_batch(_record(max_batch=8), asked)


@pytest.mark.parametrize("built,asked,message", [
    (1, 2, "--max-batch 2 is more than these engines serve: they were built for one sequence at a time "
           r"\(no batch profile\); pass --max-batch 1 or less, or rebuild with `glance-export build --max-batch 2`"),
    (4, 8, "they were built for at most 4 sequences a pass; pass --max-batch 4 or less")])
def test_a_batch_above_the_engines_is_refused(built, asked, message):
    with pytest.raises(GlanceError, match=message) as err:
        check_engine_batch(_record(max_batch=built), asked)
    assert "\n" not in str(err.value)


def test_engines_of_the_previous_record_format_are_refused_naming_the_rebuild(tmp_path):
    """Version 3 engines read a past of their own and kept batched rounds in engines of their own: the version
    header refuses them in one line before any field is read."""
    document = {"tensorrt": {"module": "tensorrt", "version": "10.3.0"}, "limits": {"max_context": 256, "max_tree": 64},
                "engines": {"target": {"file": "target.engine", "bytes": 1, "sha256": "0" * 64},
                            "target_batch": {"file": "target_batch.engine", "bytes": 1, "sha256": "0" * 64}}}
    (tmp_path / ENGINE_MANIFEST).write_text(json.dumps(stamped(document, engines_format.FORMAT, 3,
                                                               engines_format.HASH_FIELD)))
    with pytest.raises(GlanceError, match=r"is glance-engines format v3, an older format than the v4 this toolkit "
                                          r"reads; rebuild with `glance-export build`$") as err:
        read_engines_record(tmp_path)
    assert "\n" not in str(err.value)


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
