"""int4 decoding on the CPU: this toolkit's graphs against ONNX Runtime GenAI on the same random snapshot.

A random Qwen2 text model at Qwen2.5-3B width (hidden 2048, MLP 11008, 16 heads, 2 KV heads, vocabulary
151,936, tied embeddings; depth cut to --layers), random heads (block 8) drafting over the whole vocabulary
and over a reduced draft vocabulary (--draft-vocabs: the 32,768 tokens the target answers four prompts with
most often, then the lowest unused ids), `glance-export onnx --quantize int4` at its defaults (group 128, int8
activations; with --group-sizes and --accuracies, other groups and MatMulNBits compute modes), and
GenAI's int4 CPU build of the same snapshot (`python -m onnxruntime_genai.models.builder -p int4 -e cpu`).
Both decode the same prompt ids greedily in ONE process, same intra-op threads, interleaved repeat by repeat:

- our AR (plain greedy steps on our graphs), GenAI AR;
- GLANCE with drafts seeded from the greedy continuation at depth 3 (tau 4: three drafts accepted a
  round, the bench's confident seeding with `partial` on a block-8 head) at budgets 3 and 7, and at depth
  7 (tau 8, `full`) at budget 7. Seeding isolates the loop's cost from a head's quality. With int8 activations a tree pass can
  choose otherwise than a one-row pass where logits are near-flat (random weights), so the seeded
  continuation is what the seeded decode itself commits (iterated to a fixed point), and the table says how
  many of its tokens equal the graphs' own AR.

ms/token exclude the prefill and the token it produced, as glance-bench reports them; GLANCE's speedups are
over GenAI's AR. Greedy tokens of our AR and GenAI's are compared (agreement counted), and GLANCE's against
our AR (on int8 activations a tree pass may round a near tie differently). Memory: each form's peak resident
set while it decodes (AR, then GLANCE) in a fresh process, against its graphs' bytes on disk.

    python benchmarks/int4_vs_genai.py OUT [--layers 8,12] [--threads 2] [--new-tokens 24] [--repeats 3]
        [--accuracies int8] [--group-sizes 128] [--draft-vocabs 0,32768] [--stage build|time|memory|render]
        [--genai-python PY] [--llama-python PY --llama-source LLAMA_CPP_TREE]

`--accuracies fp32` (alone, or beside int8) adds our unquantized export (`glance-export onnx` at its defaults)
held against GenAI's fp32 CPU build of the same snapshot (`-p fp32`): the same modes, each form against the
GenAI build of its precision.

GenAI is an optional peer (`pip install onnxruntime-genai`); `--genai-python PY` runs its side in that
interpreter instead (a separate environment). llama.cpp is a second plain peer (`llamacpp_peer.py`): the same
snapshot converted by llama.cpp's own converter (`--llama-source`: a llama.cpp tree) and quantized by its own
quantizer to Q4_0 (its default mix) and pure Q4_0, decoded greedily in a child running `--llama-python PY`
(an environment with llama-cpp-python and gguf), interleaved with the other forms. A peer whose interpreter
cannot import it is skipped with one line. Every plain peer's greedy tokens are compared with ours: where they
first differ, and the rank of its token in our top-k there (random weights make near ties). Speedups are
given against GenAI and against the fastest plain peer. Builds record wall time and the builder's peak
resident set. Each depth's build runs in its own process (torch) and its timing in another (no torch).
OUT/int4_vs_genai.json and .md accumulate one row per depth.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

from glance_export.audit.greedy_audit import first_divergence  # noqa: E402  (torch-free)
from glance_export.onnx.quant_scheme import GROUP_SIZE  # noqa: E402  (torch-free)
import llamacpp_peer  # noqa: E402  (beside this file; stdlib only until its sides run)

WIDTH = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
             vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
             rms_norm_eps=1e-6)
PROMPT = "Describe the picture in detail, then list every object you can see and its colour."
PROMPTS = (PROMPT, "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List ten fruits and their colours.")
DRAFT_VOCAB = 32768  # EAGLE-3's reduced draft vocabulary size
FP32 = "fp32"  # as an accuracy: the export without --quantize, held against GenAI's fp32 build
MODES = (("ar", None, 0), ("glance-tau4-b3", "partial", 3), ("glance-tau4-b7", "partial", 7),
         ("glance-tau8-b7", "full", 7))
MAX_CONTEXT = 512  # our export's --max-context, and llama.cpp's context
TOP_K = 5  # a peer's token within our top 5 where the two first differ: equal up to a near tie


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "runtime"), str(ROOT / "tests")])}


AUTO_VOCAB = -1  # --draft-vocabs auto: the export's own choice for a head without one (merge order)


def forms_of(accuracies: str, group_sizes: str, draft_vocabs: str) -> list[tuple[str, int, int]]:
    """(MatMulNBits accuracy, group size, draft vocabulary size, 0 for the whole vocabulary or AUTO_VOCAB for the
    export's default) of each of our exports."""
    return [(a, int(g), AUTO_VOCAB if v == "auto" else int(v)) for a in accuracies.split(",")
            for g in group_sizes.split(",") for v in draft_vocabs.split(",")]


def form_name(accuracy: str, group_size: int, draft_vocab: int) -> str:
    """The export's accuracy, then what differs from its defaults: `int8`, `int8-g32`, `int8-dv32768`; `fp32`,
    `fp32-dv32768` for the unquantized export."""
    group = f"-g{group_size}" if group_size != GROUP_SIZE and accuracy != FP32 else ""
    if draft_vocab == AUTO_VOCAB:
        return f"{accuracy}{group}-dvauto"
    return f"{accuracy}{group}-dv{draft_vocab}" if draft_vocab else f"{accuracy}{group}"


def precision(name: str) -> str:
    """What a form is compared with: GenAI's build of the same precision (`int4` or `fp32`)."""
    return FP32 if name.split("-")[0] == FP32 else "int4"


def art_dir(work: Path, name: str) -> Path:
    return work / (f"ours-{name}" if precision(name) == FP32 else f"ours-int4-{name}")


def genai_key(name: str) -> str:
    """The samples' key of the GenAI decode a form is held against (`genai-ar` for int4, as stored before)."""
    return "genai-ar" if precision(name) == "int4" else f"genai-{FP32}-ar"


def peer_python(python: str, module: str, peer: str, flag: str) -> str:
    """`python` where it imports `module`, else '' (the peer is skipped) after one line saying so."""
    if not python:
        return ""
    try:
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    except OSError:
        found = False
    if not found:
        print(f"{peer}: skipped ({module} does not import in {python}; {flag} PY names an interpreter that has it)",
              flush=True)
    return python if found else ""


def peer_label(key: str) -> str:
    """A plain peer's samples key as the tables name it."""
    if key.startswith("llama-"):
        return llamacpp_peer.LABELS[key.removeprefix("llama-")]
    return "GenAI fp32" if FP32 in key else "GenAI"


def peer_precision(key: str) -> str:
    """int4 for llama.cpp's Q4_0 and GenAI's int4 build, fp32 for GenAI's fp32 build."""
    return FP32 if FP32 in key else "int4"


MEASURE_SIDE = r"""
import json, os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as out:
    json.dump({"code": os.waitstatus_to_exitcode(status), "peak_rss": usage.ru_maxrss * 1024}, out)
"""


def measured(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run a builder to its end, its output into `log`: wall seconds and its peak resident bytes. A small
    interpreter starts it and reads its peak from wait4: Linux counts the resident set a process had before
    exec as the exec'd program's, so a builder started from this process (the snapshot in its memory) would
    report this process's peak."""
    t0 = time.perf_counter()
    report = log.with_suffix(".rusage.json")
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-c", MEASURE_SIDE, str(report), *cmd], stdout=out, stderr=subprocess.STDOUT,
                       env=env)
    seconds, result = round(time.perf_counter() - t0, 1), json.loads(report.read_text())
    report.unlink()
    if result["code"]:
        raise SystemExit(f"{' '.join(cmd[:3])} ... exited with {result['code']}: see {log}")
    return seconds, result["peak_rss"]


def build_llama(work: Path, snap: Path, tree: Path | None, python: str, threads: int, layers: int) -> dict:
    """llama.cpp's forms of the snapshot: one f32 GGUF from its converter, then each quantization of it (the
    f32 GGUF is removed once both exist); wall time and peak memory of each step."""
    times: dict = {}
    todo = {f: pure for f, pure in llamacpp_peer.FORMS.items() if not (work / f"llama-{f}.gguf").exists()}
    if not todo:
        return times
    f32 = work / "llama-f32.gguf"
    if not f32.exists():
        part = work / "llama-f32.gguf.part"
        cmd = llamacpp_peer.convert_command(sys.executable, llamacpp_peer.source_tree(tree), snap, part)
        times["llama_convert_s"], times["llama_convert_peak_rss"] = measured(cmd, work / "llama-convert.log", _env())
        part.rename(f32)
        print(f"[{layers} layers] llama.cpp conversion in {times['llama_convert_s']} s", flush=True)
    for form, pure in todo.items():
        out, part = work / f"llama-{form}.gguf", work / f"llama-{form}.gguf.part"
        report = work / f"llama-{form}.json"
        cmd = llamacpp_peer.quantize_command(python, f32, part, pure, threads, report)
        times[f"llama_quantize_{form}_s"], times[f"llama_quantize_{form}_peak_rss"] = measured(
            cmd, work / f"llama-quantize-{form}.log")
        part.rename(out)
        times[f"llama_{form}"] = json.loads(report.read_text())
        print(f"[{layers} layers] llama.cpp {form} in {times[f'llama_quantize_{form}_s']} s: "
              f"{times[f'llama_{form}']['tensor_types']}", flush=True)
    f32.unlink()
    return times


def build(work: Path, layers: int, forms: list[tuple[str, int, int]], genai_python: str, llama_python: str,
          llama_source: Path | None, threads: int) -> dict:
    """Snapshot, heads, our exports and the plain peers' builds for one depth; what exists is kept."""
    from support import make_wide_snapshot

    times = {}
    snap = work / "snapshot"
    if not (snap / "model.safetensors").exists() and not list(snap.glob("model-*.safetensors")):
        t0 = time.perf_counter()
        make_wide_snapshot(snap, "qwen2", {**WIDTH, "num_hidden_layers": layers}, tied=WIDTH["tie_word_embeddings"])
        times["snapshot_s"] = round(time.perf_counter() - t0, 1)
        print(f"[{layers} layers] snapshot in {times['snapshot_s']} s", flush=True)
    cli = [sys.executable, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"]
    for kind in sorted({precision(form_name(*form)) for form in forms}) if genai_python else ():
        genai = work / f"genai-{kind}"
        if (genai / "genai_config.json").exists():
            continue
        times[f"genai_build_{kind}_s"], times[f"genai_build_{kind}_peak_rss"] = measured(
            [genai_python, "-m", "onnxruntime_genai.models.builder", "-i", str(snap), "-o", str(genai), "-p", kind,
             "-e", "cpu", "-c", str(work / "genai-cache")], work / f"genai-build-{kind}.log")
        shutil.rmtree(work / "genai-cache", ignore_errors=True)
        print(f"[{layers} layers] GenAI {kind} build in {times[f'genai_build_{kind}_s']} s", flush=True)
    if llama_python and any(precision(form_name(*form)) == "int4" for form in forms):
        times.update(build_llama(work, snap, llama_source, llama_python, threads, layers))
    for accuracy, group_size, draft_vocab in forms:
        head = work / (f"head-dv{draft_vocab}" if draft_vocab > 0 else "head")
        if not (head / "config.json").exists() and draft_vocab > 0:
            peer = GenAI(work / f"genai-{precision(form_name(accuracy, group_size, draft_vocab))}", 2, genai_python)
            _head_with_draft_vocab(snap, head, draft_vocab, peer, work)
        elif not (head / "config.json").exists():
            subprocess.run([*cli, "init-head", "--model", str(snap), "--out", str(head), "--block-size", "8",
                            "--layers", "1"], check=True, env=_env())
        name = form_name(accuracy, group_size, draft_vocab)
        art = art_dir(work, name)
        if not (art / "manifest.json").exists():
            quantize = [] if accuracy == FP32 else ["--quantize", "int4", "--group-size", str(group_size),
                                                    "--accuracy", accuracy]
            times[f"export_{name}_s"], times[f"export_{name}_peak_rss"] = measured(
                [*cli, "onnx", "--model", str(snap), "--head", str(head), "--out", str(art), *quantize,
                 *(["--draft-vocab", "all"] if draft_vocab == 0 else []),
                 "--max-context", str(MAX_CONTEXT), "--max-tree", "16", "--quiet"], work / f"export-{name}.log", _env())
            print(f"[{layers} layers] our {precision(name)} ({name}) export in {times[f'export_{name}_s']} s", flush=True)
    return times


def _head_with_draft_vocab(snap: Path, out: Path, size: int, genai: "GenAI", work: Path) -> None:
    """A random block-8 head that drafts over `size` tokens: the ones the target answers the bench prompts with
    most often (its greedy answers, from GenAI's build of the same snapshot), then the lowest unused ids, as
    `train-head --draft-vocab` picks them from its answers."""
    from dataclasses import replace

    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
    from glance_export.train.draft_vocab import frequent_tokens
    import torch

    snapshot = Snapshot(snap)
    tokenizer = snapshot.tokenizer
    answers = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        answers.append(torch.tensor(genai.generate([int(t) for t in ids], 64)["tokens"]))
    genai.close()
    cfg = head_config_for(snapshot, 1, 8, pick_mask_token(snapshot))
    head = init_head(replace(cfg, draft_vocab_size=size), seed=0)
    head.draft_vocab_ids.copy_(frequent_tokens(answers, size, cfg.vocab_size))
    save_head(head, out)
    (work / f"{out.name}.answers.json").write_text(json.dumps([a.tolist() for a in answers]))
    print(f"wrote a random head drafting over {size} tokens to {out}", flush=True)


GENAI_SIDE = r'''
import json, sys, time


def generate(og, model, ids, new):
    """GenAI's greedy decode of `new` tokens after `ids`; the first (prefill) step is timed apart."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new, min_length=len(ids) + new)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    gen.generate_next_token()
    tokens, t1 = [int(gen.get_next_tokens()[0])], time.perf_counter()
    while len(tokens) < new:
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    t2 = time.perf_counter()
    return {"tokens": tokens, "prefill_ms": (t1 - t0) * 1e3,
            "ms_per_token_decode": (t2 - t1) * 1e3 / max(len(tokens) - 1, 1)}


if __name__ == "__main__":
    import onnxruntime_genai as og
    model = og.Model(og.Config(sys.argv[1]))
    for line in sys.stdin:
        print(json.dumps(generate(og, model, *json.loads(line))), flush=True)
'''


class GenAI:
    """GenAI's greedy decode with `threads` intra-op threads: in this process where `python` is this one, else
    in a child running `python` (GenAI in its own environment), fed over a pipe."""

    def __init__(self, path: Path, threads: int, python: str):
        raw = json.loads((path / "genai_config.json").read_text())
        options = raw["model"]["decoder"].setdefault("session_options", {})
        options.update(intra_op_num_threads=threads, inter_op_num_threads=1)
        (path / "genai_config.json").write_text(json.dumps(raw, indent=2))
        self.child = None
        if python != sys.executable:
            self.child = subprocess.Popen([python, "-c", GENAI_SIDE, str(path)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
            return
        import onnxruntime_genai as og

        side: dict = {}
        exec(compile(GENAI_SIDE, "genai_side", "exec"), side)
        model, generate = og.Model(og.Config(str(path))), side["generate"]
        self.run = lambda ids, new: generate(og, model, ids, new)

    def generate(self, ids: list[int], new: int) -> dict:
        if self.child is None:
            return self.run(ids, new)
        self.child.stdin.write(json.dumps([ids, new]) + "\n")
        self.child.stdin.flush()
        return json.loads(self.child.stdout.readline())

    def close(self) -> None:
        if self.child is not None:
            self.child.stdin.close()
            self.child.wait()


def seeded_truth(backend, prompt, greedy: list[int], seeding: str, budget: int, new: int) -> list[int]:
    """The continuation to seed so that every round accepts the seeded depth: the graphs' own AR tokens, unless
    a tree pass chooses otherwise than a one-row pass (int8 activations on near-flat random logits), then what
    the seeded decode itself commits, repeated until it commits what it was seeded with."""
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.decode.loop import DecodeConfig, decode

    truth = greedy
    for _ in range(8):
        out = decode(ConfidentSeeds(backend, truth, prompt.length, seeding), prompt,
                     DecodeConfig(max_new_tokens=new, budget=budget, branch_k=8)).tokens
        if out == truth[:len(out)]:
            break
        truth = out
    return truth


def our_top(backend, prompt, tokens: list[int], index: int) -> tuple[list[int], list[float]]:
    """Our graphs' top-k ids and log-probs where their greedy decode chose `tokens[index]`, replayed one row at
    a time as the greedy audit replays a divergence (the vocab graph keeps the manifest's branch_k)."""
    from glance_runtime.decode.tree import Tree, visibility

    backend.prefill(prompt)
    for j in range(1, index + 1):
        if j > 1:
            backend.commit(np.zeros(1, np.int64))
        root = Tree.root(tokens[j - 1])
        backend.verify(root.tokens, root.depths, visibility(root.parents))
    ids = backend.device.download(backend.top_ids.rows(1))[0]
    logp = backend.device.download(backend.top_logp.rows(1))[0]
    return [int(t) for t in ids], [float(x) for x in logp]


def agreement(ours: list[int], theirs: list[int], top=None) -> dict:
    """How far a peer's greedy tokens follow `ours`: positions equal, the first that differs, and (with `top`:
    index -> our top-k there) the rank of the peer's token in our top-k and its log-prob below our choice."""
    first = first_divergence(ours, theirs)
    out: dict = {"equal": sum(x == y for x, y in zip(ours, theirs)), "first_difference": first}
    if first is not None and top is not None:
        ids, logp = top(first)
        rank = ids.index(theirs[first]) if theirs[first] in ids else None
        out.update(ours=ours[first], theirs=theirs[first], top_k=len(ids),
                   rank_in_ours=None if rank is None else rank + 1,
                   logp_below_ours=None if rank is None else round(logp[0] - logp[rank], 4),
                   within_top5=rank is not None and rank < TOP_K)
    return out


def time_depth(work: Path, layers: int, forms: list[tuple[str, int, int]], threads: int, new: int, repeats: int,
               genai_python: str, llama_python: str) -> dict:
    """Every mode of every form and every plain peer, interleaved repeat by repeat, in this process (GenAI in
    it where it imports; llama.cpp always in a child)."""
    from glance_runtime.backends.registry import Source, open_session
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.decode.loop import DecodeConfig, decode

    names = [form_name(*form) for form in forms]
    runners = {a: open_session(Source("onnxruntime", artifacts=art_dir(work, a), threads=threads)) for a in names}
    peers: dict = {genai_key(a): GenAI(work / f"genai-{precision(a)}", threads, genai_python)
                   for a in names} if genai_python else {}
    if llama_python and any(precision(a) == "int4" for a in names):
        peers.update({f"llama-{f}": llamacpp_peer.LlamaCpp(work / f"llama-{f}.gguf", threads, llama_python,
                                                           MAX_CONTEXT, work / f"llama-{f}.serve.log")
                      for f in llamacpp_peer.FORMS})
    prompts = {a: r.prompt(PROMPT) for a, r in runners.items()}
    ids = [int(t) for t in prompts[names[0]].input_ids.reshape(-1)]
    truth = {a: decode(r.backend, prompts[a], DecodeConfig(max_new_tokens=new, speculative=False)).tokens
             for a, r in runners.items()}
    seeds = {(a, mode): seeded_truth(runners[a].backend, prompts[a], truth[a], seeding, budget, new)
             for a in names for mode, seeding, budget in MODES[1:]}
    samples: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}

    def note(name: str, ms: float, toks: list[int]) -> None:
        samples.setdefault(name, []).append(ms)
        tokens[name] = toks

    for rep in range(repeats + 1):  # the first pass warms up and is not kept
        for key, peer in peers.items():
            out = peer.generate(ids, new)
            if rep:
                note(key, out["ms_per_token_decode"], out["tokens"])
                samples.setdefault(f"{key}:prefill", []).append(out["prefill_ms"])
        for a, runner in runners.items():
            backend, prompt = runner.backend, prompts[a]
            for mode, seeding, budget in MODES:
                drafter = ConfidentSeeds(backend, seeds[a, mode], prompt.length, seeding) if seeding else backend
                cfg = DecodeConfig(max_new_tokens=new, budget=budget, branch_k=8, speculative=seeding is not None)
                result = decode(drafter, prompt, cfg)
                if rep:
                    note(f"{a}:{mode}", result.ms_per_token_decode, result.tokens)
                    samples.setdefault(f"{a}:{mode}:tau", []).append(result.tau)
        print(f"[{layers} layers] repeat {rep}/{repeats} done (load {os.getloadavg()[0]:.1f})", flush=True)
    peak = {key: peer.close() for key, peer in peers.items()}
    med = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    row = {"layers": layers, "threads": threads, "new_tokens": new, "repeats": repeats,
           **{f"{key.removesuffix('-ar').replace('-', '_')}_ar_ms": med[key] for key in peers if key in
              ("genai-ar", f"genai-{FP32}-ar")},
           "prompt_tokens": len(ids), "load_avg_end": round(os.getloadavg()[0], 1), "forms": {},
           "peers": {key: {"label": peer_label(key), "ms": med[key], "prefill_ms": med[f"{key}:prefill"],
                           "tokens": tokens[key], **({"peak_rss": peak[key]} if peak[key] else {}),
                           **({"tokens_vs_genai": agreement(tokens["genai-ar"], tokens[key])}
                              if key.startswith("llama-") and "genai-ar" in peers else {})}
                     for key in peers}}
    for a in names:
        ar = tokens[f"{a}:ar"]
        plain = [key for key in peers if peer_precision(key) == precision(a)]
        top: dict = {}  # first-difference index -> our top-k there, shared by peers that part at one token

        def ours_at(index: int, a: str = a, top: dict = top) -> tuple[list[int], list[float]]:
            if index not in top:
                top[index] = our_top(runners[a].backend, prompts[a], tokens[f"{a}:ar"], index)
            return top[index]

        form: dict = {"ar_ms": med[f"{a}:ar"], "peers": {key: agreement(ar, tokens[key], ours_at) for key in plain},
                      "modes": {}}
        fastest = min(plain, key=lambda key: med[key], default=None)
        refs = {}
        if genai_key(a) in peers:
            refs["genai"] = med[genai_key(a)]
            form.update(genai_ar_ms=med[genai_key(a)], ar_vs_genai=round(med[genai_key(a)] / med[f"{a}:ar"], 3),
                        tokens_equal_genai=form["peers"][genai_key(a)]["equal"])
        if fastest:
            refs["fastest_peer"] = med[fastest]
            form.update(fastest_peer=fastest, fastest_peer_ms=med[fastest],
                        ar_vs_fastest_peer=round(med[fastest] / med[f"{a}:ar"], 3))
        for mode, _, _ in MODES[1:]:
            key = f"{a}:{mode}"
            form["modes"][mode] = {"ms": med[key], "tau": med[f"{key}:tau"],
                                   **{f"speedup_vs_{ref}{'_ar' if ref == 'genai' else ''}": round(ms / med[key], 3)
                                      for ref, ms in refs.items()},
                                   "speedup_vs_own_ar": round(med[f"{a}:ar"] / med[key], 3),
                                   "tokens_equal_own_ar": sum(x == y for x, y in zip(tokens[key], ar))}
        tau4 = min(form["modes"]["glance-tau4-b3"]["ms"], form["modes"]["glance-tau4-b7"]["ms"])
        for ref, ms in refs.items():
            suffix = "_ar" if ref == "genai" else ""
            form[f"tau4_best_speedup_vs_{ref}"] = round(ms / tau4, 3)
            form[f"tau8_speedup_vs_{ref}"] = form["modes"]["glance-tau8-b7"][f"speedup_vs_{ref}{suffix}"]
        row["forms"][a] = form
    row["samples"] = samples
    return row


def memory(work: Path, forms: list[tuple[str, int, int]], threads: int, new: int) -> dict:
    """Peak resident memory of decoding (AR, then GLANCE at budget 7) on each form, each in a fresh process,
    against the bytes of the graphs ONNX Runtime loads (the artifacts directory less its TensorRT form)."""
    out = {}
    for form in forms:
        art = art_dir(work, form_name(*form))
        code = MEMORY_SIDE.format(runtime=str(ROOT / "runtime"), art=str(art), threads=threads, new=new)
        peak = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                         env=_env()).stdout.splitlines()[-1])
        graphs = sum(f.stat().st_size for f in art.iterdir() if f.is_file() and f.suffix in (".onnx", ".data"))
        out[form_name(*form)] = {**peak, "graph_bytes": graphs, "peak_over_graphs": round(peak["peak_rss"] / graphs, 3)}
        print(f"[{art.name}] peak RSS {peak['peak_rss'] / 2**30:.2f} GiB for {graphs / 2**30:.2f} GiB of graphs "
              f"({out[form_name(*form)]['peak_over_graphs']}x)", flush=True)
    return out


MEMORY_SIDE = r"""
import json, resource, sys
sys.path.insert(0, {runtime!r})
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.loop import DecodeConfig, decode
session = open_session(Source("onnxruntime", artifacts={art!r}, threads={threads}))
prompt = session.prompt("Describe the picture in detail, then list every object you can see and its colour.")
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
decode(session.backend, prompt, DecodeConfig(max_new_tokens={new}, speculative=False))
decode(session.backend, prompt, DecodeConfig(max_new_tokens={new}, budget=7, branch_k=8))
print(json.dumps({{"loaded_rss": loaded, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def _memory(row: dict, form: str) -> str:
    m = row.get("memory", {}).get(form)
    return f"{m['peak_rss'] / 2**30:.2f} / {m['graph_bytes'] / 2**30:.2f} GiB ({m['peak_over_graphs']}x)" if m else "-"


def _paired(samples: dict[str, list[float]], key: str, peer: str | None) -> float | None:
    """The median over repeats of a plain peer's AR ms over `key`'s in the same repeat: a busy moment slows both
    sides of a pair, so this moves less than a ratio of medians; None without that peer."""
    if peer not in samples:
        return None
    return round(statistics.median(g / m for g, m in zip(samples[peer], samples[key])), 2)


def _ratios(samples: dict[str, list[float]], keys: list[str], peers: tuple[str | None, str | None]) -> str:
    """'x GenAI / x fastest plain peer' of the best of `keys` (paired ratios), '-' for a peer not run."""
    cells = []
    for peer in peers:
        ratios = [x for x in (_paired(samples, key, peer) for key in keys) if x is not None]
        cells.append(f"{max(ratios)}x" if ratios else "-")
    return " / ".join(cells)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _agreement(a: dict, new: int) -> str:
    """A peer's tokens against ours: equal positions, then where they first differ and its token's rank there."""
    text = f"{a['equal']}/{new}"
    if a["first_difference"] is None:
        return text
    text += f", first differs at {a['first_difference']}"
    if "top_k" in a:
        text += (f" (its token our #{a['rank_in_ours']}, {a['logp_below_ours']} below)" if a["rank_in_ours"]
                 else f" (its token not in our top {a['top_k']})")
    return text


def _peer_rows(r: dict) -> list[str]:
    """One line per plain peer of a depth: its step, its tokens against each of our forms and GenAI's, its build."""
    lines, s, b, new = [], r["samples"], r.get("build", {}), r["new_tokens"]
    for key, p in r.get("peers", {}).items():
        ours = "; ".join(f"{a}: {_agreement(f['peers'][key], new)}" for a, f in r["forms"].items()
                         if key in f["peers"])
        genai = _agreement(p["tokens_vs_genai"], new) if "tokens_vs_genai" in p else "-"
        if key.startswith("llama-"):
            form = key.removeprefix("llama-")
            q = b.get(f"llama_{form}")
            made = (f"convert {b['llama_convert_s']} s ({_gib(b['llama_convert_peak_rss'])} GiB) + quantize "
                    f"{b[f'llama_quantize_{form}_s']} s ({_gib(b[f'llama_quantize_{form}_peak_rss'])} GiB)"
                    if f"llama_quantize_{form}_s" in b and "llama_convert_s" in b else "-")
            size = f"{_gib(q['bytes'])} ({q['token_embd']})" if q else "-"
        else:
            kind = peer_precision(key)
            made = (f"{b[f'genai_build_{kind}_s']} s ({_gib(b[f'genai_build_{kind}_peak_rss'])} GiB)"
                    if f"genai_build_{kind}_peak_rss" in b else "-")
            size = "-"
        x = _paired(s, key, "genai-ar" if peer_precision(key) == "int4" else genai_key(FP32))
        lines.append(f"| {r['layers']} | {p['label']} | {p['ms']} | {p['prefill_ms']} | "
                     f"{'-' if x is None else f'{x}x'} | {ours} | {genai} | {made} | {size} | "
                     f"{_gib(p['peak_rss']) + ' GiB' if 'peak_rss' in p else '-'} |")
    return lines


def render(rows: list[dict]) -> str:
    """One line per depth and form: medians in ms, speedups as paired ratios (see `_paired`) over GenAI's AR
    and over the fastest plain peer's; then one line per depth and plain peer."""
    lines = ["| layers | form | our AR ms | GenAI AR ms | fastest plain peer ms | AR: x GenAI / x fastest | "
             "tau 4, b3 / b7 ms | tau 4 best: x GenAI / x fastest | tau 8, b7 ms | tau 8: x GenAI / x fastest | "
             "AR tokens = GenAI's | GLANCE tokens = own AR | peak RSS / graphs | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["layers"]):
        s = r["samples"]
        for a, f in r["forms"].items():
            m = f["modes"]
            genai = genai_key(a) if genai_key(a) in s else None
            fastest = f.get("fastest_peer", genai)  # rows stored before other peers: GenAI alone
            refs = (genai, fastest)
            same = "/".join(str(m[k]["tokens_equal_own_ar"]) for k in ("glance-tau4-b3", "glance-tau4-b7",
                                                                          "glance-tau8-b7"))
            label = a if precision(a) == FP32 else f"int4 {a}"
            genai_ms = f.get("genai_ar_ms", r.get("genai_ar_ms", "-"))  # rows stored before fp32 forms: one GenAI
            fastest_ms = f"{f.get('fastest_peer_ms', genai_ms)} ({peer_label(fastest)})" if fastest else "-"
            genai_tokens = f"{f['tokens_equal_genai']}/{r['new_tokens']}" if "tokens_equal_genai" in f else "-"
            lines.append(f"| {r['layers']} | {label} | {f['ar_ms']} | {genai_ms} | {fastest_ms} | "
                         f"{_ratios(s, [f'{a}:ar'], refs)} | "
                         f"{m['glance-tau4-b3']['ms']} / {m['glance-tau4-b7']['ms']} (tau {m['glance-tau4-b3']['tau']}) | "
                         f"{_ratios(s, [f'{a}:glance-tau4-b3', f'{a}:glance-tau4-b7'], refs)} | "
                         f"{m['glance-tau8-b7']['ms']} (tau {m['glance-tau8-b7']['tau']}) | "
                         f"{_ratios(s, [f'{a}:glance-tau8-b7'], refs)} | {genai_tokens} | "
                         f"{same} of {r['new_tokens']} | {_memory(r, a)} | {r['load_avg_end']} |")
    peers = [line for r in sorted(rows, key=lambda r: r["layers"]) for line in _peer_rows(r)]
    if peers:
        lines += ["", "| layers | plain peer | AR ms | prefill ms | x GenAI | tokens = ours (where they first differ: "
                  "its token's rank in our top-k, log-prob below ours) | tokens = GenAI's | build s (peak) | "
                  "file GiB (token embedding) | peak RSS decoding |", "|---|---|---|---|---|---|---|---|---|---|",
                  *peers]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", default="8,12")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accuracies", default="int8",
                    help="MatMulNBits compute modes of the int4 exports (int8, exact); fp32 adds the unquantized "
                         "export, held against GenAI's fp32 build")
    ap.add_argument("--group-sizes", default=str(GROUP_SIZE), help=f"int4 group sizes (default: the export's, {GROUP_SIZE})")
    ap.add_argument("--draft-vocabs", default=f"0,{DRAFT_VOCAB}",
                    help="heads' draft vocabulary sizes: 0 for the whole vocabulary, N for a head drafting over "
                         "the N tokens of GenAI's answers, auto for a head without one exported at the export's "
                         "default (its tokenizer's merge order) (default: 0 and 32768)")
    ap.add_argument("--genai-python", default=sys.executable,
                    help="the interpreter whose onnxruntime_genai runs GenAI's side (default: this one)")
    ap.add_argument("--llama-python", default=sys.executable,
                    help="the interpreter of an environment with llama-cpp-python and gguf for llama.cpp's side "
                         "(default: this one)")
    ap.add_argument("--llama-source", type=Path,
                    help="the llama.cpp tree whose convert_hf_to_gguf.py converts the snapshot (the "
                         "llama-cpp-python source distribution's vendor/llama.cpp)")
    ap.add_argument("--stage", choices=("build", "time", "memory", "render"))
    ap.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    forms = forms_of(args.accuracies, args.group_sizes, args.draft_vocabs)
    store = args.out / "int4_vs_genai.json"
    if args.stage == "render":  # the table again from the stored rows
        (args.out / "int4_vs_genai.md").write_text(render(json.loads(store.read_text())))
        return
    args.genai_python = peer_python(args.genai_python, "onnxruntime_genai", "GenAI", "--genai-python")
    args.llama_python = peer_python(args.llama_python, "llama_cpp", "llama.cpp", "--llama-python")
    if not args.genai_python and any(v > 0 for _, _, v in forms) and args.stage in (None, "build"):
        raise SystemExit(f"--draft-vocabs {args.draft_vocabs}: a reduced draft vocabulary is picked from GenAI's "
                         f"answers and GenAI is skipped; pass --genai-python PY or --draft-vocabs 0")
    if args.stage:
        work = args.out / f"work-{args.depth}"
        work.mkdir(parents=True, exist_ok=True)
        if args.stage == "build":  # what an earlier run built keeps its figures
            done = work / "build.json"
            result = {**(json.loads(done.read_text()) if done.exists() else {}),
                      **build(work, args.depth, forms, args.genai_python, args.llama_python, args.llama_source,
                              args.threads)}
        elif args.stage == "memory":
            result = memory(work, forms, args.threads, args.new_tokens)
        else:
            result = time_depth(work, args.depth, forms, args.threads, args.new_tokens, args.repeats,
                                args.genai_python, args.llama_python)
        (work / f"{args.stage}.json").write_text(json.dumps(result, indent=2))
        return
    depths = list(map(int, args.layers.split(",")))
    if args.llama_python and "int4" in {precision(form_name(*f)) for f in forms} and any(not (args.out / f"work-{d}" / f"llama-{f}.gguf").exists()
                                 for d in depths for f in llamacpp_peer.FORMS):
        llamacpp_peer.source_tree(args.llama_source)  # before hours of building, not after
    args.out.mkdir(parents=True, exist_ok=True)
    rows = json.loads(store.read_text()) if store.exists() else []
    for layers in depths:
        base = [sys.executable, __file__, str(args.out), "--depth", str(layers), "--accuracies", args.accuracies,
                "--group-sizes", args.group_sizes, "--draft-vocabs", args.draft_vocabs,
                "--genai-python", args.genai_python, "--llama-python", args.llama_python,
                *(["--llama-source", str(args.llama_source)] if args.llama_source else []),
                "--threads", str(args.threads), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        for stage in ("build", "time", "memory"):
            if subprocess.run([*base, "--stage", stage], env=_env()).returncode:
                raise SystemExit(f"[{layers} layers] the {stage} stage failed (its message is above)")
        work = args.out / f"work-{layers}"
        row = json.loads((work / "time.json").read_text())
        row["build"] = json.loads((work / "build.json").read_text())
        row["memory"] = json.loads((work / "memory.json").read_text())
        rows = [r for r in rows if r["layers"] != layers] + [row]
        store.write_text(json.dumps(rows, indent=2))
        (args.out / "int4_vs_genai.md").write_text(render(rows))
        print(render(rows), flush=True)


if __name__ == "__main__":
    main()
