"""Time and peak memory of `glance-export onnx` and `glance-export build` on random snapshots of real
Qwen-VL models (benchmarks/real_configs.py), per (model, text depth, dtype), with ONNX Runtime GenAI's
model builder on the same snapshot and precision where it is installed.

    python benchmarks/export_scale.py OUT [--models qwen3-vl-2b,qwen2.5-vl-3b] [--depths 4,8,full]
        [--dtypes fp16] [--vision-depth N] [--no-build] [--genai-path DIR] [--keep]

Every stage runs in its own child process and its peak RSS is the largest of that process tree's
(`os.wait4`, what `/usr/bin/time -v` reports): the export, the ONNX checker over every graph, a short
ONNX Runtime decode of one receipt prompt (8 tokens, AR and GLANCE, which must be identical), the
build (its parent and one worker per graph), and GenAI's builder
(`python -m onnxruntime_genai.models.builder -i SNAPSHOT -o OUT -p fp16 -e cpu`). GenAI's builder writes
the text decoder only for Qwen2.5-VL and Qwen3-VL and does not take Qwen2-VL, so its column is a
text-only comparison. Results accumulate in OUT/export_scale.json and OUT/export_scale.md; snapshots
are kept per (model, depth) under OUT/snapshots, exports and engines are deleted after each row unless
--keep. Full-depth 7B/8B rows need a streaming export; run them where memory allows.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

from glance_export.build.targets import load_profile  # noqa: E402
from glance_export.build.engine_parts import cut_budget  # noqa: E402
from glance_export.build.memory_plan import (CONTEXT_STEP, Budget, BuildPeak, graph_bytes, maps_weights,  # noqa: E402
                                             part_budget_gib)
from glance_runtime.formats.artifacts import read as load_manifest  # noqa: E402
from glance_export.onnx.export import EXTERNAL_DATA_BYTES  # noqa: E402
from real_configs import PUBLISHED, checkpoint_tensors, skeleton, write_snapshot  # noqa: E402

GIB = float(1 << 30)
MAX_CONTEXT, MAX_TREE = 1024, 64


def run(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> dict:
    """Run `cmd` in a child process: exit code, wall time and the process tree's peak RSS in GiB."""
    t0 = time.perf_counter()
    with open(log or os.devnull, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(child.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_gib": round(usage.ru_maxrss / 2 ** 20, 2)}


def _bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def snapshot(out: Path, model: str, depth: int | None, vision_depth: int | None) -> Path:
    name = f"{model}-d{depth or 'full'}" + (f"-v{vision_depth}" if vision_depth else "")
    snap = out / "snapshots" / name
    if not (snap / "model.safetensors.index.json").is_file():
        shutil.rmtree(snap, ignore_errors=True)
        write_snapshot(snap, model, depth, vision_depth, progress=lambda line: print(line, flush=True))
    head = snap.with_name(name + "-head")
    if not (head / "model.safetensors").is_file():
        code = ("import sys; from glance_export.model.adapters import Snapshot; "
                "from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head; "
                "s = Snapshot(sys.argv[1]); "
                "save_head(init_head(head_config_for(s, 1, 16, pick_mask_token(s)), seed=0), sys.argv[2])")
        assert run([sys.executable, "-c", code, str(snap), str(head)], env=_env())["rc"] == 0, "head"
    return snap


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "runtime")])}


DECODE = """import json, sys, time
from pathlib import Path
from glance_runtime.backends.host_room import cpu_load_bytes
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.bench.task_prompts import read_bench_tasks
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.codec import exported_codec

backend = OrtBackend(sys.argv[1], threads=2)
runs = {"estimate_gib": round(cpu_load_bytes(backend.manifest, backend.max_context) / 2 ** 30, 2)}
task = read_bench_tasks([Path(sys.argv[2])], 1)[0]
prompt = exported_codec(backend.manifest).turn(task.prompt, task.image)
for mode, speculative in (("ar", False), ("glance", True)):
    t0 = time.perf_counter()
    runs[mode] = decode(backend, prompt, DecodeConfig(max_new_tokens=8, budget=15, speculative=speculative)).tokens
    runs[mode + "_s"] = round(time.perf_counter() - t0, 1)
runs["identical"] = runs["ar"] == runs["glance"]
print(json.dumps(runs))
"""
TASKS = ROOT / "examples" / "receipt" / "tasks.jsonl"
CHECK = """import sys, json, onnx
from pathlib import Path
art = Path(sys.argv[1])
for entry in json.loads((art / "manifest.json").read_text())["graphs"].values():
    onnx.checker.check_model(str(art / entry["file"]))
"""


