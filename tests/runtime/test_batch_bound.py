"""A batch larger than the export's batched graphs and KV pool allow is refused by that bound, in one line naming
it and the fix, before anything is sized against memory: through the API and through glance-serve."""
from __future__ import annotations

import json

import pytest

import glance_runtime as gr
from glance_runtime.cli.serve import main as serve_main
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError
from glance_runtime.formats.common import MAX_BATCH

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

EXPORTED = json.loads((DEFAULT_ARTIFACTS / "manifest.json").read_text())["limits"]["max_batch"]


def _names_the_bound(message: str, asked: int) -> None:
    assert "\n" not in message and "GiB" not in message, message
    assert f"--max-batch {asked} is above the {EXPORTED} these artifacts were exported for" in message, message
    assert f"lower it to {EXPORTED} or less" in message, message


@pytest.mark.parametrize("asked", [EXPORTED + 1, 10_000])
def test_load_refuses_a_batch_above_the_exports_bound_by_that_bound(asked):
    with pytest.raises(GlanceError) as caught:
        gr.load(threads=1, max_batch=asked)
    _names_the_bound(str(caught.value), asked)
    if asked > MAX_BATCH:  # no export could batch that many: re-exporting is no fix
        assert "re-export" not in str(caught.value) and str(MAX_BATCH) in str(caught.value)
    else:
        assert f"glance-export onnx --max-batch {asked}" in str(caught.value)


def test_serve_refuses_a_batch_above_the_exports_bound_in_one_line(capsys):
    assert serve_main(["--port", "0", "--threads", "1", "--max-batch", "10000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glance-serve: error: ") and err.count("\n") == 1 and "Traceback" not in err
    _names_the_bound(err.strip(), 10_000)
