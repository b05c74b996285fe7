"""`glance-export build`: real TensorRT-RTX engines for every family with a checked engine manifest, each
refusal as one line with exit 2 and nothing written (the GPU and the TensorRT version are simulated; the
build never is), the --plan-only bundle, and the --artifacts path on an install without torch or onnx."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from importlib import resources
from pathlib import Path

from glance_runtime.store.atomic import MARKER
import pytest

from glance_export import cli
from glance_export.build import local_gpu as devices
from glance_export.model.adapters import Snapshot
from glance_export.build.targets import PROFILE_NAMES, load_profile, profile_text
from glance_export.build.local_gpu import BuildGpu, probe_device, resolve_target
from glance_export.build.engine_build import BuildRequest, build, check_out
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.build.memory_plan import Limits, kv_bytes_per_row, weights_bytes
from glance_export.build.tensorrt_build import shape_profiles
from glance_export.build.toolchain import Toolchain
from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import read as load_manifest
from glance_runtime.store.integrity import sha256
from support import ALL_FAMILIES, TENSORRT_RTX_MISSING, blocking, export_once

trt = pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)

NO_GPU = BuildGpu(None)
H100 = BuildGpu("NVIDIA H100 80GB HBM3", "9.0", 79.6)
A10 = BuildGpu("NVIDIA A10", "8.6", 22.5)
ORIN = BuildGpu("NVIDIA Jetson AGX Orin Developer Kit", "8.7", 30.6, "orin")
GTX1080 = BuildGpu("NVIDIA GeForce GTX 1080", "6.1", 8.0)


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    """family -> (model dir, head dir, artifacts dir), shared with the other export tests."""
    return lambda family, variant="fp32": export_once(snapshot_dir, tmp_path_factory, family, variant)


def run_cli(monkeypatch, capsys, device: BuildGpu, *argv: str) -> tuple[int, str, str]:
    """`glance-export build ...` in process, on a machine whose GPU probe finds `device`."""
    monkeypatch.setattr(devices, "probe_device", lambda: device)
    rc = cli.main(["build", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _manifest(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("family", [f if f == "qwen3" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in ALL_FAMILIES])
def test_build_rtx_engines_for_every_family(exported, monkeypatch, capsys, tmp_path, family):
    _, _, artifacts = exported(family)
    out = tmp_path / "engines"
    rc, stdout, _ = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts, "--out", out)
    assert rc == 0
    art, typed = _manifest(artifacts / "manifest.json"), load_manifest(artifacts)
    record = _manifest(out / "engines.json")
    typed = Limits(**record["limits"]).apply(typed)  # the batch lowered to the rtx profile's
    assert set(record["engines"]) == set(art["graphs"])
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "engines.json", *(f"{g}.engine" for g in art["graphs"])])
    for graph, entry in record["engines"].items():
        engine = out / entry["file"]
        assert entry["bytes"] == engine.stat().st_size > 0 and entry["sha256"] == sha256(engine)
        assert [o["sha256"] for o in entry["onnx"]] == [sha256(artifacts / o["file"]) for o in entry["onnx"]]
        assert entry["onnx"][0]["file"] == art["graphs"][graph]["file"]
        profiles = shape_profiles(typed, graph)
        assert entry["profiles"] == {p.name: {a: list(r) for a, r in p.axes.items()} for p in profiles}
    assert record["tensorrt"] == {"module": "tensorrt_rtx", "version": trt.__version__}
    assert record["device"]["name"] == "ahead-of-time, no GPU" and record["target"] == "rtx"
    assert record["target_profile"] == json.loads(profile_text("rtx")), "the profile's file, recorded whole"
    assert record["precision"] == {"name": "fp32", "artifacts_dtype": "fp32", "how": "the graphs' own fp32 dtypes"}
    assert record["artifacts"]["manifest_sha256"] == sha256(artifacts / "manifest.json")
    assert record["artifacts"]["source"] == art["source"]
    assert record["artifacts"]["head_weights_sha256"] == art["head"]["weights_sha256"]
    assert record["limits"]["max_context"] == art["limits"]["max_context"] and record["build_s"] > 0
    lines = stdout.splitlines()
    assert all(line.startswith("[") and "s] " in line for line in lines)
    assert sum("built " in line for line in lines) == len(art["graphs"]) and "memory plan:" in stdout


def test_lower_limits_size_the_engine_profiles(exported, monkeypatch, capsys, tmp_path):
    _, _, artifacts = exported("qwen2_5_vl")
    rc, stdout, _ = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts,
                            "--out", tmp_path / "e", "--max-context", 96, "--max-tree", 16, "--max-batch", 2)
    assert rc == 0 and "max context 96 (--max-context), max tree 16 (--max-tree), max batch 2 (--max-batch)" in stdout
    record = _manifest(tmp_path / "e" / "engines.json")
    assert record["limits"] == {"max_context": 96, "max_tree": 16, "max_image_tokens": 48, "max_batch": 2}
    target = record["engines"]["target"]["profiles"]
    assert target["batch"]["P"] == [1, 2, 2] and target["batch"]["B"] == [1, 2, 2] and target["verify"]["B"] == [1, 1, 1]
    assert target["prefill"]["T"][2] == 96 and target["verify"]["T"][2] == 16 and target["prefill"]["N_img"][2] == 48
    assert record["engines"]["vision"]["profiles"]["vision"]["N_merged"][2] == 48


def test_model_and_head_export_through_the_cache_and_build(snapshot_dir, monkeypatch, capsys, tmp_path, exported):
    model, head, _ = exported("qwen3")
    args = ("--target", "rtx", "--model", model, "--head", head, "--out", tmp_path / "e")
    rc, _, _ = run_cli(monkeypatch, capsys, NO_GPU, *args)  # exports, unless an earlier test did
    assert rc == 0
    record = _manifest(tmp_path / "e" / "engines.json")
    assert record["artifacts"]["source"]["config_sha256"] == sha256(model / "config.json")
    rc, stdout, _ = run_cli(monkeypatch, capsys, NO_GPU, *args)
    assert rc == 0 and "exporting" not in stdout  # the cached export is reused


def test_timing_cache_is_written_atomically_where_the_builder_keeps_one(exported, tmp_path):
    """rtx's profile says TensorRT-RTX ignores timing caches (they are no-ops there since 1.2); with the
    profile saying otherwise, the same builder calls still run and the cache file is written whole."""
    _, _, artifacts = exported("qwen3")
    cache = tmp_path / "caches" / "timing.cache"
    request = BuildRequest("rtx", tmp_path / "e", artifacts=artifacts, timing_cache=cache)
    build(request, NO_GPU, progress=lambda _: None)
    note = _manifest(tmp_path / "e" / "engines.json")["timing_cache"]
    assert not cache.exists() and not note["used"] and "ignores timing caches" in note["note"]
    profile = load_profile("rtx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TensorRT-RTX deprecates the (no-op) cache calls
        build(request, NO_GPU, profile=dataclasses.replace(profile, timing_cache=True), progress=lambda _: None)
    assert cache.stat().st_size > 0 and os.listdir(cache.parent) == ["timing.cache"]
    assert _manifest(tmp_path / "e" / "engines.json")["timing_cache"]["used"]


REFUSALS = {  # id: (simulated GPU, flags besides --artifacts and --out, pattern of the one-line error)
    "no-tensorrt": (H100, "--target datacenter",
                    r"tensorrt, which is not installed here \(pip install tensorrt-cu12.*--plan-only"),
    "gpu-not-in-profile": (GTX1080, "--target rtx", r"GTX 1080 \(compute capability 6\.1\) is not a rtx GPU"),
    "gpu-of-another-target": (H100, "--target jetson-orin", r"is not a jetson-orin GPU .*use --target datacenter"),
    "no-gpu-for-full-tensorrt": (NO_GPU, "--target jetson-orin", r"no NVIDIA GPU found.*--plan-only"),
    "jetson-off-device": (NO_GPU, "--target jetson", r"picks Orin or Thor .* name one: --target jetson-orin"),
    "fp8-on-orin": (ORIN, "--target jetson-orin --precision fp8", r"jetson-orin cannot run fp8 engines \(Orin's"),
    "fp8-below-sm89": (A10, "--target datacenter --precision fp8", r"fp8 needs compute capability >= 8\.9"),
    "fp8-without-quantized-export": (H100, "--target datacenter --precision fp8",
                                     r"fp8 engines need an FP8-quantized export"),
    "strongly-typed-dtype-mismatch": (NO_GPU, "--target rtx --precision fp16",
                                      r"strongly typed .* these artifacts are fp32, not fp16; "
                                      r"re-export with `glance-export onnx --dtype fp16`"),
    "bf16-not-exportable": (NO_GPU, "--target rtx --precision bf16",
                            r"exports fp32 or fp16 only; use --precision fp32"),
    "context-above-export": (NO_GPU, "--target rtx --max-context 4096",
                             r"--max-context 4096 is more than the export's 256.*onnx --max-context 4096"),
    "tree-above-export": (NO_GPU, "--target rtx --max-tree 64", r"--max-tree 64 is more than the export's 32"),
    "does-not-fit": (NO_GPU, "--target rtx --memory-gib 2.5",
                     r"does not fit rtx: at a 256-row context it needs 2\.00 GiB, 0\.50 GiB over the budget of "
                     r"1\.5 GiB .*--workspace-gib"),
    "workspace-above-cap": (NO_GPU, "--target rtx --workspace-gib 16", r"--workspace-gib 16 is outside rtx's"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_are_one_line_and_write_nothing(exported, monkeypatch, capsys, tmp_path, case):
    device, flags, pattern = REFUSALS[case]
    if case == "no-tensorrt" and importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("full TensorRT is installed here")
    _, _, artifacts = exported("qwen3")
    rc, stdout, stderr = run_cli(monkeypatch, capsys, device, *flags.split(), "--artifacts", artifacts,
                                 "--out", tmp_path / "e")
    assert rc == 2 and stderr.count("\n") == 1 and stderr.startswith("glance-export: error: ")
    assert "Traceback" not in stderr and re.search(pattern, stderr), stderr
    assert list(tmp_path.iterdir()) == []


def test_memory_refusal_names_the_context_that_fits(exported, monkeypatch, capsys, tmp_path):
    _, _, artifacts = exported("qwen3")
    art = load_manifest(artifacts)
    rtx = load_profile("rtx")
    rows = 100  # leave room for exactly this many KV rows
    gib = rtx.reserve_gib + 1 + (weights_bytes(artifacts, art.graphs) + rows * kv_bytes_per_row(art) + 512) / (1 << 30)
    rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts,
                            "--out", tmp_path / "e", "--memory-gib", f"{gib:.9f}", "--workspace-gib", 1,
                            "--max-context", 200)
    assert rc == 2 and f"lower --max-context to {rows} or below" in stderr and not (tmp_path / "e").exists()


def test_tensorrt_version_outside_the_range_is_refused(exported, tmp_path):
    _, _, artifacts = exported("qwen3")
    request = BuildRequest("rtx", tmp_path / "e", artifacts=artifacts)
    with pytest.raises(GlanceError, match=r"tensorrt_rtx 1\.5\.0 is outside the rtx range \(>= 1\.7, < 2\)"):
        build(request, NO_GPU, Toolchain(trt, "1.5.0"))
    assert not (tmp_path / "e").exists()


def test_artifacts_from_another_model_or_head_are_refused(exported, monkeypatch, capsys, tmp_path):
    model, head, artifacts = exported("qwen3")
    other_model = exported("llama")[0]
    snap = Snapshot(model)
    other_head = save_head(init_head(head_config_for(snap, 2, 6, pick_mask_token(snap)), seed=11), tmp_path / "h")
    for m, h, pattern in ((other_model, head, "config.json differs from the one"),
                          (model, other_head, "model.safetensors differs from the head")):
        rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts,
                                "--model", m, "--head", h, "--out", tmp_path / "e")
        assert rc == 2 and pattern in stderr and not (tmp_path / "e").exists()


def test_missing_manifest_and_missing_head_are_one_line_errors(monkeypatch, capsys, tmp_path):
    (tmp_path / "art").mkdir()
    rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", tmp_path / "art", "--out",
                            tmp_path / "e")
    assert rc == 2 and "has no manifest.json" in stderr
    rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--model", tmp_path / "art",
                            "--out", tmp_path / "e")
    assert rc == 2 and "--model and --head" in stderr


def test_out_never_replaces_the_export_or_a_foreign_directory(exported, monkeypatch, capsys, tmp_path):
    _, _, artifacts = exported("qwen3")
    before = sorted(p.name for p in artifacts.iterdir())
    rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts,
                            "--out", artifacts)
    assert rc == 2 and "is the input" in stderr and sorted(p.name for p in artifacts.iterdir()) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    for extra in ([], ["--plan-only"]):
        rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts,
                                "--out", tmp_path / "mine", *extra)
        assert rc == 2 and "no glance command made" in stderr and (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    for extra in ([], ["--plan-only"]):  # nested in the export, replaced whole by the next export into it
        rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts,
                                "--out", artifacts / "engines", *extra)
        assert rc == 2 and "lies inside the input" in stderr and sorted(p.name for p in artifacts.iterdir()) == before


def test_engines_may_be_built_inside_their_bundle_and_nowhere_else_in_it(exported, monkeypatch, capsys, tmp_path):
    """A bundle's build.sh builds into the bundle's own engines/; a bundle is never replaced by engines."""
    _, _, artifacts = exported("qwen3")
    bundle = tmp_path / "bundle"
    rc, _, _ = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", artifacts, "--out", bundle,
                       "--plan-only")
    assert rc == 0
    check_out(BuildRequest(target="rtx", out=bundle / "engines", artifacts=bundle))
    for out, why in ((bundle, "is the input"), (tmp_path, "holds the input")):
        with pytest.raises(GlanceError, match=why):
            check_out(BuildRequest(target="rtx", out=out, artifacts=bundle))
    with pytest.raises(GlanceError, match="lies inside the input"):
        check_out(BuildRequest(target="rtx", out=bundle / "again", artifacts=bundle, plan_only=True))


def test_device_profiles_state_the_platform_facts():
    """The files in engines/ are the ones the installed package reads, and say what the platforms are."""
    packaged = resources.files("glance_export.build").joinpath("profiles")
    engines = Path(__file__).resolve().parents[3] / "engines" / "profiles"
    assert sorted(p.name for p in engines.glob("*.json")) == sorted(f"{n}.json" for n in PROFILE_NAMES)
    assert all(packaged.joinpath(f"{n}.json").read_text() == (engines / f"{n}.json").read_text() for n in PROFILE_NAMES)
    orin, thor, dc, rtx = (load_profile(n) for n in PROFILE_NAMES)
    assert orin.compute_capabilities == ("8.7",) and "fp8" not in orin.precisions and orin.min_version == "10.3"
    assert orin.max_opset == 20 and orin.attention_op_from == "10.14"
    assert thor.compute_capabilities == ("11.0",) and "fp8" in thor.precisions and thor.min_version == "10.13"
    assert set(dc.compute_capabilities) == {"8.0", "8.6", "8.9", "9.0", "10.0"}
    assert dc.precision_min_cc == {"fp8": "8.9"}
    assert rtx.module == "tensorrt_rtx" and rtx.strongly_typed and rtx.ahead_of_time and not rtx.timing_cache
    for p in (orin, thor, dc, rtx):
        assert p.default_precision in p.precisions and 0 < p.workspace_gib <= p.max_workspace_gib
        assert p.reserve_gib < p.memory_gib and p.module in ("tensorrt", "tensorrt_rtx")
        assert p.workspace_note and p.quant_note, "the refusals quote why a bound is where it is"
    assert orin.max_workspace_gib <= 4 and thor.max_workspace_gib <= 4  # shared memory on Jetson


def test_jetson_is_detected_from_the_device_tree_or_the_l4t_release(tmp_path):
    orin = tmp_path / "orin"
    (orin / "proc/device-tree").mkdir(parents=True)
    (orin / "proc/device-tree/model").write_bytes(b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit\x00")
    (orin / "proc/meminfo").write_text("MemTotal:        7999568 kB\nMemFree: 1 kB\n")
    device = probe_device(orin)
    assert (device.jetson, device.compute_capability) == ("orin", "8.7")
    assert device.memory_gib == pytest.approx(7.63, 0.01)
    assert resolve_target("jetson", device) == "jetson-orin"
    thor = tmp_path / "thor"
    (thor / "etc").mkdir(parents=True)
    (thor / "etc/nv_tegra_release").write_text("# R38 (release), REVISION: 2.0, GCID: 1, BOARD: generic\n")
    assert resolve_target("jetson", probe_device(thor)) == "jetson-thor"
    assert resolve_target("jetson", BuildGpu("NVIDIA Thor", "11.0")) == "jetson-thor"
    with pytest.raises(GlanceError, match="name one"):
        resolve_target("jetson", H100)


def test_plan_only_writes_a_bundle_the_device_builds_from(exported, monkeypatch, capsys, tmp_path):
    _, _, artifacts = exported("qwen2_5_vl")
    bundle = tmp_path / "bundle"
    rc, stdout, _ = run_cli(monkeypatch, capsys, NO_GPU, "--target", "jetson-orin", "--artifacts", artifacts,
                            "--out", bundle, "--plan-only", "--precision", "fp16", "--max-context", 128)
    assert rc == 0 and "memory plan:" in stdout and "./build.sh" in stdout
    exported_files = sorted(p.name for p in artifacts.iterdir() if p.name != MARKER)
    written = [MARKER, "README.md", "build.sh", "jetson-orin.json"]
    assert sorted(p.name for p in bundle.iterdir()) == sorted(exported_files + written)
    assert all((bundle / n).read_bytes() == (artifacts / n).read_bytes() for n in exported_files)
    assert (bundle / "target.onnx").stat().st_ino == (artifacts / "target.onnx").stat().st_ino  # hard-linked
    assert (bundle / "jetson-orin.json").read_text() == profile_text("jetson-orin")
    command = "glance-export build --artifacts . --target jetson-orin --out engines --precision fp16 --max-context 128"
    assert (bundle / "build.sh").read_text() == f'#!/bin/sh\ncd "$(dirname "$0")" && exec {command} "$@"\n'
    assert os.access(bundle / "build.sh", os.X_OK)
    readme = (bundle / "README.md").read_text()
    assert command in readme and "JetPack" in readme and "BuilderFlag.FP16" in readme
    # Run here, the script reaches the build and refuses: this machine is not an Orin.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run([str(bundle / "build.sh")], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    if probe_device().jetson != "orin":
        assert run.returncode == 2 and "jetson-orin" in run.stderr and not (bundle / "engines").exists()
    # The bundle is a complete export: TensorRT-RTX builds it as is.
    rc, _, _ = run_cli(monkeypatch, capsys, NO_GPU, "--target", "rtx", "--artifacts", bundle, "--out", tmp_path / "e")
    assert rc == 0 and (tmp_path / "e" / "vision.engine").is_file()


def test_plan_only_for_jetson_needs_a_named_module(exported, monkeypatch, capsys, tmp_path):
    _, _, artifacts = exported("qwen3")
    rc, _, stderr = run_cli(monkeypatch, capsys, NO_GPU, "--target", "jetson", "--artifacts", artifacts,
                            "--out", tmp_path / "b", "--plan-only")
    assert rc == 2 and "name one" in stderr and not (tmp_path / "b").exists()


# The edge install's build: TensorRT and Polygraphy (its `gpu` extra), no export stack. The blocker is a
# sitecustomize, so the per-graph worker processes the build starts are held to it too.
EDGE_BUILD_BLOCKER = blocking("torch", "transformers", "safetensors", "onnx", "onnxscript")
EDGE_BUILD = """
import sys
from glance_export import cli
from glance_export.build import local_gpu as devices
from glance_export.model.adapters import Snapshot

