"""Bad input, systematically: every command against every kind of bad input a user can hand it.

Each row is one command line and the phrase its refusal must contain. Every refusal must be one
stderr line `PROG: error: ...` that names the problem and a fix, with a non-zero exit, nothing on
stdout, no traceback, and no output left behind (a given --out is absent or exactly as before, with
no hidden siblings). A new command (say, `glance-bench`) is one more entry in COMMANDS and a few rows.
Commands run in process through their `main(argv)`; rows whose point is a real process (bytes in
argv that are not UTF-8) run as one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from PIL import Image

from glance_export.model.adapters import Snapshot
from glance_export.cli import main as export_main
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_runtime.cli.bench import main as bench_main
from glance_runtime.cli.run import main as run_main
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.formats.artifacts import VERSION as ARTIFACTS_VERSION
from glance_runtime.formats.common import digest
from glance_runtime.store.integrity import sha256
from support import export_once, make_snapshot

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
COMMANDS: dict[str, Callable[[list[str]], int]] = {"glance-run": run_main, "glance-export": export_main,
                                                   "glance-bench": bench_main}
PROCESS = {"glance-run": "from glance_runtime.cli.run import main", "glance-export": "from glance_export.cli import main",
           "glance-bench": "from glance_runtime.cli.bench import main"}
ANSWERS = {"glance-run"}  # commands whose stdout is the answer: nothing at all may appear there on a refusal
FIX = re.compile(r"\b(pass|use|point|set|make|free|keep|run|redirect|re-?export|pick|lower|raise|copy|create|add|install|drop|rebuild|shorten|crop|"
                 r"downscale|convert|write|remove|check|choose|see|retrain|export|build|give|restore|save)\b", re.I)


class Inputs:
    """Good inputs (shared, built once) and ways to break copies of them (per row, in tmp)."""

    def __init__(self, model: Path, head: Path, art: Path, other_model: Path, other_head: Path, tmp: Path):
        self.model, self.head, self.art, self.other_model, self.other_head = model, head, art, other_model, other_head
        self.tmp = tmp
        self.image = tmp / "ok.png"
        Image.new("RGB", (96, 64), (200, 30, 30)).save(self.image)

    def copy(self, what: str) -> Path:
        src = {"model": self.model, "head": self.head, "art": self.art, "shipped": DEFAULT_ARTIFACTS}[what]
        return Path(shutil.copytree(src, self.tmp / f"{what}_copy"))

    def write(self, name: str, data: bytes | str) -> Path:
        path = self.tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path

    def image_file(self, name: str, width: int, height: int) -> Path:
        path = self.tmp / name
        Image.new("RGB", (width, height), (0, 90, 200)).save(path)
        return path

    def fifo(self, name: str) -> Path:
        os.mkfifo(self.tmp / name)
        return self.tmp / name

    def link(self, name: str, target: str) -> Path:
        (self.tmp / name).symlink_to(self.tmp / target)
        return self.tmp / name

    def tasks(self, *rows: str) -> Path:
        return self.write("tasks.jsonl", "".join(r + "\n" for r in rows))

    def flip(self, path: Path) -> Path:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
        return path

    def truncate(self, path: Path) -> Path:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
        return path

    def edited(self, what: str, name: str, edit: Callable[[Path], object]) -> Path:
        copy = self.copy(what)
        edit(copy / name)
        return copy

    def rehashed(self, name: str, edit: Callable[[Path], object]) -> Path:
        """A copy of the export with `name` edited and every hash redone, as a deliberate editor would: only
        the checks of the values themselves can refuse it."""
        copy = self.copy("art")
        if name != "manifest.json":
            edit(copy / name)
        manifest = json.loads((copy / "manifest.json").read_text())
        if name == "manifest.json":
            edit(manifest)
        else:
            manifest["file_hashes"][name] = {"sha256": sha256(copy / name), "size": (copy / name).stat().st_size}
        manifest["content_sha256"] = digest(manifest, leave_out="content_sha256")
        (copy / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return copy

    def processor(self, **values) -> Path:
        def edit(path: Path) -> None:
            path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
        return self.rehashed("preprocessor_config.json", edit)


@dataclass(frozen=True)
class Row:
    id: str
    prog: str
    argv: Callable[[Inputs], list]
    expect: str  # a phrase of the refusal (regex)
    out: str | None = None  # name under tmp given as --out: must be left absent or unchanged
    process: bool = False
    env: Callable[[Inputs], dict[str, str]] | None = None  # environment of the run
    stdout: str | None = None  # with process: a device for stdout ("/dev/full") or "closed"


def run(i: Inputs, *extra) -> list:
    return ["--image", i.image, "--prompt", "What is shown?", "--max-new-tokens", "4", *extra]


def ort(i: Inputs, art: Path, *extra) -> list:
    return ["--backend", "onnxruntime", "--artifacts", art, *run(i, *extra)]


def torch(i: Inputs, *extra, model: Path | None = None, head: Path | None = None) -> list:
    return ["--backend", "torch", "--model", model or i.model, "--head", head or i.head, *run(i, *extra)]


def audit(i: Inputs, data: Path, *extra) -> list:
    return ["audit", "--model", i.model, "--head", i.head, "--data", data, "--max-new-tokens", "4", *extra]


def onnx(i: Inputs, *extra, model: Path | None = None, head: Path | None = None, out: str | Path = "art_out") -> list:
    return ["onnx", "--model", model or i.model, "--head", head or i.head, "--out", i.tmp / out, *extra]


def build(i: Inputs, art: Path, *extra, out: str = "eng_out") -> list:
    return ["build", "--target", "rtx", "--artifacts", art, "--out", i.tmp / out, *extra]


def train_head(i: Inputs, data: Path, *extra, out: str | Path = "head_out") -> list:
    return ["train-head", "--model", i.model, "--data", data, "--out", i.tmp / out, "--steps", "1", *extra]


ROWS = [
    # glance-run: images
    Row("run-image-missing", "glance-run", lambda i: run(i)[:1] + [i.tmp / "nope.png"] + run(i)[2:], "does not exist"),
    Row("run-image-empty", "glance-run", lambda i: ["--image", i.write("e.png", b""), "--prompt", "x"],
        "cannot be decoded"),
    Row("run-image-truncated", "glance-run",
        lambda i: ["--image", i.truncate(i.image_file("t.png", 300, 300)), "--prompt", "x"], "cannot be decoded"),
    Row("run-image-not-an-image", "glance-run", lambda i: ["--image", i.write("n.png", "hello"), "--prompt", "x"],
        "cannot be decoded"),
    Row("run-image-far-too-large", "glance-run",
        lambda i: ["--image", i.image_file("big.png", 12000, 12000), "--prompt", "x"], "larger than"),
    Row("run-image-directory", "glance-run", lambda i: ["--image", i.tmp, "--prompt", "x"], "is a directory"),
    Row("run-image-fifo", "glance-run", lambda i: ["--image", i.fifo("f.png"), "--prompt", "x"], "named pipe"),
    Row("run-image-symlink-loop", "glance-run", lambda i: ["--image", i.link("loop.png", "loop.png"), "--prompt", "x"],
        "symbolic link loop"),
    Row("run-image-dangling-link", "glance-run", lambda i: ["--image", i.link("d.png", "gone.png"), "--prompt", "x"],
        "dangling symbolic link"),
    Row("run-image-under-a-file", "glance-run", lambda i: ["--image", i.tmp / "a_file" / "x.png", "--prompt", "x"],
        "a part of the path is a file"),
    Row("audit-task-image-directory", "glance-export",
        lambda i: audit(i, i.tasks(json.dumps({"prompt": "x", "image": str(i.tmp)}))), "is a directory"),
    Row("run-image-sliver", "glance-run", lambda i: ["--image", i.image_file("s.png", 4000, 2), "--prompt", "x"],
        "aspect ratio"),
    # glance-run: prompt
    Row("run-prompt-longer-than-context", "glance-run",
        lambda i: ort(i, i.art)[:4] + ["--prompt", "red " * 400, "--budget", "8"], "longer than --max-context"),
    Row("run-prompt-not-utf8", "glance-run", lambda i: [b"--prompt", b"caf\xe9 \xff\xfe"], "not valid UTF-8",
        process=True),
    # glance-run: flags out of range or beyond what the artifacts serve
    Row("run-budget-negative", "glance-run", lambda i: run(i, "--budget", "-1"), "--budget >= 0"),
    Row("run-branch-k-zero", "glance-run", lambda i: run(i, "--branch-k", "0"), "--branch-k must be >= 1"),
    Row("run-max-new-tokens-zero", "glance-run", lambda i: run(i, "--max-new-tokens", "0"), "--max-new-tokens"),
    Row("run-budget-beyond-artifacts", "glance-run", lambda i: ort(i, i.art, "--budget", "500"), "--budget 500"),
    Row("run-branch-k-beyond-artifacts", "glance-run", lambda i: ort(i, i.art, "--branch-k", "20"), "--branch-k 20"),
    Row("run-max-context-beyond-export", "glance-run", lambda i: ort(i, i.art, "--max-context", "100000"),
        "--max-context 100000 is outside"),
    Row("run-max-tree-zero", "glance-run", lambda i: ort(i, i.art, "--max-tree", "0"), "--max-tree 0 is outside"),
    Row("run-flag-not-a-number", "glance-run", lambda i: run(i, "--budget", "lots"), "'lots' is not a budget: pass auto"),
    Row("run-unknown-provider", "glance-run", lambda i: ort(i, i.art, "--provider", "warp9"), "not available"),
    Row("run-spec-without-head", "glance-run", lambda i: ["--backend", "torch", "--model", i.model, *run(i)],
        "needs --head"),
    # glance-run: directories and the files in them
    Row("run-model-missing", "glance-run", lambda i: ["--model", i.tmp / "none", "--prompt", "x"], "does not exist"),
    Row("run-artifacts-missing", "glance-run", lambda i: ort(i, i.tmp / "none"), "does not exist"),
    Row("run-manifest-missing", "glance-run", lambda i: ort(i, i.edited("art", "manifest.json", Path.unlink)),
        "no manifest.json"),
    Row("run-manifest-truncated", "glance-run", lambda i: ort(i, i.edited("art", "manifest.json", i.truncate)),
        "not valid JSON"),
    Row("run-manifest-other-format", "glance-run", lambda i: ort(i, i.edited(
        "art", "manifest.json", lambda p: p.write_text(p.read_text().replace(f'"format_version": {ARTIFACTS_VERSION}', '"format_version": 9')))),
        "v9"),
    Row("run-graph-flipped-byte", "glance-run", lambda i: ort(i, i.edited("shipped", "target.onnx", i.flip)),
        "target.onnx does not match the sha256"),
    Row("run-graph-truncated", "glance-run", lambda i: ort(i, i.edited("art", "vision.onnx", i.truncate)),
        "vision.onnx is .* bytes but"),
    Row("run-tokenizer-corrupted", "glance-run", lambda i: ort(i, i.edited("art", "tokenizer.json", i.flip)),
        "tokenizer.json does not match"),
    Row("run-chat-template-missing", "glance-run", lambda i: ort(i, i.edited("art", "chat_template.jinja", Path.unlink)),
        "chat_template.jinja"),
    Row("run-weights-truncated", "glance-run", lambda i: torch(i, model=i.edited("model", "model.safetensors", i.truncate)),
        "cannot load weights"),
    Row("run-model-tokenizer-corrupted", "glance-run",
        lambda i: torch(i, model=i.edited("model", "tokenizer.json", i.truncate)), "tokenizer"),
    Row("run-model-chat-template-broken", "glance-run", lambda i: torch(i, model=i.edited(
        "model", "chat_template.jinja", lambda p: p.write_text("{% for x in %}"))), "chat template"),
    Row("run-model-config-not-json", "glance-run", lambda i: torch(i, model=i.edited("model", "config.json", i.truncate)),
        "not valid JSON"),
    Row("run-head-weights-corrupted", "glance-run", lambda i: torch(i, head=i.edited("head", "model.safetensors", i.truncate)),
        "cannot read"),
    Row("run-head-for-another-target", "glance-run", lambda i: torch(i, head=i.other_head), "head was made for"),
    # glance-run: exports edited with their hashes redone, each value refused when loaded
    Row("run-template-loops", "glance-run", lambda i: ort(i, i.rehashed("chat_template.jinja", lambda p: p.write_text(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"))), "past its budget"),
    Row("run-template-doubles-text", "glance-run", lambda i: ort(i, i.rehashed("chat_template.jinja", lambda p: p.write_text(
        '{% set ns = namespace(s="x") %}{% for a in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}'))),
        "past its budget"),
    Row("run-tokenizer-junk", "glance-run", lambda i: ort(i, i.rehashed("tokenizer.json", lambda p: p.write_text(
        '{"version": "1.0", "model": {"type": "nonsense"}}'))), "cannot load .*tokenizer.json"),
    Row("run-processor-patch-size-zero", "glance-run", lambda i: ort(i, i.processor(patch_size=0)), "patch_size is 0"),
    Row("run-processor-merge-size-huge", "glance-run", lambda i: ort(i, i.processor(merge_size=10**6)), "merge_size"),
    Row("run-processor-std-zero", "glance-run", lambda i: ort(i, i.processor(image_std=[0, 0, 0])), "image_std"),
    Row("run-processor-resample-unknown", "glance-run", lambda i: ort(i, i.processor(resample=42)), "resample is 42"),
    Row("run-processor-max-pixels-huge", "glance-run", lambda i: ort(i, i.processor(max_pixels=10**12)), "max_pixels"),
    Row("run-processor-an-array", "glance-run", lambda i: ort(i, i.rehashed(
        "preprocessor_config.json", lambda p: p.write_text("[1, 2]"))), "array, not an object"),
    Row("run-manifest-num-layers", "glance-run", lambda i: ort(i, i.rehashed(
        "manifest.json", lambda m: m["graphs"]["target"].update(num_layers=1))), "num_layers is 1"),
    Row("run-manifest-axis-huge", "glance-run", lambda i: ort(i, i.rehashed(
        "manifest.json", lambda m: m["axes"].update(T=[1, 10**9]))), r"axes\.T is 1000000000"),
    # glance-run: flags that conflict
    Row("run-artifacts-and-model", "glance-run", lambda i: ort(i, i.art, "--model", i.other_model), "would be ignored"),
    Row("run-engines-and-head", "glance-run", lambda i: ["--backend", "tensorrt", "--engines", i.art, "--head", i.head,
                                                          *run(i)], "would be ignored"),
    Row("run-engines-manifest-truncated", "glance-run", lambda i: ["--backend", "tensorrt", "--engines", i.edited(
        "art", "manifest.json", lambda p: p.rename(p.with_name("engines.json"))), *run(i)], "engine manifest"),
    # glance-export audit
    Row("audit-task-file-missing", "glance-export", lambda i: audit(i, i.tmp / "none.jsonl"), "does not exist"),
    Row("audit-task-line-truncated", "glance-export", lambda i: audit(i, i.tasks('{"prompt": "ok"}', '{"prompt": "cut')),
        r"tasks.jsonl:2 is not valid JSON"),
    Row("audit-task-file-not-utf8", "glance-export", lambda i: audit(i, i.write("tasks.jsonl", b'{"prompt": "\xff"}\n')),
        "not valid UTF-8"),
    Row("audit-task-image-corrupt", "glance-export",
        lambda i: audit(i, i.tasks(json.dumps({"prompt": "x", "image": str(i.write("bad.png", "no"))}))),
        "cannot be decoded"),
    Row("audit-artifacts-for-another-model", "glance-export", lambda i: [
        "audit", "--backend", "onnxruntime", "--artifacts", i.art, "--model", i.other_model, "--data",
        i.tasks('{"prompt": "x"}'), "--max-new-tokens", "2", "--budget", "8"], "differs from the one"),
    Row("audit-budget-beyond-artifacts", "glance-export", lambda i: [
        "audit", "--backend", "onnxruntime", "--artifacts", i.art, "--model", i.model, "--data",
        i.tasks('{"prompt": "x"}'), "--budget", "999"], "--budget 999"),
    Row("audit-budget-not-a-number", "glance-export",
        lambda i: audit(i, i.tasks('{"prompt": "x"}'), "--budget", "lots"), "'lots' is not a budget: pass auto"),
    Row("audit-auto-branch-k-beyond-artifacts", "glance-export", lambda i: [
        "audit", "--backend", "onnxruntime", "--artifacts", i.art, "--model", i.model, "--data",
        i.tasks('{"prompt": "x"}'), "--budget", "auto", "--branch-k", "20"], "--branch-k 20"),
    # glance-export onnx
    Row("onnx-out-exists", "glance-export", lambda i: onnx(i, out="taken"), "no glance command made", out="taken"),
    Row("onnx-out-is-a-head", "glance-export", lambda i: onnx(i, out=i.copy("head")),
        "is a glance-head output, not a glance-artifacts", out="head_copy"),
    Row("onnx-out-is-the-model", "glance-export", lambda i: onnx(i, model=i.copy("model"), out="model_copy"),
        "is the input", out="model_copy"),
    Row("onnx-out-under-a-file", "glance-export", lambda i: onnx(i, out="a_file/art"), "cannot create"),
    Row("onnx-opset", "glance-export", lambda i: onnx(i, "--opset", "99"), "opset 99", out="art_out"),
    Row("onnx-max-tree-above-context", "glance-export", lambda i: onnx(i, "--max-tree", "64", "--max-context", "32"),
        "max_tree < max_context", out="art_out"),
    Row("onnx-head-for-another-target", "glance-export", lambda i: onnx(i, head=i.other_head), "head was made for",
        out="art_out"),
    Row("onnx-weights-truncated", "glance-export",
        lambda i: onnx(i, model=i.edited("model", "model.safetensors", i.truncate)), "ends inside tensor .*; restore",
        out="art_out"),
    Row("onnx-model-without-weights", "glance-export",
        lambda i: onnx(i, model=i.edited("model", "model.safetensors", Path.unlink)), "no \\*.safetensors",
        out="art_out"),
    # glance-export build
    Row("build-artifacts-corrupted", "glance-export", lambda i: build(i, i.edited("art", "draft.onnx", i.flip)),
        "draft.onnx does not match", out="eng_out"),
    Row("build-model-without-head", "glance-export", lambda i: ["build", "--target", "rtx", "--model", i.model,
                                                                "--out", i.tmp / "eng_out"], "--model and --head",
        out="eng_out"),
    Row("build-out-is-the-export", "glance-export", lambda i: build(i, i.art)[:-1] + [i.art], "is the input"),
    Row("build-plan-only-inside-the-export", "glance-export",
        lambda i: build(i, i.copy("art"), "--plan-only", out="art_copy/bundle"), "lies inside the input",
        out="art_copy"),
    Row("build-precision-unsupported", "glance-export", lambda i: build(i, i.art, "--precision", "fp8"), "fp8",
        out="eng_out"),
    Row("build-does-not-fit", "glance-export", lambda i: build(i, i.art, "--memory-gib", "1"), "does not fit|GiB",
        out="eng_out"),
    Row("build-artifacts-for-another-model", "glance-export", lambda i: [
        "build", "--target", "rtx", "--artifacts", i.art, "--model", i.other_model, "--head", i.head,
        "--out", i.tmp / "eng_out"], "differs from the one", out="eng_out"),
    # glance-export train-head, init-head, train-target, corpus, eval
    Row("train-head-task-file-empty", "glance-export", lambda i: train_head(i, i.write("tasks.jsonl", "")),
        "has no tasks", out="head_out"),
    Row("train-head-out-not-a-head", "glance-export", lambda i: train_head(i, i.tasks('{"prompt": "x"}'), out="taken"),
        "no glance command made, not a glance-head", out="taken"),
    Row("train-head-out-is-a-snapshot", "glance-export",
        lambda i: train_head(i, i.tasks('{"prompt": "x"}'), out=i.copy("model")),
        "no glance command made, not a glance-head", out="model_copy"),
    Row("train-head-checkpoint-every-zero", "glance-export",
        lambda i: train_head(i, i.tasks('{"prompt": "x"}'), "--checkpoint-every", "0"), "--checkpoint-every",
        out="head_out"),
    Row("init-head-not-a-model", "glance-export", lambda i: ["init-head", "--model", i.tmp / "taken", "--out", i.tmp / "h"],
        "config.json is missing", out="h"),
    Row("init-head-mask-outside-vocab", "glance-export", lambda i: [
        "init-head", "--model", i.model, "--out", i.tmp / "h", "--mask-token-id", "999999"], "outside", out="h"),
    Row("init-head-out-not-a-head", "glance-export", lambda i: ["init-head", "--model", i.model, "--out", i.tmp / "taken"],
        "no glance command made", out="taken"),
    Row("init-head-out-is-the-model", "glance-export",
        lambda i: ["init-head", "--model", i.copy("model"), "--out", i.tmp / "model_copy"], "is the input",
        out="model_copy"),
    Row("init-head-out-holds-the-model", "glance-export",
        lambda i: ["init-head", "--model", i.copy("model"), "--out", i.tmp], "holds the input"),
    Row("train-target-out-is-a-snapshot", "glance-export",
        lambda i: ["train-target", "--out", i.copy("model"), "--steps", "1"], "not a glance-target-run",
        out="model_copy"),
    Row("corpus-out-is-a-task-folder", "glance-export", lambda i: [
        "corpus", "--kind", "scene", "--n", "2", "--out", Path(shutil.copytree(EXAMPLES / "scene", i.tmp / "scene"))],
        "no glance command made, not a glance-tasks", out="scene"),
    Row("train-target-bad-mix", "glance-export", lambda i: ["train-target", "--out", i.tmp / "t", "--mix", "poems=1"],
        "--mix", out="t"),
    Row("corpus-negative-n", "glance-export", lambda i: ["corpus", "--kind", "scene", "--n", "-3", "--out", i.tmp / "c"],
        "--n", out="c"),
    Row("eval-task-file-missing", "glance-export", lambda i: ["eval", "--model", i.model, "--data", i.tmp / "none.jsonl"],
        "does not exist|Qwen2.5-VL"),
    Row("export-unknown-subcommand", "glance-export", lambda i: ["frobnicate"], "invalid choice"),
    # glance-bench
    Row("bench-budget-beyond-artifacts", "glance-bench", lambda i: [
        "--data", i.tasks('{"prompt": "x"}'), "--out", i.tmp / "bench_out", "--backend", "onnxruntime",
        "--artifacts", i.art, "--budgets", "7,500", "--no-plots"], "--budget 500", out="bench_out"),
    Row("bench-out-is-a-file", "glance-bench", lambda i: [
        "--data", i.tasks('{"prompt": "x"}'), "--out", i.tmp / "a_file", "--no-plots"], "is not a directory"),
    Row("bench-out-is-an-export", "glance-bench", lambda i: [
        "--data", i.tasks('{"prompt": "x"}'), "--out", i.copy("art"), "--no-plots"], "is a glance-artifacts output",
        out="art_copy"),
    Row("bench-out-is-the-root", "glance-bench", lambda i: [
        "--data", i.tasks('{"prompt": "x"}'), "--out", "/", "--no-plots"], "holds the input"),
    Row("bench-out-holds-its-tasks", "glance-bench", lambda i: [
        "--data", i.tasks('{"prompt": "x"}'), "--out", i.tmp, "--no-plots"], "holds the input"),
    # every command: the cache location, stdout
    Row("run-cache-is-a-file", "glance-run", lambda i: run(i), r"cache directory .*a_file \(\$GLANCE_CACHE\) is a file",
        env=lambda i: {"GLANCE_CACHE": str(i.tmp / "a_file")}),
    Row("run-cache-under-a-file", "glance-run", lambda i: run(i), "lies under .*a_file, which is not a directory",
        env=lambda i: {"GLANCE_CACHE": str(i.tmp / "a_file" / "cache")}),
    Row("run-cache-empty-and-home-a-file", "glance-run", lambda i: run(i), r"\(under \$HOME\) lies under",
        env=lambda i: {"GLANCE_CACHE": "", "HOME": str(i.tmp / "a_file")}),
    Row("run-stdout-full", "glance-run", lambda i: ort(i, i.art, "--budget", "8"), "no space left",
        process=True, stdout="/dev/full"),
    Row("run-json-stdout-full", "glance-run", lambda i: ort(i, i.art, "--budget", "8", "--json"), "no space left",
        process=True, stdout="/dev/full"),
    Row("run-stdout-closed", "glance-run", lambda i: ort(i, i.art, "--budget", "8"), "stdout is closed",
        process=True, stdout="closed"),
]


@pytest.fixture(scope="module")
def shared(snapshot_dir, tmp_path_factory):
    """The good model, head and export, and another target (2 layers, other weights) with its own head."""
    model, head, art = export_once(snapshot_dir, tmp_path_factory, "qwen2_5_vl")
    root = tmp_path_factory.mktemp("other_target")
    other = Snapshot(make_snapshot(root / "model", "qwen2_5_vl", layers=2, seed=1))
    other_head = save_head(init_head(head_config_for(other, 1, 4, pick_mask_token(other)), seed=0), root / "head")
    return model, head, art, other.path, other_head


def _state(path: Path) -> dict[str, bytes] | None:
    if not path.exists():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _in_process(row: Row, argv: list, capsys) -> tuple[int, str, str]:
    try:
        code = COMMANDS[row.prog]([str(a) for a in argv])
    except SystemExit as exc:  # argparse refusals
        code = exc.code
    stdout, stderr = capsys.readouterr()
    return code, stdout, stderr


def _as_process(row: Row, argv: list, env: dict[str, str]) -> tuple[int, str, str]:
    code = f"import sys; {PROCESS[row.prog]}; sys.exit(main(sys.argv[1:]))"
    args = [a if isinstance(a, bytes) else str(a).encode() for a in argv]
    if row.stdout is None:
        out = subprocess.PIPE
    else:
        out = subprocess.DEVNULL if row.stdout == "closed" else open(row.stdout, "wb")
    proc = subprocess.run([sys.executable.encode(), b"-c", code.encode(), *args], stdout=out, stderr=subprocess.PIPE,
                          env={**os.environ, "LC_ALL": "C.UTF-8", **env}, timeout=300,
                          **({"preexec_fn": lambda: os.close(1)} if row.stdout == "closed" else {}))
    if row.stdout not in (None, "closed"):
        out.close()
    return proc.returncode, (proc.stdout or b"").decode(errors="replace"), proc.stderr.decode(errors="replace")


def test_the_table_covers_every_command_and_thirty_kinds():
    covered = {r.id.split("-")[0] for r in ROWS}
    assert {"run", "audit", "onnx", "build", "train", "init", "corpus", "eval", "bench"} <= covered
    assert {r.prog for r in ROWS} == set(COMMANDS)
    assert len(ROWS) >= 30 and len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_line_with_a_fix_and_leaves_nothing(row, shared, tmp_path, capsys, monkeypatch):
    i = Inputs(*shared, tmp_path)
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("someone's files")
    argv = row.argv(i)
    env = row.env(i) if row.env else {}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / row.out if row.out else None
    before = _state(out) if out else None
    capsys.readouterr()
    code, stdout, stderr = _as_process(row, argv, env) if row.process else _in_process(row, argv, capsys)
    lines = stderr.strip().splitlines()
    assert code not in (0, None) and "Traceback" not in stderr, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith(f"{row.prog}"), stderr
    assert ": error: " in lines[0] and re.search(row.expect, lines[0]), lines[0]
    assert FIX.search(lines[0].split(": error: ", 1)[1]), f"names no fix: {lines[0]}"
    assert stdout == "" or row.prog not in ANSWERS, stdout
    if out is not None:
        assert _state(out) == before
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