def one_row(args, model: str, depth: int | None, dtype: str) -> dict:
    snap = snapshot(args.out, model, depth, args.vision_depth)
    head = snap.with_name(snap.name + "-head")
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    work = args.out / "work" / f"{snap.name}-{dtype}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    text = PUBLISHED[model]["text"]
    row = {"model": model, "depth": depth or text["num_hidden_layers"], "full_depth": depth is None,
           "dtype": dtype, "snapshot_gib": round(index["metadata"]["total_size"] / GIB, 3),
           "shards": len(set(index["weight_map"].values()))}
    cli = [sys.executable, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"]
    print(f"[{snap.name} {dtype}] export ...", flush=True)
    row["export"] = run([*cli, "onnx", "--model", str(snap), "--head", str(head), "--out", str(work / "art"),
                         "--dtype", dtype, "--max-context", str(MAX_CONTEXT), "--max-tree", str(MAX_TREE)],
                        env=_env(), log=work / "export.log")
    if row["export"]["rc"] == 0 and (work / "art" / "manifest.json").is_file():
        graphs = graph_bytes(work / "art", load_manifest(work / "art").graphs)
        row["graphs_gib"] = {g: round(b / GIB, 3) for g, b in graphs.items()}
        row["export"]["bound_gib"] = round(0.5 * sum(graphs.values()) / GIB + 3, 2)
        print(f"[{snap.name} {dtype}] onnx checker ...", flush=True)
        row["checker"] = run([sys.executable, "-c", CHECK, str(work / "art")], log=work / "check.log")
        print(f"[{snap.name} {dtype}] ONNX Runtime decode, AR and GLANCE ...", flush=True)
        row["decode"] = run([sys.executable, "-c", DECODE, str(work / "art"), str(TASKS)], env=_env(),
                            log=work / "decode.log")
        if row["decode"]["rc"] == 0:
            row["decode"].update(json.loads((work / "decode.log").read_text().strip().splitlines()[-1]))
        if args.build:
            print(f"[{snap.name} {dtype}] build --target rtx ...", flush=True)
            row["build"] = run([*cli, "build", "--artifacts", str(work / "art"), "--target", "rtx", "--out",
                                str(work / "engines")], env=_env(), log=work / "build.log")
            if row["build"]["rc"] == 0:
                record = json.loads((work / "engines" / "engines.json").read_text())
                ws = record["memory_plan"]["workspace_gib"]
                row["build"]["bound_gib"] = round(1.5 * max(graphs.values()) / GIB + ws + 1, 2)
                row["build"]["estimate_gib"] = round(record["memory_plan"]["build_peak_gib"], 2)
                row["build"]["workers_peak_gib"] = {g: e.get("peak_rss_gib") for g, e in record["engines"].items()}
                row["build"]["workers_s"] = {g: e.get("build_s") for g, e in record["engines"].items()}
                files = [f for e in record["engines"].values() for f in (e.get("parts") or [e])]
                row["build"]["engines_gib"] = round(sum(f["bytes"] for f in files) / GIB, 3)
                row["build"]["parts"] = {g: len(e["parts"]) for g, e in record["engines"].items() if "parts" in e}
    if args.genai_path is not None and PUBLISHED[model]["family"] != "qwen2_vl":
        print(f"[{snap.name} {dtype}] onnxruntime-genai builder ...", flush=True)
        genai = {"PYTHONPATH": os.pathsep.join(filter(None, [args.genai_path, os.environ.get("PYTHONPATH")]))}
        row["genai"] = run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(snap), "-o",
                            str(work / "genai"), "-p", dtype, "-e", "cpu", "-c", str(work / "genai-cache")],
                           env=genai, log=work / "genai.log")
        if row["genai"]["rc"] == 0:
            row["genai"]["model_gib"] = round(_bytes(p for p in (work / "genai").iterdir() if p.is_file()) / GIB, 3)
    for stage in ("export", "checker", "decode", "build", "genai"):
        if row.get(stage, {}).get("rc"):
            log = work / f"{'check' if stage == 'checker' else stage}.log"
            row[stage]["error"] = log.read_text().strip().splitlines()[-1][-300:] if log.is_file() else ""
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return row


def _cell(stage: dict | None, key: str = "peak_rss_gib") -> str:
    if not stage:
        return "-"
    if stage.get("rc") and any(word in stage.get("error", "") for word in ("does not fit", "GiB short")):
        return f"refused before work ({stage['error'].split('error: ')[-1][:110]})"
    if stage.get("rc"):
        return f"failed ({stage.get('error', '')[:60]})"
    return f"{stage['wall_s']:.0f} s / {stage[key]:.2f} GiB"


