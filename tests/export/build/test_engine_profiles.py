"""The target and draft engines: one each, holding their weights once, with a lone sequence's profiles (target:
prefill and verify; draft: draft) and, where the build batches, a batch profile (B from 1 to max_batch, rows a
sequence up to max_tree or block_size); every profile over a KV pool of 1 to max_batch slots of 1 to the build's
context rows. `--max-batch` (default the device profile's, never above the export's) sizes them, and a default
that does not fit the memory budget is lowered with one line saying how to ask for it. TensorRT-RTX's CPU builder
builds them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from glance_export.build.engine_build import BuildRequest, build
from glance_export.build.local_gpu import BuildGpu
from glance_export.build.memory_plan import GIB, plan_memory, weights_bytes
from glance_export.build.precision import choose_precision
from glance_export.build.targets import PROFILE_NAMES, load_profile
from glance_export.build.tensorrt_build import BuildOptions, graph_job, shape_profiles
from glance_runtime.backends.trt_backend import pick_profile
from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import read as load_manifest
from support import TENSORRT_RTX_MISSING, export_once

RTX = load_profile("rtx")


@pytest.fixture(scope="module")
def artifacts(snapshot_dir, tmp_path_factory):
    return export_once(snapshot_dir, tmp_path_factory, "qwen3")[2]


def _sized(artifacts, **limits):
    """The manifest as the build sizes it for rtx (its default budget, or `limits`), and the plan."""
    manifest = load_manifest(artifacts)
    plan = plan_memory(RTX, manifest, artifacts, "fp32", BuildGpu(None), **limits)
    return plan.limits.apply(manifest), plan


def test_every_profile_names_a_default_batch():
    assert {name: load_profile(name).max_batch for name in PROFILE_NAMES} == {
        "jetson-orin": 4, "jetson-thor": 8, "datacenter": 16, "rtx": 8}


def test_target_and_draft_have_lone_and_batch_profiles(artifacts):
    sized, plan = _sized(artifacts)
    ctx, tree, block = plan.limits.max_context, plan.limits.max_tree, sized.block_size
    assert plan.limits.max_batch == RTX.max_batch and plan.reasons["max_batch"] == "rtx's default"
    prefill, verify, batch = shape_profiles(sized, "target")
    assert [p.name for p in (prefill, verify, batch)] == ["prefill", "verify", "batch"]
    pool = {"C_pool": (1, ctx, ctx)}
    assert prefill.axes == {"B": (1, 1, 1), "P": (1, 1, 8), **pool, "T": (1, min(256, ctx), ctx),
                            "S": (0, (ctx - 1) // 2, ctx - 1)}
    assert verify.axes["B"] == (1, 1, 1) and verify.axes["T"] == (1, min(32, tree), tree)
    assert batch.axes == {"B": (1, 8, 8), "P": (1, 8, 8), **pool, "T": (1, min(16, tree), tree),
                          "S": (0, (ctx - 1) // 2, ctx - 1)}
    lone, batched = shape_profiles(sized, "draft")
    assert (lone.name, lone.axes["B"], lone.axes["N"][2], lone.axes["P"]) == ("draft", (1, 1, 1), ctx, (1, 1, 8))
    assert (batched.name, batched.axes["B"], batched.axes["N"], batched.axes["P"]) == (
        "batch", (1, 8, 8), (1, block, block), (1, 8, 8))
    assert set(sized.graphs) == set(load_manifest(artifacts).graphs)  # no graph of its own for a batch


def test_max_batch_one_leaves_the_batch_profile_out(artifacts):
    sized, plan = _sized(artifacts, max_batch=1)
    assert (sized.max_batch, sized.axes["B"], sized.axes["P"], plan.batch_note) == (1, (1, 1), (1, 1), None)
    assert [p.name for p in shape_profiles(sized, "target")] == ["prefill", "verify"]
    assert [p.name for p in shape_profiles(sized, "draft")] == ["draft"]
    assert all(p.axes["P"] == (1, 1, 1) for p in shape_profiles(sized, "target"))


def _ranges(sized, graph: str) -> list[dict]:
    """Every profile's input ranges as the built engine reports them (min and max shape per input)."""
    entry = sized.graphs[graph]
    options = BuildOptions(choose_precision(RTX, None, sized.dtype, BuildGpu(None)), workspace_gib=1)
    job = graph_job("tensorrt_rtx", entry.file, "engine", entry.inputs, shape_profiles(sized, graph), options, None)
    return [{name: (tuple(shapes[i][0]), tuple(shapes[i][2])) for name, shapes in job.inputs.items()}
            for i in range(job.profiles)]


