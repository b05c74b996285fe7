"""GLANCE at real width: random-weight models with the published configurations of Qwen2.5-VL-3B-Instruct
and Qwen3-VL-2B-Instruct, depth cut down, on ONNX Runtime CPU beside transformers `generate`.

The configurations below were typed from the models' published config.json files (no download is
possible here): hidden size, attention and KV heads, head dim, MLP width, vocabulary (151,936), tied
embeddings, RoPE theta and M-RoPE sections, and the vision tower's width, heads, patch and merge sizes.
Cut: text layers (--layers) and vision depth (--vision-depth), with the vision tower's full-attention /
deepstack layer indexes mapped into the cut depth. The tokenizer is the tests' small one, so the
special token ids are its own, not Qwen's. Weights are random (wide normal, so greedy output varies),
the head is random, and drafts are seeded with the target's own greedy continuation (glance-bench
--seed-drafts full): speed at a high tau, not a trained head's acceptance.

    python benchmarks/real_width.py OUT [--models qwen2.5-vl-3b,qwen3-vl-2b] [--layers 4] [--vision-depth 2]
        [--n 2] [--max-new-tokens 16] [--threads 2]

Each stage runs in its own process, so its peak memory (max RSS) is its own: build (random snapshot,
head, ONNX export), generate (transformers greedy `generate`, timed), bench (glance-bench on the
export: AR, trees, chain). OUT/real_width.json and OUT/real_width.md hold the results.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

# From the published config.json of each model (typed, not downloaded).
PUBLISHED = {
    "qwen2.5-vl-3b": {
        "family": "qwen2_5_vl",
        "text": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0}),
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    },
    "qwen3-vl-2b": {
        "family": "qwen3_vl",
        "text": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "mrope_section": [24, 20, 20],
                                      "mrope_interleaved": True, "rope_theta": 5000000.0}),
        "vision": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
    },
}
TASKS = ROOT / "examples" / "receipt" / "tasks.jsonl"


def cut(published: dict, layers: int, vision_depth: int) -> tuple[dict, dict]:
    """The published text and vision configs with depth cut; layer-index lists mapped proportionally."""
    text = {**published["text"], "num_hidden_layers": layers}
    vision = {**published["vision"], "depth": vision_depth}
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if key in vision:
            full = published["vision"]["depth"]
            vision[key] = sorted({min(vision_depth - 1, i * vision_depth // full) for i in vision[key]})
    return text, vision


def stage_build(out: Path, name: str, layers: int, vision_depth: int) -> dict:
    from safetensors import safe_open

    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
    from glance_export.onnx import export_artifacts
    from support import make_wide_snapshot

    published = PUBLISHED[name]
    text, vision = cut(published, layers, vision_depth)
    t0 = time.perf_counter()
    snap = make_wide_snapshot(out / "snapshot", published["family"], text, vision, tied=True)
    snapshot = Snapshot(snap)
    params = 0
    for file in snap.glob("*.safetensors"):
        with safe_open(str(file), "np") as weights:
            params += sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())
    head_dir = save_head(init_head(head_config_for(snapshot, 1, 16, pick_mask_token(snapshot)), seed=0), out / "head")
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    artifacts = export_artifacts(snap, head_dir, out / "artifacts", max_tree=64, max_context=512,
                                 progress=lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True))
    manifest = json.loads((artifacts / "manifest.json").read_text())
    graphs = {}
    for graph, entry in manifest["graphs"].items():
        files = [entry["file"]] + ([entry["data_file"]] if entry.get("data_file") else [])
        graphs[graph] = sum((artifacts / f).stat().st_size for f in files)
    return {"text_config": text, "vision_config": vision, "target_parameters": params,
            "target_safetensors_bytes": sum(p.stat().st_size for p in snap.glob("*.safetensors")),
            "head_safetensors_bytes": (head_dir / "model.safetensors").stat().st_size,
            "graph_bytes": graphs, "export_bytes": sum(graphs.values()),
            "make_s": round(made, 1), "export_s": round(time.perf_counter() - t0, 1)}


def stage_generate(out: Path, n: int, max_new_tokens: int, threads: int) -> dict:
    """transformers greedy `generate` on the same snapshot: prefill (1 new token) and per-token time."""
    import torch
    from transformers import AutoModelForImageTextToText

    from glance_export.model.adapters import Snapshot
    from glance_runtime.bench.task_prompts import read_bench_tasks

    torch.set_num_threads(threads)
    snapshot = Snapshot(out / "snapshot")
    model = AutoModelForImageTextToText.from_pretrained(out / "snapshot", dtype=torch.float32).eval()
    rows = []
    for task in read_bench_tasks([TASKS], n):
        prompt = snapshot.build_prompt(task.prompt, task.image)
        ids = torch.from_numpy(prompt.input_ids)[None]
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                      pixel_values=torch.from_numpy(prompt.pixel_values),
                      image_grid_thw=torch.from_numpy(prompt.image_grid_thw),
                      mm_token_type_ids=(ids == snapshot.image_token_id).int())
        timings = {}
        for new in (1, max_new_tokens, 1, max_new_tokens):  # the first pair is a warm-up
            model.model.rope_deltas = None
            t0 = time.perf_counter()
            with torch.no_grad():
                generated = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            timings[new] = (time.perf_counter() - t0) * 1e3
        tokens = generated[0, ids.shape[1]:].tolist()
        rows.append({"prompt_tokens": int(ids.shape[1]), "prefill_ms": timings[1],
                     "ms_per_token_decode": (timings[max_new_tokens] - timings[1]) / (len(tokens) - 1),
                     "ms_per_token_with_prefill": timings[max_new_tokens] / len(tokens), "tokens": tokens})
    return {"threads": threads, "prompts": rows}


def stage_ort_tokens(out: Path, n: int, max_new_tokens: int, threads: int) -> dict:
    """ONNX Runtime's own AR greedy tokens, to set beside transformers' (parity at real width)."""
    from glance_runtime.backends.ort_backend import OrtBackend
    from glance_runtime.bench.task_prompts import read_bench_tasks
    from glance_runtime.decode.loop import DecodeConfig, decode

    backend = OrtBackend(out / "artifacts", threads=threads)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, speculative=False)
    return {"tokens": [decode(backend, backend.build_prompt(t.prompt, t.image), cfg).tokens
                       for t in read_bench_tasks([TASKS], n)]}


def run_stage(args, name: str, stage: str, extra: list[str]) -> dict:
    """Run one stage in a child process; its JSON result plus the child's peak RSS and wall time."""
    model_out = args.out / name
    result = model_out / f"{stage}.json"
    cmd = [sys.executable, __file__, str(args.out), "--stage", stage, "--models", name, "--layers", str(args.layers),
           "--vision-depth", str(args.vision_depth), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
           "--threads", str(args.threads), *extra]
    print(f"[{name}] {stage} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        return {"failed": f"exit {child.returncode}", "peak_rss_gib": usage.ru_maxrss / 2 ** 20}
    data = json.loads(result.read_text()) if result.is_file() else {}
    return {**data, "peak_rss_gib": round(usage.ru_maxrss / 2 ** 20, 2), "wall_s": round(time.perf_counter() - t0, 1)}


def bench_cmd(args, name: str) -> list[str]:
    art = args.out / name / "artifacts"
    return [str(Path(sys.executable).with_name("glance-bench")), "--artifacts", str(art), "--data", str(TASKS),
            "--n", str(args.n), "--samples", "2", "--budgets", "7,15,31", "--chain", "--seed-drafts", "full",
            "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--bootstrap", "200",
            "--out", str(args.out / name / "bench")]


def run_bench(args, name: str) -> dict:
    print(f"[{name}] glance-bench ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    child = subprocess.Popen(bench_cmd(args, name))
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return {"failed": f"exit {os.waitstatus_to_exitcode(status)}"}
    report = json.loads((args.out / name / "bench" / "report.json").read_text())
    keep = ("tau", "tokens_per_round", "mean_tree_size", "ms_per_token_decode", "ms_per_token_with_prefill",
            "prefill_ms", "speedup_decode", "speedup_with_prefill", "target_graph_ms", "draft_graph_ms",
            "vocab_graph_ms", "outside_ms", "round_ms", "ideal_speedup", "achieved_fraction")
    kind = next(iter(report["kinds"].values()))
    return {"peak_rss_gib": round(usage.ru_maxrss / 2 ** 20, 2), "wall_s": round(time.perf_counter() - t0, 1),
            "modes": {m: {k: e.get(k) for k in keep if k in e} for m, e in kind["modes"].items()},
            "lossless": report["lossless"], "command": report["conditions"]["command"],
            "load_average": [report["conditions"]["load_start"], report["conditions"]["load_end"]]}


def render(results: dict, args) -> str:
    lines = ["# GLANCE at real width (random weights, published configs, depth cut)", "",
             f"Text layers {args.layers}, vision depth {args.vision_depth}; {args.n} receipt prompts, "
             f"{args.max_new_tokens} new tokens, {args.threads} threads, ONNX Runtime CPU and transformers on "
             f"{os.cpu_count()} CPUs. Configurations typed from the published config.json files.", ""]
    for name, r in results.items():
        b, g, bench = r.get("build", {}), r.get("generate", {}), r.get("bench", {})
        lines += [f"## {name}", ""]
        if "failed" in b:
            lines += [f"build failed ({b['failed']})", ""]
            continue
        lines += [f"- target parameters at this depth: {b['target_parameters'] / 1e6:.0f}M; safetensors "
                  f"{b['target_safetensors_bytes'] / 2**30:.2f} GiB + head {b['head_safetensors_bytes'] / 2**30:.2f} GiB; "
                  f"export {b['export_bytes'] / 2**30:.2f} GiB ({', '.join(f'{k} {v / 2**20:.0f} MiB' for k, v in b['graph_bytes'].items())}); "
                  f"export {b['export_s']} s, peak RSS {b['peak_rss_gib']} GiB"]
        if g.get("prompts"):
            gp = g["prompts"]
            lines.append(f"- transformers generate: prefill {sum(p['prefill_ms'] for p in gp) / len(gp):.0f} ms, "
                         f"{sum(p['ms_per_token_decode'] for p in gp) / len(gp):.1f} ms/token excl. prefill; "
                         f"peak RSS {g['peak_rss_gib']} GiB")
        ort = r.get("ort_tokens", {}).get("tokens")
        if ort and g.get("prompts"):
            same = sum(a == p["tokens"][: len(a)] for a, p in zip(ort, g["prompts"]))
            lines.append(f"- ONNX Runtime AR tokens equal to transformers `generate`: {same}/{len(ort)} prompts")
        if bench.get("modes"):
            load = bench.get("load_average", ["?", "?"])
            lines += [f"- glance-bench peak RSS {bench['peak_rss_gib']} GiB; lossless "
                      f"{bench['lossless']['identical']}/{bench['lossless']['runs']} runs; machine load average "
                      f"{load[0]} to {load[1]} during it", "",
                      "| mode | tau | rows | ms/token excl. prefill | prefill ms | speedup excl. / incl. prefill | "
                      "target ms | draft ms | vocab ms | outside ms (per round) | achieved / ideal |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for m, e in bench["modes"].items():
                sp = (f"{e['speedup_decode']:.2f}x / {e['speedup_with_prefill']:.2f}x" if "speedup_decode" in e else "1")
                frac = f"{e['achieved_fraction']:.2f}" if e.get("achieved_fraction") is not None else ""
                lines.append(f"| {m} | {e['tau']:.2f} | {e['mean_tree_size']:.0f} | {e['ms_per_token_decode']:.1f} | "
                             f"{e['prefill_ms']:.0f} | {sp} | {e['target_graph_ms']:.1f} | {e['draft_graph_ms']:.1f} | "
                             f"{e['vocab_graph_ms']:.1f} | {e['outside_ms']:.1f} | {frac} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", default="qwen2.5-vl-3b,qwen3-vl-2b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vision-depth", type=int, default=2)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stage", choices=("build", "generate", "ort_tokens"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.models.split(",")
    if args.stage:
        name = names[0]
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        data = {"build": lambda: stage_build(out, name, args.layers, args.vision_depth),
                "generate": lambda: stage_generate(out, args.n, args.max_new_tokens, args.threads),
                "ort_tokens": lambda: stage_ort_tokens(out, args.n, args.max_new_tokens, args.threads)}[args.stage]()
        (out / f"{args.stage}.json").write_text(json.dumps(data, indent=2))
        return
    previous = args.out / "real_width.json"
    results = {k: v for k, v in (json.loads(previous.read_text()) if previous.is_file() else {}).items()
               if k not in names}  # a later run of some models keeps the others' results
    for name in names:
        r = results[name] = {"build": run_stage(args, name, "build", [])}
        if "failed" not in r["build"]:
            r["generate"] = run_stage(args, name, "generate", [])
            r["ort_tokens"] = run_stage(args, name, "ort_tokens", [])
            r["bench"] = run_bench(args, name)
        (args.out / "real_width.json").write_text(json.dumps(results, indent=2))
        (args.out / "real_width.md").write_text(render(results, args))
    print(render(results, args))


if __name__ == "__main__":
    main()
