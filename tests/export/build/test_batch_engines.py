"""The batched round's engines: TensorRT-RTX's CPU builder builds target_batch and draft_batch with one profile
each (B from 1 to max_batch, rows a sequence up to max_tree or block_size, the pool's P and C_pool fixed), sized by
`--max-batch` (default the device profile's, never above the export's); at max_batch 1, or from an export without
them, there are none."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from glance_export.build.engine_build import BuildRequest, build
from glance_export.build.local_gpu import BuildGpu
from glance_export.build.memory_plan import plan_memory
from glance_export.build.targets import PROFILE_NAMES, load_profile
from glance_export.build.tensorrt_build import shape_profiles
from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import read as load_manifest
from glance_runtime.formats.graphs import BATCH_GRAPHS
from support import TENSORRT_RTX_MISSING, export_once

RTX = load_profile("rtx")


@pytest.fixture(scope="module")
def artifacts(snapshot_dir, tmp_path_factory):
    return export_once(snapshot_dir, tmp_path_factory, "qwen3")[2]


def test_every_profile_names_a_default_batch():
    assert {name: load_profile(name).max_batch for name in PROFILE_NAMES} == {
        "jetson-orin": 4, "jetson-thor": 8, "datacenter": 16, "rtx": 8}


def test_tensorrt_rtx_builds_the_batch_engines(artifacts, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    out = build(BuildRequest(target="rtx", out=tmp_path / "engines", artifacts=artifacts), BuildGpu(None),
                progress=lambda _: None)
    record = json.loads((out / "engines.json").read_text())
    assert record["limits"]["max_batch"] == RTX.max_batch and record["memory_plan"]["reasons"]["max_batch"] == \
        "rtx's default"
    manifest = load_manifest(artifacts)
    ctx, tree = record["limits"]["max_context"], record["limits"]["max_tree"]
    target, draft = (record["engines"][name]["profiles"]["batch"] for name in BATCH_GRAPHS)
    assert target == {"B": [1, 8, 8], "T_b": [1, 16, tree], "S_b": [0, (ctx - 1) // 2, ctx - 1], "P": [8, 8, 8],
                      "C_pool": [ctx] * 3}
    assert draft["N_b"] == [1, manifest.block_size, manifest.block_size] and draft["P"] == [8, 8, 8]
    assert all((out / f"{name}.engine").stat().st_size > 0 for name in BATCH_GRAPHS)


def test_max_batch_lowers_the_pool_or_leaves_the_batch_engines_out(artifacts):
    manifest = load_manifest(artifacts)
    two = plan_memory(RTX, manifest, artifacts, "fp32", BuildGpu(None), max_batch=2)
    sized = two.limits.apply(manifest)
    assert (sized.max_batch, sized.axes["B"], sized.axes["P"]) == (2, (1, 2), (2, 2))
    assert two.kv_rows == 2 * two.limits.max_context and "max batch 2 (--max-batch)" in two.explain()
    (profile,) = shape_profiles(sized, "target_batch")
    assert profile.axes["B"] == (1, 2, 2) and profile.axes["C_pool"] == (two.limits.max_context,) * 3
    one = plan_memory(RTX, manifest, artifacts, "fp32", BuildGpu(None), max_batch=1)
    assert not set(BATCH_GRAPHS) & set(one.limits.apply(manifest).graphs)
    with pytest.raises(GlanceError, match="--max-batch 32 is more than the export's 16"):
        plan_memory(RTX, manifest, artifacts, "fp32", BuildGpu(None), max_batch=32)
    single = replace(manifest, max_batch=1, graphs={k: v for k, v in manifest.graphs.items() if k not in BATCH_GRAPHS})
    older = plan_memory(RTX, single, artifacts, "fp32", BuildGpu(None))
    assert older.limits.max_batch == 1 and older.reasons["max_batch"] == "the export has no batched graphs"


def test_a_batch_that_does_not_fit_is_lowered_or_refused(artifacts):
    """The pool holds a context of KV rows a sequence: room for three contexts is a batch of three."""
    manifest = load_manifest(artifacts)
    roomy = plan_memory(RTX, manifest, artifacts, "fp32", BuildGpu(None))
    b, ctx = roomy.budget, roomy.limits.max_context
    memory = b.reserve_gib + b.workspace_gib + b.weights_gib + b.kv_bytes_per_row * ctx * 3.5 / (1 << 30)
    tight = plan_memory(RTX, manifest, artifacts, "fp32", BuildGpu(None), memory_gib=memory)
    assert (tight.limits.max_context, tight.limits.max_batch) == (ctx, 3)
    assert tight.reasons["max_batch"] == "what fits the memory budget" and tight.total_gib <= tight.budget.usable_gib
    with pytest.raises(GlanceError, match="8 sequences of .* do not fit rtx: .*lower --max-batch to 3"):
        plan_memory(RTX, manifest, artifacts, "fp32", BuildGpu(None), memory_gib=memory, max_batch=8)
