"""Long runs, short: 30 prompts through one runner per backend keep RSS flat after the first pass and
give exactly a fresh runner's answers (benchmarks/soak.py runs the same for 1,000)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # 30 prompts per backend, each against a fresh runner

SOAK = Path(__file__).resolve().parents[3] / "benchmarks" / "soak.py"
GROWTH_MB = 10.0  # after the first pass; measured +0.3 (onnxruntime) and +0.6 MB (torch) over 1,000 prompts


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.soak


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_thirty_prompts_through_one_runner(soak, backend):
    report = soak(backend, prompts=30, distinct=10, max_new_tokens=16, threads=1)
    assert report["identical_to_fresh"] == 30, report
    assert report["growth_after_first_pass_mb"] < GROWTH_MB, report