def _passed(stage: dict | None) -> str:
    return "-" if not stage else "passed" if stage["rc"] == 0 else f"failed ({stage.get('error', '')[:60]})"


def _decoded(stage: dict | None) -> str:
    if stage and stage["rc"] and "GiB short" in stage.get("error", ""):
        return "refused before loading: " + stage["error"].split(" needs ", 1)[-1].split(";")[0]
    if not stage or stage["rc"]:
        return _passed(stage)
    estimate = f", estimate {stage['estimate_gib']:.1f}" if "estimate_gib" in stage else ""
    return (f"{'yes' if stage['identical'] else 'NO'} ({stage['ar_s']:.0f} s / {stage['glance_s']:.0f} s; "
            f"{stage['peak_rss_gib']:.1f} GiB{estimate})")


def render(rows: list[dict]) -> str:
    lines = ["# Export and build at real size (random weights, published configs)", "",
             f"`glance-export onnx --dtype D --max-context {MAX_CONTEXT} --max-tree {MAX_TREE}`, `glance-export build "
             "--target rtx` (TensorRT-RTX, no GPU), ONNX Runtime GenAI's builder (`-p D -e cpu`, text decoder only) "
             f"on the same bf16 sharded snapshot; time / peak RSS of each process tree, {os.cpu_count()} CPUs.", "",
             "| model | text layers | dtype | snapshot | graphs (largest) | export | export bound | checker | "
             "ORT decode (AR = GLANCE) | build | build estimate | build bound | largest graph's worker | "
             "GenAI builder |", "|" + "---|" * 14]
    for r in rows:
        graphs = r.get("graphs_gib") or {}
        size = f"{sum(graphs.values()):.2f} GiB ({max(graphs.values()):.2f})" if graphs else "-"
        export_bound = f"{r['export'].get('bound_gib', 0):.2f} GiB" if "bound_gib" in r["export"] else "-"
        build = r.get("build", {})
        build_bound = f"{build['bound_gib']:.2f} GiB" if "bound_gib" in build else "-"
        estimate = f"{build['estimate_gib']:.2f} GiB" if "estimate_gib" in build else "-"
        worker = "-"
        if graphs and build.get("workers_peak_gib"):
            largest = max(graphs, key=graphs.__getitem__)
            seconds = build.get("workers_s", {}).get(largest)
            parts = build.get("parts", {}).get(largest)
            worker = (f"{largest}{f' ({parts} parts)' if parts else ''}: {f'{seconds:.0f} s / ' if seconds else ''}"
                      f"{build['workers_peak_gib'][largest]:.2f} GiB "
                      f"({build['workers_peak_gib'][largest] / graphs[largest]:.2f}x the graph)")
        depth = f"{r['depth']}{' (full)' if r['full_depth'] else ''}"
        lines.append(f"| {r['model']} | {depth} | {r['dtype']} | {r['snapshot_gib']:.2f} GiB, {r['shards']} shards | "
                     f"{size} | {_cell(r['export'])} | {export_bound} | {_passed(r.get('checker'))} | "
                     f"{_decoded(r.get('decode'))} | {_cell(r.get('build'))} | {estimate} | {build_bound} | "
                     f"{worker} | {_cell(r.get('genai'))} |")
    return "\n".join(lines) + "\n"


JETSONS = (("Orin Nano 8 GB", "jetson-orin", 8), ("Orin NX 16 GB", "jetson-orin", 16),
           ("AGX Orin 32 GB", "jetson-orin", 32), ("AGX Orin 64 GB", "jetson-orin", 64),
           ("Thor T4000 64 GB", "jetson-thor", 64), ("AGX Thor T5000 128 GB", "jetson-thor", 128))


def fp16_graphs(name: str, scratch: Path) -> tuple[dict[str, float], int]:
    """GiB per graph of a full-depth fp16 export, from the model's checkpoint tensors (the draft head is one
    text layer), and the KV cache bytes per context row (target layers and the head's layer)."""
    tensors = checkpoint_tensors(skeleton(scratch / name, name))
    text = PUBLISHED[name]["text"]
    sizes = {"target": 0, "vocab": 0, "vision": 0}
    for key, shape in tensors.items():
        graph = ("vision" if "visual" in key else "vocab" if ("embed_tokens" in key or "lm_head" in key)
                 else "target")
        sizes[graph] += 2 * math.prod(shape)
    sizes["draft"] = sizes["target"] // text["num_hidden_layers"]
    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    kv_row = 2 * (text["num_hidden_layers"] + 1) * text["num_key_value_heads"] * head_dim * 2
    return {g: b / GIB for g, b in sizes.items()}, kv_row


