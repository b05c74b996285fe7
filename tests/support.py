"""What the tests share: tiny random snapshots of every family, seeded images, live `glance-serve` processes,
`--budget auto` policies that force what parity under auto must cover, and preludes that run code as an edge
install would, and the check that a command keeps the outputs it did not make.

Torch and transformers are imported inside the functions that build snapshots, so a test on an edge install
(no torch) imports this module too; only the tests that build a snapshot need the export stack.
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from glance_runtime.cli.run import main as run_main
from glance_runtime.decode.auto_budget import AutoBudget
from glance_runtime.decode.calibration import Calibration
from glance_runtime.decode.cost_profile import CostProfile, row_grid
from glance_runtime.decode.loop import DecodeConfig, DecodeResult, decode

REPO = Path(__file__).resolve().parents[1]


# ---- Tiny random snapshots ----
# Tiny random HF snapshots of every supported family, written as a user's snapshot would be.
#
# Weights are re-drawn from a wide normal so that greedy output depends on the image and the
# context with margins far above fp32 noise (transformers' default init collapses to one token).

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TEXT_FAMILIES = ("qwen2", "qwen3", "llama")
ALL_FAMILIES = VL_FAMILIES + TEXT_FAMILIES
CORPUS = ["What colour is the square? The square is red, green or blue.",
          "Describe the image. How many circles are there? Read the total on the receipt: 42.17",
          "user assistant system The quick brown fox jumps over the lazy dog 0123456789"]


def _tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from glance_export.train.tokenizer import CHAT_TEMPLATE  # the Qwen-style template of the default model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    ids["vocab"] = tok.get_vocab_size()
    return ids


def _config(family: str, ids: dict[str, int], layers: int, tied: bool = False):
    import transformers as tf

    vocab = ids["vocab"] + 8  # spare embedding rows past the tokenizer, like real checkpoints
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                tie_word_embeddings=tied, eos_token_id=ids["<|im_end|>"], rms_norm_eps=1e-6,
                bos_token_id=None, pad_token_id=ids["<|endoftext|>"])
    vl_ids = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  eos_token_id=ids["<|im_end|>"], tie_word_embeddings=tied)
    if family == "qwen2_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, **vl_ids)
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **vl_ids)
    if family == "qwen3_vl":
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                  "mrope_interleaved": True, "rope_theta": 10000.0})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **vl_ids)
    cls = {"qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "llama": tf.LlamaConfig}[family]
    if family == "qwen3":
        text["head_dim"] = 16
    return cls(**text)


def _processor(family: str) -> dict:
    patch = 16 if family == "qwen3_vl" else 14
    unit = patch * 2
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "temporal_patch_size": 2,
            "merge_size": 2, "min_pixels": unit * unit * 4, "max_pixels": unit * unit * 64,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


def make_snapshot(out: Path, family: str, layers: int = 4, seed: int = 0, std: float = 0.5,
                  tied: bool = False) -> Path:
    """Write a complete HF-format snapshot directory for a tiny random model of `family`; `tied` shares
    the embedding with the LM head, as Qwen2.5-VL-3B and Qwen3-VL-2B/4B do."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging

    logging.disable_progress_bar()  # the snapshot is tiny; progress lines would only pollute captured stderr
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out)
    config = _config(family, ids, layers, tied)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family in VL_FAMILIES else AutoModelForCausalLM
    model = auto.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
    model.save_pretrained(out)
    if family in VL_FAMILIES:
        (out / "preprocessor_config.json").write_text(json.dumps(_processor(family), indent=2))
    return out


