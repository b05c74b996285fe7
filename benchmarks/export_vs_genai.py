"""`glance-export onnx` against ONNX Runtime GenAI's model builder on the same snapshot and precision:
wall time and peak RSS of each, one after the other, with the load average when each started.

    python benchmarks/export_vs_genai.py OUT --snapshot DIR --head DIR [--dtypes fp16,fp32,int4,int8]
        [--genai-path DIR | --genai-python PY]

int4 and int8 are `--quantize` exports (fp32 activations) against the builder's `-p int4` (it has no
int8 precision, so int8 rows have no builder run); their graphs are both forms written (the ONNX Runtime
graphs and the TensorRT ones under `tensorrt/`).

Each run is a child process whose peak is its process tree's largest (`os.wait4`, as `/usr/bin/time`
reports). GenAI's builder (`python -m onnxruntime_genai.models.builder -i SNAPSHOT -o OUT -p DTYPE -e cpu`)
writes the text decoder only; this export writes the target, head, vocabulary and (for a VL snapshot)
vision graphs and validates each, so the comparison favours the builder. Rows accumulate in
OUT/export_vs_genai.json and OUT/export_vs_genai.md; the outputs themselves are deleted after each run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = float(1 << 30)


def run(cmd: list[str], env: dict[str, str], log: Path) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
        _, status, usage = os.wait4(child.pid, 0)
    return {"rc": os.waitstatus_to_exitcode(status), "wall_s": round(time.perf_counter() - t0, 1),
            "peak_rss_gib": round(usage.ru_maxrss / 2 ** 20, 2), "load_avg": round(load, 1)}


QUANTIZED = ("int4", "int8")
GENAI_PRECISIONS = ("fp32", "fp16", "bf16", "int4")


def graphs_gib(artifacts: Path) -> float:
    return round(sum(p.stat().st_size for p in artifacts.rglob("*.onnx*")) / GIB, 2)


def one(args, dtype: str) -> dict:
    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    row = {"snapshot": args.snapshot.name, "dtype": dtype}
    ours = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "runtime")])}
    cli = [sys.executable, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"]
    print(f"[{args.snapshot.name} {dtype}] glance-export onnx ...", flush=True)
    precision = ["--dtype", "fp32", "--quantize", dtype] if dtype in QUANTIZED else ["--dtype", dtype]
    row["export"] = run([*cli, "onnx", "--model", str(args.snapshot), "--head", str(args.head), "--out",
                         str(work / "art"), *precision, "--max-context", "1024", "--max-tree", "64"],
                        ours, args.out / f"{args.snapshot.name}-{dtype}-export.log")
    if row["export"]["rc"] == 0:
        row["export"]["graphs_gib"] = graphs_gib(work / "art")
        row["export"]["bound_gib"] = round(0.5 * row["export"]["graphs_gib"] + 3, 2)
    shutil.rmtree(work / "art", ignore_errors=True)
    if (args.genai_path or args.genai_python) and dtype in GENAI_PRECISIONS:
        print(f"[{args.snapshot.name} {dtype}] onnxruntime-genai builder ...", flush=True)
        row["genai"] = run([args.genai_python or sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                            str(args.snapshot), "-o", str(work / "genai"), "-p", dtype, "-e", "cpu", "-c",
                            str(work / "cache")], {"PYTHONPATH": args.genai_path} if args.genai_path else {},
                           args.out / f"{args.snapshot.name}-{dtype}-genai.log")
        if row["export"]["rc"] == 0 and row["genai"]["rc"] == 0:
            row["time_ratio"] = round(row["export"]["wall_s"] / row["genai"]["wall_s"], 2)
    shutil.rmtree(work, ignore_errors=True)
    return row


def _ratio(row: dict) -> str:
    return f"{row['time_ratio']}x" if "time_ratio" in row else "-"


def render(rows: list[dict]) -> str:
    lines = ["| snapshot | dtype | graphs | export: time / peak (bound) | GenAI builder: time / peak | time ratio | "
             "load avg |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        e, g = r["export"], r.get("genai", {})
        ours = f"{e['wall_s']:.0f} s / {e['peak_rss_gib']:.2f} GiB ({e.get('bound_gib', '-')} GiB)" if not e["rc"] \
            else f"failed ({e['rc']})"
        theirs = f"{g['wall_s']:.0f} s / {g['peak_rss_gib']:.2f} GiB" if g and not g["rc"] else "-"
        lines.append(f"| {r['snapshot']} | {r['dtype']} | {e.get('graphs_gib', '-')} GiB | {ours} | {theirs} | "
                     f"{_ratio(r)} | {e['load_avg']} / {g.get('load_avg', '-')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--head", type=Path, required=True)
    parser.add_argument("--dtypes", default="fp16,fp32")
    parser.add_argument("--genai-path", help="a folder holding onnxruntime_genai (e.g. pip install --target DIR)")
    parser.add_argument("--genai-python", help="the Python of an environment with onnxruntime-genai installed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / "export_vs_genai.json"
    rows = json.loads(record.read_text()) if record.is_file() else []
    for dtype in args.dtypes.split(","):
        row = one(args, dtype)
        rows = [r for r in rows if (r["snapshot"], r["dtype"]) != (row["snapshot"], dtype)] + [row]
        record.write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "export_vs_genai.md").write_text(render(rows))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