devices.probe_device = lambda: devices.BuildGpu(None)  # whatever GPU this machine has: build ahead of time
assert cli.main(["build", "--artifacts", sys.argv[1], "--out", sys.argv[2], "--target", "rtx"]) == 0
sys.modules["tensorrt_rtx"] = None  # the plan needs no TensorRT at all
plan = ["build", "--artifacts", sys.argv[1], "--out", sys.argv[3], "--target", "jetson-thor", "--plan-only"]
assert cli.main(plan) == 0
"""


def test_artifacts_build_runs_without_torch_or_onnx(exported, tmp_path):
    _, _, artifacts = exported("qwen2_vl")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(EDGE_BUILD_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *sys.path])}
    run = subprocess.run([sys.executable, "-c", EDGE_BUILD, str(artifacts), str(tmp_path / "e"), str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    graphs = _manifest(artifacts / "manifest.json")["graphs"]
    assert set(_manifest(tmp_path / "e" / "engines.json")["engines"]) == set(graphs)
    assert (tmp_path / "b" / "build.sh").read_text().count("--target jetson-thor") == 1
    blocked = subprocess.run([sys.executable, "-c", "import onnx"], capture_output=True, text=True, env=env)
    assert blocked.returncode == 1 and "blocked" in blocked.stderr  # the blocker reaches every child process


def test_build_refuses_a_machine_that_cannot_hold_the_builder(exported, tmp_path):
    """From the artifacts alone, before any worker starts: the shortfall and what to change, in one line."""
    _, _, artifacts = exported("qwen3")
    request = BuildRequest("rtx", tmp_path / "e", artifacts=artifacts, workspace_gib=1)
    with pytest.raises(GlanceError, match=r"has 0\.50 GiB of memory available and the build needs about 1\.0\d GiB "
                                          r"\(0\.5\d GiB short; builder peak .*3\.2 x the parsed weights of target, "
                                          r"[\d.]+ MiB \+ 1 GiB for the process\)\); .*--plan-only"):
        build(request, NO_GPU, host_memory_gib=0.5, progress=lambda _: None)
    assert not (tmp_path / "e").exists()
    build(request, NO_GPU, host_memory_gib=1.5, progress=lambda _: None)
    record = _manifest(tmp_path / "e" / "engines.json")
    assert record["memory_plan"]["build_peak_graph"] == "target" and 1 < record["memory_plan"]["build_peak_gib"] < 1.1
    # Each graph was built in its own worker, whose measured peak stays under the estimate.
    peaks = [e["peak_rss_gib"] for e in record["engines"].values()]
    assert len(set(peaks)) > 1 and all(0.05 < p < record["memory_plan"]["build_peak_gib"] for p in peaks)