def make_wide_snapshot(out: Path, family: str, text: dict, vision: dict | None = None, tied: bool = False) -> Path:
    """A random snapshot at another width: `text` and (VL families) `vision` override the tiny config (nested
    dicts such as rope_parameters are merged), the tokenizer and processor stay the tiny model's, and weights
    are re-drawn at std 2/sqrt(hidden) so greedy output still depends on the context. For benchmarks at a
    real model's width; depth is text's num_hidden_layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vl = family in VL_FAMILIES
    snap = make_snapshot(out, family, layers=text.get("num_hidden_layers", 4), tied=tied)
    raw = json.loads((snap / "config.json").read_text())
    sections = ((raw["text_config"], text), (raw["vision_config"], {"out_hidden_size": text["hidden_size"],
                                                                     **(vision or {})})) if vl else ((raw, text),)
    for section, overrides in sections:
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(section.get(key), dict):
                section[key].update(value)
            else:
                section[key] = value
    raw["tie_word_embeddings"] = tied
    if vl:
        raw["text_config"]["tie_word_embeddings"] = tied
    (snap / "config.json").write_text(json.dumps(raw, indent=2))
    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    model = auto.from_config(AutoConfig.from_pretrained(snap))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 2.0 / text["hidden_size"] ** 0.5)
    for old in snap.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(snap)
    return snap


def make_mid_snapshot(out: Path, layers: int) -> tuple[Path, int]:
    """A qwen3 text model at hidden 1024, intermediate 4096 (about 60 MB of fp32 weights a layer), for tests
    of memory that must not grow with depth; returns it and its fp32 weight bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    snap = make_snapshot(out, "qwen3", layers=layers)
    raw = json.loads((snap / "config.json").read_text())
    raw.update(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    raw.pop("layer_types", None)
    (snap / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(snap))
    (snap / "model.safetensors").unlink()
    model.save_pretrained(snap)
    return snap, sum(p.numel() * 4 for p in model.parameters())


def make_image(path: Path, width: int, height: int, seed: int) -> Path:
    """A seeded image of random coloured rectangles, so different seeds give different pictures."""
    rng = np.random.default_rng(seed)
    arr = np.zeros((height, width, 3), np.uint8) + rng.integers(0, 255, 3, dtype=np.uint8)
    for _ in range(6):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        arr[y0:y0 + height // 3, x0:x0 + width // 3] = rng.integers(0, 255, 3, dtype=np.uint8)
    Image.fromarray(arr).save(path)
    return Path(path)


# ---- Running as an edge install ----
# Run code the way a Jetson install would: no torch, transformers, safetensors or glance_export.

def blocking(*packages: str) -> str:
    """A prelude that makes importing any of `packages` (or their submodules) fail."""
    return f"""
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {packages!r}:
            raise ImportError(f"{{name}} is blocked: an edge install has no training stack")
        return None

sys.meta_path.insert(0, Blocker())
"""


BLOCK_TRAINING_STACK = blocking("torch", "transformers", "glance_export", "safetensors")
# `glance-export build --artifacts` on a device: the toolkit's edge install plus TensorRT, no export stack.
BLOCK_EXPORT_STACK = blocking("torch", "transformers", "safetensors", "onnx", "onnxscript", "polygraphy")


# ---- What this machine lacks ----
# Skip reasons that say what is missing and how to get it.

TENSORRT_RTX_MISSING = ("needs TensorRT-RTX's builder, which is not installed: the dev install has it "
                        "(pip install -e '.[dev]', or pip install tensorrt-rtx)")


def cuda_unavailable() -> str | None:
    """Why CUDA buffers cannot be made here (the device layer's own one-line refusal: what is missing and how
    to get it), or None where they can."""
    from glance_runtime.backends.device_buffers import CudaDevice
    from glance_runtime.errors import GlanceError

    try:
        CudaDevice()
    except GlanceError as exc:
        return str(exc)
    return None


# ---- Live servers ----
# Live `glance-serve` processes on loopback ports for the server tests, and `glance-run`'s answers.

RECEIPT = REPO / "examples" / "receipt" / "images" / "receipt_000.png"
MODEL_NAME = "glance-vl-tiny"
START_TIMEOUT_S = 120
READY = re.compile(r"ready: .* on (http://\S+)")
LISTENING = re.compile(r"listening on (http://[^;\s]+)")


class Lines:
    """A stream's lines, read by a thread as they come. (Waiting on the pipe with select, then reading a line, misses
    lines the buffered reader took along with it: two lines written together left the second unseen.)"""

    def __init__(self, stream) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, timeout_s: float) -> str | None:
        """The next line; None where the stream has ended or none came within `timeout_s`."""
        try:
            return self._queue.get(timeout=max(timeout_s, 0))
        except queue.Empty:
            return None

    def rest(self) -> list[str]:
        """Every line not taken yet, once the stream has ended."""
        self._thread.join()
        left = []
        while not self._queue.empty():
            if (line := self._queue.get_nowait()) is not None:
                left.append(line)
        return left


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    lines: Lines  # the rest of its stderr
    log: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


SERVE = BLOCK_TRAINING_STACK + "from glance_runtime.cli.serve import main; sys.exit(main(sys.argv[1:]))"


GLANCE_RUN = [sys.executable, "-c", "import sys; from glance_runtime.cli.run import main; sys.exit(main(sys.argv[1:]))"]
KIND_WORDS = {"dir": "is a directory", "fifo": "is a named pipe (FIFO)", "loop": "is a symbolic link loop"}


def copy_with(source: Path, out: Path, name: str, kind: str) -> Path:
    """A copy of the directory `source` at `out` whose file `name` is replaced as `replace_with` does."""
    shutil.copytree(source, out)
    replace_with(out / name, kind)
    return out


def replace_with(path: Path, kind: str) -> None:
    """The file at `path` (if any) replaced by a directory, a FIFO or a symbolic link loop (a `KIND_WORDS` key):
    what a reader must name as such, and never open and wait on."""
    path.unlink(missing_ok=True)
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(path.name)


def one_line_refusal(run: subprocess.CompletedProcess, words: str) -> str:
    """A child that failed with exactly one stderr line holding `words` and no traceback; returns the line."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert len(lines) == 1 and words in lines[0], run.stderr
    return lines[0]


def export_refusal(capsys, argv: list) -> str:
    """glance-export ARGV exits 2 with exactly one stderr line and no traceback (argparse's refusals exit through
    SystemExit); returns the line."""
    from glance_export.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


def within(seconds: float, call: Callable[[], object]) -> object:
    """`call`'s result, run on a daemon thread: a call that blocks (a FIFO opened, a batch thread gone) fails the test
    instead of hanging it; what it raises is raised here."""
    failure: list[BaseException] = []
    result: list[object] = []

    def target() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failure.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"the call still runs after {seconds} s"
    if failure:
        raise failure[0]
    return result[0]


def start_server(*args: str, timeout_s: float = START_TIMEOUT_S,
                 on_listening: Callable[[str], None] | None = None, ignore_sigint: bool = False) -> Server:
    """`glance-serve --port 0 ARGS` as an edge install runs it (no torch, transformers or glance_export),
    returned once it prints that it is ready. `ignore_sigint`: started as a shell's background job is (SIGINT
    ignored from the start)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "--port", "0", "--threads", "1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=preexec)
    log: list[str] = []
    lines = Lines(proc.stderr)
    deadline = time.monotonic() + timeout_s
    while (line := lines.next(deadline - time.monotonic())) is not None:
        log.append(line)
        if on_listening and (match := LISTENING.search(line)):
            on_listening(match.group(1))
        if match := READY.search(line):
            return Server(proc, match.group(1), lines, log)
    proc.kill()
    proc.wait(timeout=30)
    raise AssertionError("glance-serve did not become ready:\n" + "\n".join(log))


