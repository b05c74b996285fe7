"""The suite's `--budget auto` tests run beside CPU-burning processes, several times: how often they pass on a busy
machine (they assert tokens, bounds and recovery, never a choice made from a timing taken during the test).

    python benchmarks/busy_auto_tests.py                      # 4 burners, 3 runs of the auto tests
    python benchmarks/busy_auto_tests.py --burners 4 --runs 5 --out benchmarks/results/auto-default-ort-cpu/X

Each run is one pytest process over the auto tests; the burners run for the whole of every run and are killed
however the script ends. Writes busy_tests.json and busy_tests.md under --out (with the load averages seen).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AUTO_TESTS = ["tests/runtime/decode/test_auto_budget.py", "tests/runtime/decode/test_cost_healing.py",
              "tests/runtime/backends/test_ort_backend.py::test_auto_matches_oracle",
              "tests/runtime/cli/test_cli.py::test_run_budget_auto_logs_skipped_drafts_and_becomes_the_default",
              "tests/runtime/cli/test_cli.py::test_onnxruntime_defaults_to_auto_measured_once_beside_the_artifacts",
              "tests/runtime/cli/test_cli.py::test_onnxruntime_audit_with_auto",
              "tests/runtime/bench/test_bench.py", "tests/runtime/decode/test_context_room.py"]


def burners(count: int) -> list[subprocess.Popen]:
    """Processes that each keep a CPU core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def one_run(tests: list[str]) -> dict:
    """One pytest process over `tests`: its exit code, counts line and wall time."""
    start, before = time.perf_counter(), load()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO,
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return {"exit": done.returncode, "summary": lines[-1] if lines else "",
            "seconds": round(time.perf_counter() - start, 1), "load_start": before, "load_end": load(),
            "failures": [line for line in lines if line.startswith("FAILED")]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--burners", type=int, default=4, help="CPU-burning processes beside the tests (default 4)")
    p.add_argument("--runs", type=int, default=3, help="pytest runs of the auto tests (default 3)")
    p.add_argument("--out", type=Path, help="directory for busy_tests.json and busy_tests.md")
    p.add_argument("tests", nargs="*", default=AUTO_TESTS, help="test files or ids (default: the auto tests)")
    args = p.parse_args()
    started = burners(args.burners)
    runs = []
    try:
        for i in range(args.runs):
            runs.append(one_run(args.tests))
            print(f"run {i + 1}: {runs[-1]['summary']} ({runs[-1]['seconds']} s, load {runs[-1]['load_end']})",
                  file=sys.stderr)
    finally:
        for burner in started:
            burner.kill()
        for burner in started:
            burner.wait()
    passed = sum(r["exit"] == 0 for r in runs)
    report = {"burners": args.burners, "cpus": os.cpu_count(), "tests": args.tests, "runs": runs, "passed": passed}
    lines = [f"# Auto tests beside {args.burners} CPU burners ({os.cpu_count()} CPUs)", "",
             f"`python benchmarks/busy_auto_tests.py --burners {args.burners} --runs {args.runs}`: "
             f"{passed} of {len(runs)} runs passed.", "", "| run | result | seconds | load average start / end |",
             "|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['summary']} | {r['seconds']} | {r['load_start']} / {r['load_end']} |"
              for i, r in enumerate(runs)]
    lines += [f"- run {i + 1}: {f}" for i, r in enumerate(runs) for f in r["failures"]]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "busy_tests.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "busy_tests.md").write_text("\n".join(lines) + "\n")
    return 0 if passed == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