def _target_pass(sized, batch: int, rows: int, past: int, slots: int, pool_rows: int) -> dict:
    """The input shapes of a target pass as the graph backend binds them."""
    m, shapes = sized, {}
    for name, spec in m.graphs["target"].inputs.items():
        sizes = {"B": batch, "T": rows, "S": past, "P": slots, "C_pool": pool_rows, "N_img": 0}
        shapes[name] = tuple(sizes[d] if isinstance(d, str) else d for d in spec["shape"])
    return shapes


@pytest.mark.parametrize("batch,rows,slots,expected", [
    (1, 100, 1, "prefill"), (1, 5, 1, "verify"), (1, 100, 8, "prefill"), (1, 5, 8, "verify"), (3, 5, 8, "batch"),
    (8, 32, 8, "batch")])
def test_each_pass_runs_in_its_own_profile(artifacts, batch, rows, slots, expected):
    """A lone sequence's prefill and verify (over a one-slot pool, or a batching runtime's whole pool) and a
    batched round each pick their profile of the one target engine."""
    sized, plan = _sized(artifacts)
    names = [p.name for p in shape_profiles(sized, "target")]
    shapes = _target_pass(sized, batch, rows, past=40, slots=slots, pool_rows=plan.limits.max_context)
    assert names[pick_profile(_ranges(sized, "target"), shapes)] == expected


def test_a_runtime_at_a_lower_context_holds_a_shorter_pool(artifacts):
    sized, _ = _sized(artifacts)
    shapes = _target_pass(sized, 1, 5, past=40, slots=1, pool_rows=64)
    assert shape_profiles(sized, "target")[pick_profile(_ranges(sized, "target"), shapes)].name == "verify"


def test_weights_are_counted_once(artifacts):
    """The budget holds each graph's file and data once: there is no second target or draft engine."""
    manifest = load_manifest(artifacts)
    _, plan = _sized(artifacts)
    files = {name for entry in manifest.graphs.values() for name in (entry.file, entry.data_file) if name}
    assert plan.budget.weights_gib == pytest.approx(sum((artifacts / f).stat().st_size for f in files) / GIB)
    assert plan.budget.weights_gib == pytest.approx(weights_bytes(artifacts, manifest.graphs) / GIB)


def test_max_batch_sizes_the_pool(artifacts):
    sized, two = _sized(artifacts, max_batch=2)
    assert (sized.max_batch, sized.axes["B"], sized.axes["P"]) == (2, (1, 2), (1, 2))
    assert two.kv_rows == 2 * two.limits.max_context and "max batch 2 (--max-batch)" in two.explain()
    batch = shape_profiles(sized, "target")[-1]
    assert batch.axes["B"] == (1, 2, 2) and batch.axes["C_pool"] == (1, two.limits.max_context, two.limits.max_context)
    with pytest.raises(GlanceError, match="--max-batch 32 is more than the export's 16"):
        _sized(artifacts, max_batch=32)
    single = replace(load_manifest(artifacts), max_batch=1)
    one = plan_memory(RTX, single, artifacts, "fp32", BuildGpu(None))
    assert one.limits.max_batch == 1 and one.reasons["max_batch"] == "the export's limit" and one.batch_note is None