def wait_until_ok(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Poll `url` until it answers 200 (True), or until `proc` exits or `timeout_s` passes (False)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    return False


def data_url(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"


def user(text: str, image_url: str | None = None) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": image_url}}] if image_url else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def glance_run(prompt: str, image: Path | None = None, max_new_tokens: int | None = None, *flags: str) -> dict:
    """`glance-run --json` in this process (same defaults, same cache), with any further `flags`."""
    argv = ["--prompt", prompt, "--json", "--threads", "1", *flags]
    argv += ["--image", str(image)] if image else []
    argv += ["--max-new-tokens", str(max_new_tokens)] if max_new_tokens else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert run_main(argv) == 0
    return json.loads(out.getvalue())


# ---- Auto policies for parity ----
# `--budget auto` policies that force what parity under auto must cover, on any backend and model.
#
# A measured profile and the shipped calibration would mostly draft and keep whole trees on these tiny
# models, leaving skipped drafts and small cuts unexercised. These policies make both happen on purpose,
# splitting rounds at the model's own median anchor surprisal, on the scale of that median (so about half
# the rounds fall on each side, whatever the family, and whether the model is unsure or nearly certain):
# - `skipping`: a sharp law (p near 1 below the split, near 0 above) with a draft that costs as much as a
#   verify pass, so rounds above the split are plain greedy steps and rounds below draft a whole tree;
# - `cutting`: no law (every round drafts) on a device where each row costs a quarter of the first, with
#   node probabilities that fall as surprisal rises, so the cut ranges from every node down to none;
# - `shallow`: a draft whose cost grows with its depth (a head over short blocks) and a law that falls
#   gently across the split, so rounds draft at several depths short of the block, and some not at all.
# `check_mixed` fails a run that did not actually do what its policy was built to force.

GRID = tuple(row_grid(64))
SHARP = 12.0  # logistic slope per split of surprisal: p is 0.9 at 0.82 of the split and 0.1 at 1.18 of it


def _profile(verify_ms: list[float], draft_ms: float) -> CostProfile:
    return CostProfile(device="constructed for the parity tests", rows=GRID, verify_ms=tuple(verify_ms),
                       draft_ms=draft_ms, repeats=1, measured_at="2026-01-01T00:00:00")


FLAT = _profile([1.0 + 0.001 * r for r in GRID], draft_ms=1.0)  # a GPU-like verify, a draft as dear as a verify
STEEP = _profile([0.75 + 0.25 * r for r in GRID], draft_ms=0.5)  # a CPU-like verify: a quarter of a row per row


def median_surprisal(backend, prompt, max_new_tokens: int) -> float:
    """The median anchor surprisal of a plain greedy decode: where the policies split rounds."""
    rounds = decode(backend, prompt, DecodeConfig(max_new_tokens=max_new_tokens, speculative=False)).rounds
    split = float(np.median([r.surprisal for r in rounds if r.surprisal is not None]))
    assert split > 0, "half the anchors are certain: nothing to split rounds at"
    return split


def skipping(split: float, block_size: int, cost: CostProfile = FLAT, max_nodes: int = 63) -> AutoBudget:
    """Skips the draft above the split, drafts (and keeps most of the tree) below it."""
    return AutoBudget(cost, Calibration(law=(SHARP, SHARP / split)), max_nodes, block_size)


def cutting(split: float, block_size: int, max_nodes: int = 63) -> AutoBudget:
    """Always drafts; keeps many nodes well below the split, none well above it."""
    return AutoBudget(STEEP, Calibration(a=8.0, b=1.0, c=-8.0 / split), max_nodes, block_size)


def shallow(split: float, block_size: int, max_nodes: int = 63) -> AutoBudget:
    """Drafts deeper the surer the anchor: a draft costing its depth's share of twice a verify row."""
    full = block_size - 1
    depths = row_grid(full)
    cost = replace(STEEP, draft_ms=2.0, draft_depths=tuple(depths), draft_share=tuple(d / full for d in depths))
    return AutoBudget(cost, Calibration(a=8.0, b=1.0, c=-8.0 / split, law=(5.0, 5.0 / split)), max_nodes, block_size)


def config(policy: AutoBudget, max_new_tokens: int, branch_k: int = 8) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=max_new_tokens, budget=policy.max_nodes, branch_k=branch_k, auto=policy)


def check_mixed(result: DecodeResult, policy: str, seeded: bool) -> None:
    """The run did what its policy forces: skipped and drafted rounds (`skipping`), cuts of several sizes
    (`cutting`; with the random head, some of none), or drafts of several depths (`shallow`). With seeded
    drafts, which accept several tokens a round and so visit fewer anchors, every round that verified a node
    must have accepted past the anchor."""
    rounds = result.rounds[:-1]  # the last round may be cut short by max_new_tokens
    drafted = [r for r in rounds if r.drafted]
    assert all(r.tree_size == 1 and r.accepted == 1 for r in rounds if not r.drafted)
    if policy == "skipping":
        assert len(drafted) < len(rounds), "no round skipped the draft"
        assert any(r.drafted for r in rounds[1:]), "no round after the first drafted"
    elif policy == "shallow":  # seeded drafts accept so much that few anchors are visited: fewer depths
        depths = {r.draft_depth for r in drafted[1:]}
        assert len(depths) >= (1 if seeded else 2), f"drafts of {sorted(depths)} deep only"
    else:
        assert len(drafted) == len(rounds), "a round without a law skipped the draft"
        sizes = {r.tree_size for r in drafted}
        forced = len(sizes) >= 2 if seeded else (1 in sizes and len(sizes) >= 3)
        assert forced, f"cuts of {sorted(sizes)} rows only"
    if seeded:
        assert all(r.accepted >= 2 for r in drafted if r.tree_size > 1), [(r.tree_size, r.accepted) for r in rounds]
        assert max(r.accepted for r in rounds) > 2


# ---- Exported tiny models ----
# The real exporter run on the tiny snapshots, shared by every test that needs graphs: one export per family
# and variant per test session, so the ONNX, build and runtime tests do not each export again.

_EXPORTS: dict[tuple[str, str, int], tuple[Path, Path, Path]] = {}
ORACLE_TOKENS = 24  # how long the oracle's greedy answers are in `Exported`
SEEDS = {"full": lambda d: 0, "partial": lambda d: 0 if d <= 2 else None, "zero": lambda d: None}  # SeededDrafter's


def tiny_head(snapshot: Path, out: Path, block_size: int = 6, draft_vocab: int | None = None) -> Path:
    """A random two-layer head for `snapshot`, saved at `out`; `draft_vocab`: drafting over that many target ids,
    spread evenly over the vocabulary."""
    from dataclasses import replace

    import torch

    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head

    snap = Snapshot(snapshot)
    cfg = replace(head_config_for(snap, 2, block_size, pick_mask_token(snap)), draft_vocab_size=draft_vocab)
    head = init_head(cfg, seed=3)
    if draft_vocab:
        head.draft_vocab_ids.copy_(torch.linspace(0, cfg.vocab_size - 1, draft_vocab).long())
    return save_head(head, out)


def export_once(snapshot_dir, tmp_path_factory, family: str, variant: str = "fp32",
                block_size: int = 6) -> tuple[Path, Path, Path]:
    """(model dir, head dir, artifacts dir) of one export per family and variant per test session.

    Variants: fp32 and fp16 (opset 17, max_tree 32, max_context 256), and external (fp32 with every
    weight forced into external data)."""
    from glance_export.onnx import export as export_mod
    from glance_export.onnx import export_artifacts

    if (family, variant, block_size) not in _EXPORTS:
        root = tmp_path_factory.mktemp(f"onnx_{family}_{variant}")
        head = tiny_head(snapshot_dir(family), root / f"head_{family}", block_size)
        limit = export_mod.EXTERNAL_DATA_BYTES
        export_mod.EXTERNAL_DATA_BYTES = 0 if variant == "external" else limit
        try:
            out = export_artifacts(snapshot_dir(family), head, root / "artifacts", max_tree=32, max_context=256,
                                   dtype="fp16" if variant == "fp16" else "fp32", progress=lambda _: None)
        finally:
            export_mod.EXTERNAL_DATA_BYTES = limit
        _EXPORTS[family, variant, block_size] = (Path(snapshot_dir(family)), head, out)
    return _EXPORTS[family, variant, block_size]


class Exported:
    """One family's snapshot, its torch model (for the oracle) and its ONNX artifacts on ONNX Runtime."""

    def __init__(self, root: Path, snapshot_path: Path, block_size: int, dtype: str = "fp32", opset: int = 17):
        from glance_export.model.adapters import Snapshot
        from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
        from glance_export.onnx import export_artifacts
        from glance_runtime.backends.ort_backend import OrtBackend
        from glance_runtime.prompt.codec import exported_codec

        self.snapshot = Snapshot(snapshot_path)
        self.model = self.snapshot.load_model()
        head = init_head(head_config_for(self.snapshot, 1, block_size, pick_mask_token(self.snapshot)),
                         seed=block_size)
        head_dir = save_head(head, root / "head")
        self.artifacts = export_artifacts(snapshot_path, head_dir, root / "artifacts", dtype=dtype, opset=opset,
                                          max_tree=64, max_context=512, progress=lambda _: None)
        self.backend = OrtBackend(self.artifacts)
        self.codec = exported_codec(self.backend.manifest)
        self._truth: dict[tuple[bytes, tuple[int, ...]], list[int]] = {}

    def prompt(self, image: Path | None, text: str = "What colour is the square?"):
        return self.codec.turn(text, image)

    def oracle(self, prompt, stops=()) -> list[int]:
        from glance_export.model.torch_backend import greedy_reference

        key = (prompt.input_ids.tobytes(), tuple(stops))
        if key not in self._truth:
            self._truth[key] = greedy_reference(self.model, self.snapshot, prompt, ORACLE_TOKENS, stops)
        return self._truth[key]


def runtime_prompt_builder(snap):
    """A torch-free builder over the files an export ships. tokenizer.json is the tokenizer as transformers loads
    it: for some model types (qwen2) transformers replaces the file's pre-tokenizer, so exports must save the
    effective one rather than copy the snapshot's file."""
    import shutil

    from glance_runtime.prompt.prompt_builder import PromptBuilder

    out = snap.path / "runtime_files"
    if not out.is_dir():
        out.mkdir()
        for name in ("chat_template.jinja", "tokenizer_config.json", "preprocessor_config.json",
                     "generation_config.json"):
            if (snap.path / name).is_file():
                shutil.copy(snap.path / name, out / name)
        snap.tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    return PromptBuilder(out, snap.image_token_id if snap.is_vl else None)


def converse(backend, build, detokenize, oracle, turns, seed: str, image_token_id, merge: int,
             max_new_tokens: int = 16) -> list[int]:
    """Decode each turn after the rows the previous ones committed, with drafts seeded by `seed` (SEEDS);
    returns the rows kept per turn."""
    from glance_runtime.backends.seeded import SeededDrafter
    from glance_runtime.prompt.prefix_reuse import Committed, image_runs, shared_rows

    messages, committed, kept = [], None, []
    for turn in turns:
        messages.append(turn)
        prompt = build(messages)
        keep = shared_rows(committed, prompt, image_token_id, merge)
        truth = oracle(prompt)
        result = decode(SeededDrafter(backend, truth, prompt.length, SEEDS[seed]),
                        prompt, DecodeConfig(max_new_tokens=max_new_tokens, budget=31, branch_k=8), keep=keep)
        assert result.tokens == truth[:max_new_tokens], (len(messages), keep)
        if seed != "zero":
            assert any(r.accepted > 1 for r in result.rounds)
        tokens = np.concatenate([prompt.input_ids, np.asarray(result.tokens, np.int64)])[:backend.start]
        committed = Committed(tokens, tuple(image_runs(prompt, image_token_id, merge)))
        messages.append({"role": "assistant", "content": detokenize(result.tokens)})
        kept.append(keep)
    return kept


# ---- Outputs a command did not make ----
# The one check every command's output path goes through: whatever already lies at the output (a user's
# file or folder, a model's config.json, another command's output), a command that did not make it refuses
# in one line and leaves every byte around the output as it was.

OUTPUT_MARKER = ".glance-output.json"
DEAD_PID = 2 ** 22 + 1  # above Linux's largest process id: never a live process


def _user_file(path: Path) -> None:
    path.write_text("someone's notes\n")


def _config_json(path: Path) -> None:
    path.write_text(json.dumps({"model_type": "qwen2_5_vl", "hidden_size": 64}) + "\n")


def _other_format_file(path: Path) -> None:
    path.write_text(json.dumps({"format": "glance-some-other-format", "format_version": 1}) + "\n")


def _user_dir(path: Path) -> None:
    path.mkdir()
    (path / "keep.txt").write_text("someone's folder\n")


def _other_format_dir(path: Path) -> None:
    path.mkdir()
    (path / "weights.bin").write_bytes(b"\0\1")
    (path / OUTPUT_MARKER).write_text(json.dumps({"format": "glance-some-other-format", "made_by": "elsewhere"}))


def _binary_file(path: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")


VICTIMS: dict[str, Callable[[Path], None]] = {
    "user-file": _user_file, "config-json": _config_json, "other-format-file": _other_format_file,
    "binary-file": _binary_file, "user-dir": _user_dir, "other-format-dir": _other_format_dir}


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`, hidden ones included: file bytes, a link's target, or "dir"."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            found[key] = f"link {os.readlink(path)}" if path.is_symlink() else \
                "dir" if path.is_dir() else path.read_bytes()
    return found


def lookalikes(out: Path) -> None:
    """Hidden siblings a user may own whose names look like a command's temporary names."""
    for name in (f".{out.name}.new.{DEAD_PID}.abc", f".{out.name}.old.{DEAD_PID}.abc", f".{out.name}.glance-{'0' * 32}.new",
                 f".{out.name}.glance-{'0' * 32}.old"):
        (out.parent / name).mkdir()
        (out.parent / name / "mine.txt").write_text("a user's file\n")
    (out.parent / f".{out.name}.glance-{'1' * 32}.json").write_text("not a journal\n")


def assert_kept(run: Callable[[Path], tuple[int, str]], root: Path, victims: tuple[str, ...] = tuple(VICTIMS),
                name: str = "out") -> None:
    """For each victim planted at `root/<victim>/<name>`: `run(out)` (exit code, stderr) refuses in one
    line that names the output, and nothing under that folder changes."""
    for victim in victims:
        out = root / victim / name
        out.parent.mkdir(parents=True)
        VICTIMS[victim](out)
        lookalikes(out)
        before = tree(out.parent)
        rc, err = run(out)
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc != 0, (victim, err)
        assert lines and "Traceback" not in err and str(out) in lines[-1], (victim, err)
        assert tree(out.parent) == before, victim


# ---- EAGLE-3 heads ----

def tiny_eagle3_head(snapshot: Path, out: Path, draft_vocab: int | None = None, own_embeddings: bool = False,
                     mrope: bool = False, layers: int = 1, seed: int = 5, std: float = 0.2) -> Path:
    """A random EAGLE-3 head for `snapshot`, written in the published layout at `out`. `draft_vocab`: drafting over
    that many target ids spread evenly over the vocabulary; `own_embeddings`: an `embed_tokens` of its own; `mrope`:
    rotating with the target's M-RoPE sections (a VL target's). `std` well above an untrained head's makes the
    drafts peaked, so the dynamic tree grows deep."""
    from dataclasses import replace

    import torch

    from glance_export.model.adapters import Snapshot
    from glance_export.model.eagle3 import eagle3_config_for, init_eagle3, save_eagle3

    snap = Snapshot(snapshot)
    cfg = eagle3_config_for(snap, draft_vocab, layers)
    if mrope:
        rope = snap.text_config.get("rope_parameters") or snap.text_config.get("rope_scaling") or {}
        cfg = replace(cfg, rope={**cfg.rope, "mrope_section": list(rope["mrope_section"])})
    ids = torch.linspace(0, cfg.vocab_size - 1, draft_vocab).long() if draft_vocab else None
    head = init_eagle3(cfg, seed, draft_ids=ids, own_embeddings=own_embeddings, std=std)
    return save_eagle3(head, out, made_by="tests")


def image_tasks(images: dict[str, Path], root: Path) -> Path:
    """A task file at root/tasks.jsonl asking "What is shown?" of the wide, tall and square test images."""
    path = root / "tasks.jsonl"
    path.write_text("".join(json.dumps({"image": str(images[name]), "prompt": "What is shown?"}) + "\n"
                            for name in ("wide", "tall", "square")))
    return path