def _context(rows: int) -> str:
    return ">= 32768" if rows >= 32768 else str(rows)


def jetson_table(scratch: Path) -> str:
    """Which Jetson can build and run which full-depth fp16 model, by the memory plan's own rules: a graph over
    the module's part budget (`memory_plan.part_budget_gib`) is built in even parts, so the builder's peak is
    the costliest part's or whole graph's worker (the peak column: at the default 2 GiB parts; an 8 GB Orin
    Nano lowers its budget so a part fits it)."""
    header = "| model (fp16) | weights | largest graph | builder peak (Orin / Thor) | " + " | ".join(
        j[0] for j in JETSONS) + " |"
    lines = [header, "|" + "---|" * (4 + len(JETSONS))]
    for name in PUBLISHED:
        graphs, kv_row = fp16_graphs(name, scratch)
        largest = max(graphs, key=graphs.__getitem__)
        weights = sum(graphs.values())
        cells, peaks = [], {}
        for _, target, memory in JETSONS:
            profile = load_profile(target)
            mapped = maps_weights(profile, None)  # the oldest TensorRT the target accepts
            usable = memory - profile.reserve_gib
            budget = Budget(memory, "", profile.reserve_gib, profile.workspace_gib, weights, kv_row)
            part_bytes = int(part_budget_gib(profile, budget, mapped, None) * GIB)
            peak = max(BuildPeak(g, (cut_budget(int(size * GIB), part_bytes) or size * GIB) / GIB,
                                 profile.workspace_gib, mapped and size * GIB >= EXTERNAL_DATA_BYTES).gib
                       for g, size in graphs.items())
            peaks.setdefault(target, []).append(peak)
            rows = int((usable - weights - profile.workspace_gib) * GIB // kv_row) // CONTEXT_STEP * CONTEXT_STEP
            runs = rows >= CONTEXT_STEP
            if runs and peak <= usable:
                cells.append(f"builds, runs (context {_context(rows)})")
            elif runs:
                cells.append(f"runs (context {_context(rows)}); cannot build ({peak - usable:.1f} GiB short)")
            else:
                cells.append("does not fit")
        lines.append(f"| {name} | {weights:.1f} GiB | {largest} {graphs[largest]:.1f} GiB | "
                     f"{max(peaks['jetson-orin']):.1f} / {max(peaks['jetson-thor']):.1f} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default="qwen3-vl-2b,qwen2.5-vl-3b")
    parser.add_argument("--depths", default="4,8,full",
                        help="text layers per row (Qwen3-VL needs at least its 3 deepstack taps); 'full' is the published depth")
    parser.add_argument("--dtypes", default="fp16")
    parser.add_argument("--vision-depth", type=int, help="vision blocks (default: the published depth)")
    parser.add_argument("--no-build", dest="build", action="store_false")
    parser.add_argument("--genai-path", help="a folder holding onnxruntime_genai (e.g. pip install --target DIR)")
    parser.add_argument("--keep", action="store_true", help="keep the exports and engines under OUT/work")
    parser.add_argument("--jetson-table", action="store_true",
                        help="only write OUT/jetson_plan.md: which Jetson builds and runs which full-depth model")
    args = parser.parse_args()
    if args.jetson_table:
        table = jetson_table(args.out / "skeletons")
        (args.out / "jetson_plan.md").write_text(table)
        print(table)
        return
    if args.genai_path is None and importlib.util.find_spec("onnxruntime_genai") is not None:
        args.genai_path = ""
    results = args.out / "export_scale.json"
    for model in args.models.split(","):
        for depth in args.depths.split(","):
            for dtype in args.dtypes.split(","):
                row = one_row(args, model, None if depth == "full" else int(depth), dtype)
                key = (row["model"], row["depth"], row["dtype"])
                rows = json.loads(results.read_text()) if results.is_file() else []  # rows other runs added meanwhile
                rows = [r for r in rows if (r["model"], r["depth"], r["dtype"]) != key] + [row]
                rows.sort(key=lambda r: (r["model"], r["depth"], r["dtype"]))
                results.write_text(json.dumps(rows, indent=2) + "\n")
                (args.out / "export_scale.md").write_text(render(rows))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
