"""glance-run's count of an answer's tokens: the prefill's token is no round's, tau is tokens per round, and
the stats line, --json and the round log agree on it whatever the tree budget (a round that accepts a drafted
stop token counts no bonus after it)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from glance_runtime.cli.run import main as run_main

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo"
SCENE = ["--image", str(DEMO / "scene.png"), "--prompt", "Which shape is at the top left?"]
LINE = re.compile(r"tau (\d+\.\d\d) \| (\d+) (tokens?) \(1 from the prefill, (\d+) in (\d+) (rounds?)\)")

pytestmark = pytest.mark.edge


def _run(args: list[str], capsys) -> tuple[re.Match, dict]:
    assert run_main(args) == 0
    line = LINE.search(capsys.readouterr().err)
    assert run_main(args + ["--json"]) == 0
    return line, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("budget", ["31", "auto"])
def test_tokens_are_the_prefills_one_plus_tau_per_round(budget, capsys):
    """Budget 31 drafts this answer's stop token (the walk accepts it, and the target's next token after it
    is no token of the answer); auto's smaller tree gets the stop as the bonus. Both count the same tokens."""
    line, out = _run(SCENE + ["--budget", budget], capsys)
    assert line is not None and out["finish"] == "eos"
    tau, tokens, in_rounds, rounds = float(line[1]), int(line[2]), int(line[4]), int(line[5])
    assert in_rounds == tokens - 1 and tau == pytest.approx(in_rounds / rounds, abs=0.005)
    assert out["tokens"] == len(out["token_ids"]) == tokens and out["rounds"] == len(out["round_log"])
    assert sum(r["accepted"] for r in out["round_log"]) == tokens - 1
    assert out["tau"] == pytest.approx((tokens - 1) / out["rounds"], abs=1e-4)
    if budget != "auto":  # auto's trees follow the round costs it times, so two runs may round differently
        assert rounds == out["rounds"] and tau == pytest.approx(out["tau"], abs=0.005)


def test_one_round_and_one_token_are_singular(capsys):
    one_round, _ = _run(SCENE + ["--budget", "31", "--max-new-tokens", "3"], capsys)
    assert (one_round[3], one_round[4], one_round[5], one_round[6]) == ("tokens", "2", "1", "round")
    prefill_only, out = _run(SCENE + ["--max-new-tokens", "1"], capsys)
    assert (prefill_only[3], prefill_only[5], prefill_only[6]) == ("token", "0", "rounds") and out["tau"] == 0.0
