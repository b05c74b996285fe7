"""The CPU provider's load estimate against what a real session holds, and the refusal it drives."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_runtime.backends.host_room import PROCESS_BYTES, buffer_bytes, check_cpu_room, cpu_load_bytes, weight_bytes
from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import read as read_manifest
from support import make_mid_snapshot

ROOT = Path(__file__).resolve().parents[3]
CONTEXT = 256
LOAD_SCRIPT = """
import sys
from glance_runtime.backends.ort_backend import OrtBackend

def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) * 1024

import onnxruntime, numpy
before = rss()
backend = OrtBackend(sys.argv[1], max_context=int(sys.argv[2]), threads=1, max_batch=int(sys.argv[3]))
print(rss() - before, backend.kv_bytes)
"""


@pytest.fixture(scope="module")
def wide_fp16(tmp_path_factory) -> Path:
    """A text model wide enough (hidden 1024, about 40 MB of fp16 weights) for its weights to dominate a load."""
    root = tmp_path_factory.mktemp("wide")
    snap, _ = make_mid_snapshot(root / "snap", 2)
    s = Snapshot(snap)
    head = save_head(init_head(head_config_for(s, 1, 6, pick_mask_token(s)), seed=0), root / "head")
    return export_artifacts(snap, head, root / "art", dtype="fp16", max_tree=16, max_context=CONTEXT,
                            progress=lambda _: None)


def load_growth(artifacts: Path, max_batch: int = 1) -> tuple[int, int]:
    """(bytes a fresh process grows by opening the graphs, bytes of its KV pools), measured in a child."""
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'runtime'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(artifacts), str(CONTEXT), str(max_batch)], env=env,
                          capture_output=True, text=True, check=True)
    grown, kv = done.stdout.split()[-2:]
    return int(grown), int(kv)


def test_the_estimate_covers_a_real_load_and_counts_the_fp32_copies(wide_fp16):
    """A CPU session of fp16 graphs grows by about twice their bytes (the provider's fp32 copies): an
    estimate of the file bytes alone would let a load that cannot fit start; this one covers it."""
    grown, _ = load_growth(wide_fp16)
    manifest = read_manifest(wide_fp16)
    weights = weight_bytes(manifest)
    assert weights > 30e6
    assert grown > 1.5 * weights, (grown, weights)
    assert grown < cpu_load_bytes(manifest, CONTEXT), (grown, cpu_load_bytes(manifest, CONTEXT))


def test_a_batching_load_holds_the_weights_once(wide_fp16):
    """Opening the graphs for four sequences holds what opening them for one does, plus the larger KV pool, within
    5%: the same sessions serve a lone sequence and a batch, so no weight is held twice."""
    alone, kv_alone = load_growth(wide_fp16, 1)
    batched, kv_batched = load_growth(wide_fp16, 4)
    assert kv_batched == 4 * kv_alone
    assert batched <= alone + (kv_batched - kv_alone) + 0.05 * alone, (batched, alone, kv_batched)


def test_weight_bytes_are_the_files_the_backend_opens(wide_fp16):
    """Every graph the manifest lists, each opened once whatever the batch; the KV pool grows with the batch."""
    manifest = read_manifest(wide_fp16)
    files = {n for e in manifest.graphs.values() for n in (e.file, e.data_file) if n}
    assert {"target.onnx", "draft.onnx", "vocab.onnx"} <= files
    assert not any("batch" in name for name in files)
    assert weight_bytes(manifest) == sum((wide_fp16 / f).stat().st_size for f in files)
    kv = sum(2 * s.num_layers * s.kv_heads * s.head_dim for s in (manifest.target, manifest.head)) * 2
    assert buffer_bytes(manifest, CONTEXT, 4) - buffer_bytes(manifest, CONTEXT) == 3 * kv * CONTEXT


def test_a_load_that_cannot_fit_is_refused_in_one_line_before_any_session(wide_fp16):
    manifest = read_manifest(wide_fp16)
    need = cpu_load_bytes(manifest, CONTEXT)
    assert need > 2 * weight_bytes(manifest) + PROCESS_BYTES - 1
    check_cpu_room(manifest, CONTEXT, need)
    check_cpu_room(manifest, CONTEXT, None)  # a kernel that does not say is not refused
    with pytest.raises(GlanceError) as err:
        check_cpu_room(manifest, CONTEXT, need - (256 << 20))
    message = str(err.value)
    assert "\n" not in message
    assert "0.2 GiB short" in message or "0.3 GiB short" in message
    assert "fp16 weights as fp32 copies" in message and "--quantize int4" in message


def test_the_context_is_part_of_the_estimate(wide_fp16):
    """The tree mask alone is max_context squared bytes: a 32k context asks a gigabyte more than 256."""
    manifest = read_manifest(wide_fp16)
    assert cpu_load_bytes(manifest, 32768) - cpu_load_bytes(manifest, CONTEXT) > (1 << 30)
