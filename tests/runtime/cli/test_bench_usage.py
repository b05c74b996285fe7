"""glance-bench's usage line and --help name every subcommand its main dispatches, and each answers --help."""
from __future__ import annotations

import pytest

from glance_runtime.cli import bench

pytestmark = pytest.mark.edge


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        bench.main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_usage_and_help_name_every_subcommand(capsys):
    usage = _help([], capsys).split("\n\n")[0]
    epilog = _help([], capsys).split("subcommands:")[-1]
    assert bench.SUBCOMMANDS
    for name in bench.SUBCOMMANDS:
        assert name in usage, f"the usage line does not name {name}"
        described = next(line for line in epilog.splitlines() if line.split()[:1] == [name])
        assert len(described.split()) > 2, f"--help names {name} without saying what it does"


@pytest.mark.parametrize("name", sorted(bench.SUBCOMMANDS))
def test_each_subcommand_answers_help_with_its_own_usage(name, capsys):
    assert _help([name], capsys).startswith(f"usage: glance-bench {name}")