def test_a_default_batch_that_does_not_fit_is_lowered_in_one_line(artifacts):
    """The pool holds a context of KV rows a sequence: room for three and a half contexts is a batch of three, and
    room for less than two leaves the batch profile out; either way the build goes on, saying how to ask for the
    default batch."""
    _, roomy = _sized(artifacts)
    b, ctx = roomy.budget, roomy.limits.max_context
    room = lambda contexts: b.reserve_gib + b.workspace_gib + b.weights_gib + b.kv_bytes_per_row * ctx * contexts / GIB
    sized, tight = _sized(artifacts, memory_gib=room(3.5))
    assert (tight.limits.max_context, tight.limits.max_batch) == (ctx, 3) and sized.axes["P"] == (1, 3)
    assert tight.reasons["max_batch"] == "what fits the memory budget" and tight.total_gib <= tight.budget.usable_gib
    assert "\n" not in tight.batch_note and tight.batch_note.startswith(
        f"max batch lowered from rtx's default 8 to 3: with 8 sequences of {ctx} context rows the build needs ")
    assert tight.batch_note.endswith(f"; to build for 8, pass --max-batch 8 with --max-context {ctx * 7 // 16} or less")
    sized, alone = _sized(artifacts, memory_gib=room(1.5))
    assert alone.limits.max_batch == 1 and [p.name for p in shape_profiles(sized, "target")] == ["prefill", "verify"]
    assert "to 1 (one sequence at a time: no batch profile)" in alone.batch_note


def test_a_requested_batch_that_does_not_fit_is_refused(artifacts):
    _, roomy = _sized(artifacts)
    b, ctx = roomy.budget, roomy.limits.max_context
    memory = b.reserve_gib + b.workspace_gib + b.weights_gib + b.kv_bytes_per_row * ctx * 3.5 / GIB
    with pytest.raises(GlanceError, match=rf"^8 sequences of {ctx} context rows do not fit rtx: .*; lower --max-batch "
                                          rf"to 3 or --max-context to {ctx * 7 // 16}, or pass --memory-gib") as err:
        _sized(artifacts, memory_gib=memory, max_batch=8)
    assert "\n" not in str(err.value)


def test_build_says_when_it_lowers_the_batch(artifacts, tmp_path):
    _, roomy = _sized(artifacts)
    b, ctx = roomy.budget, roomy.limits.max_context
    memory = b.reserve_gib + b.workspace_gib + b.weights_gib + b.kv_bytes_per_row * ctx * 3.5 / GIB
    lines: list[str] = []
    build(BuildRequest(target="rtx", out=tmp_path / "bundle", artifacts=artifacts, memory_gib=memory, plan_only=True),
          BuildGpu(None), progress=lines.append)
    assert sum("max batch lowered from rtx's default 8 to 3" in line for line in lines) == 1


def test_tensorrt_rtx_builds_one_engine_per_graph(artifacts, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    out = build(BuildRequest(target="rtx", out=tmp_path / "engines", artifacts=artifacts), BuildGpu(None),
                progress=lambda _: None)
    record = json.loads((out / "engines.json").read_text())
    manifest = load_manifest(artifacts)
    assert record["limits"]["max_batch"] == RTX.max_batch and record["format_version"] == 4
    assert set(record["engines"]) == set(manifest.graphs)
    assert sorted(p.name for p in out.glob("*.engine")) == sorted(f"{g}.engine" for g in manifest.graphs)
    ctx, tree = record["limits"]["max_context"], record["limits"]["max_tree"]
    target, draft = record["engines"]["target"]["profiles"], record["engines"]["draft"]["profiles"]
    assert list(target) == ["prefill", "verify", "batch"] and list(draft) == ["draft", "batch"]
    assert target["batch"] == {"B": [1, 8, 8], "P": [1, 8, 8], "C_pool": [1, ctx, ctx], "T": [1, min(16, tree), tree],
                               "S": [0, (ctx - 1) // 2, ctx - 1]}
    assert draft["batch"]["N"] == [1, manifest.block_size, manifest.block_size]
