"""Every command and subcommand answers --version with the toolkit's one version, and exits 0."""
from __future__ import annotations

import pytest

import glance_runtime
from glance_export import cli as export_cli
from glance_runtime.cli import bench, run, serve

pytestmark = pytest.mark.edge


@pytest.mark.parametrize("main, argv, prog", [
    (run.main, [], "glance-run"), (serve.main, [], "glance-serve"), (bench.main, [], "glance-bench"),
    (bench.main, ["law"], "glance-bench law"), (export_cli.main, [], "glance-export"),
    (export_cli.main, ["triton"], "glance-export triton")])
def test_version(main, argv, prog, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"{prog} {glance_runtime.__version__}\n"
