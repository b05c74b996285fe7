"""Train a GLANCE head (the DFlash recipe) or an EAGLE-3 head (its training-time test) for any supported target on
its own greedy generations.

Stage 1 answers every training prompt with the target (sequences.py); stage 2 takes optimizer steps, each one
padded forward and backward over a batch of sequences and their anchors (head_loss.py; an EAGLE-3 head over
every answer row, unrolled a few steps over its own guesses: eagle3_loss.py), the taps of each
sequence computed by the target as the step needs them (online) or read from data prepared once (prepared.py,
offline: then only the target's embedding and LM head are loaded). Under `torchrun` the processes split every
global batch (order.py) and average their gradients (world.py); only the first writes. Held-out acceptance
(held_out.py) and the run's metrics and card (train_log.py) are written beside the head.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from glance_runtime.defaults import BUDGET
from glance_runtime.errors import GlanceError

from ..model.adapters import Snapshot
from ..model.eagle3 import (Eagle3Head, check_eagle3_matches, eagle3_config_for, head_kind, init_eagle3, load_eagle3,
                            save_eagle3, set_draft_vocab)
from ..model.vocab_choice import check_size
from ..model.head import check_head_out, head_config_for, init_head, load_head, pick_mask_token, save_head
from .checkpoint import capture, load_state, restore, run_signature, writer
from .data_files import Tally, check_files, read_samples
from .draft_vocab import frequent_tokens
from .eagle3_loss import make_eagle3_batch, ttt_loss
from .head_loss import batch_loss, make_batch
from .held_out import HeldOut, measure
from .order import anchors_for, rank_slots, step_items
from .prepared import INDEX, PreparedData, token_layers
from .prepared_index import read_index
from .sequences import answer_samples, prompt_of
from .tap_source import OnlineTaps
from .train_log import Bar, RunLog, card, data_lines
from .world import World, join, leave

MADE_BY = "glance-export train-head"
EVAL_BUDGET = 15  # held-out tau is always reported at this tree budget, beside --eval-budget
EAGLE3_DRAFT_VOCAB = 32000  # EAGLE-3 heads draft over this many frequent tokens unless told (the published heads')
ARCHS = ("glance", "eagle3")
EAGLE3_ONLY = ("ttt_steps", "ttt_decay")


@dataclass(frozen=True)
class HeadTraining:
    """A training run's settings. `batch` is per process: N processes train on N * batch sequences a step."""
    layers: int = 1
    block_size: int = 16
    steps: int = 2000
    lr: float = 3e-3
    batch: int = 8
    anchors: int = 16
    gamma: float = 7.0
    max_new_tokens: int = 64
    seed: int = 0
    gen_batch: int = 16
    device: str = "cpu"
    time_budget_s: float | None = None
    checkpoint_every: int = 500
    resume: Path | None = None
    log_every: int = 50
    eval_data: Path | None = None
    eval_every: int = 0  # 0: only at the end (with eval_data)
    eval_budget: int = BUDGET
    draft_vocab: int | None = None  # draft over the N tokens most frequent in the target's answers
    arch: str = "glance"  # "eagle3": an EAGLE-3 head trained by its training-time test
    ttt_steps: int = 7  # EAGLE-3: steps the head is unrolled over its own guesses
    ttt_decay: float = 0.8  # EAGLE-3: step j's loss is weighted ttt_decay ** j

    def identity(self, world: int) -> dict:
        """What makes two runs the same run: everything but where and how long it runs, and how the global
        batch is split, so a run resumes on another device or number of processes."""
        out = asdict(self)
        for key in ("gen_batch", "device", "time_budget_s", "checkpoint_every", "log_every", "eval_data", "eval_every",
                    "eval_budget"):
            out.pop(key)
        if self.arch == "glance":  # a GLANCE run's identity is what it was before EAGLE-3 heads could be trained
            for key in ("arch", *EAGLE3_ONLY):
                out.pop(key)
        else:
            for key in ("block_size", "anchors", "gamma"):
                out.pop(key)
        out["batch"] = self.batch * world
        return out


def _schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first 5% of steps, then cosine decay to zero."""
    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def _precision(device: torch.device):
    """bf16 autocast on CUDA (the head's master weights stay fp32); plain fp32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_head(model_dir: str | Path, data: list[Path], out_dir: str | Path, settings: HeadTraining = HeadTraining(),
               progress: Callable[[str], None] = print, prepared: Path | None = None) -> Path:
    """Train (or continue) a head; returns the saved head directory.

    Every `checkpoint_every` steps the head and the trainer state are written to `out_dir` together;
    the same command run again after an interruption (under any number of processes) continues from
    there. The finished head holds no trainer state (a run stopped by its time budget keeps it)."""
    s = settings
    if s.checkpoint_every < 1:
        raise GlanceError(f"--checkpoint-every must be at least 1, got {s.checkpoint_every}; pass a positive step count")
    if bool(data) == (prepared is not None):
        raise GlanceError("pass either --data (online: the target answers and taps as training goes) or --prepared "
                          "DIR (from `glance-export prepare-head-data`)")
    check_files([Path(d) for d in data], "training data")
    if s.eval_data is not None:
        check_files([Path(s.eval_data)], "--eval-data")
    if s.arch not in ARCHS:
        raise GlanceError(f"--arch {s.arch!r}: pass one of {', '.join(ARCHS)}")
    if prepared is not None:
        read_index(Path(prepared))  # a missing path or a file is named as such before the run's signature reads it
    if s.resume is not None and not Path(s.resume).is_dir():
        found = "is not a directory" if Path(s.resume).exists() else "does not exist"
        raise GlanceError(f"--resume {s.resume} {found}; pass a head directory written by `glance-export init-head` "
                          "or `train-head`, or drop --resume to start a new head")
    if s.resume is not None and head_kind(s.resume) != s.arch:
        raise GlanceError(f"--resume {s.resume} is a {head_kind(s.resume)} head but --arch is {s.arch}; resume a "
                          "head of the same kind, or start a new one")
    check_head_out(out_dir, (model_dir, *data, prepared, s.resume, s.eval_data))
    world = join(s.device)
    try:
        return _train(Snapshot(model_dir), [Path(d) for d in data], prepared, Path(out_dir), s, world,
                      progress if world.main else (lambda line: None))
    except torch.OutOfMemoryError:
        raise GlanceError(f"out of memory on {world.device} at {s.batch} sequences x {s.anchors} anchors a step; "
                          "lower --batch (or --anchors)") from None
    finally:
        leave()


def _frozen_target(snapshot: Snapshot, device: torch.device):
    """The target in bf16 on CUDA, fp32 on the CPU, without gradients."""
    model = snapshot.load_model("bfloat16" if device.type == "cuda" else "float32").to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _online(snapshot: Snapshot, data: list[Path], s: HeadTraining, layer_ids: list[int], world: World,
            progress: Callable[[str], None]):
    """Stage 1 of an online run: the target's answers; then the target taps each sequence when a step needs it."""
    model = _frozen_target(snapshot, world.device)
    progress(f"stage 1/2: target answers and taps of layers {layer_ids}")
    tally = Tally()
    samples = read_samples(data, tally)
    if not samples and not tally.bad:
        raise GlanceError(f"the training data {', '.join(map(str, data))} has no tasks; write rows of prompts "
                          "(TASKS.jsonl, LLaVA or OpenAI messages)")
    seqs, ids = answer_samples(snapshot, model, samples, s.max_new_tokens, s.gen_batch, world, tally, progress)
    progress(tally.summary())
    tally.check()
    source = OnlineTaps(snapshot, model, samples, ids, layer_ids)
    return model, seqs, source, model.get_input_embeddings(), model.get_output_embeddings()


def _offline(snapshot: Snapshot, prepared: Path, layer_ids: list[int], world: World, progress: Callable[[str], None],
             arch: str = "glance"):
    """Prepared sequences, read per step; of the target only its embedding and LM head."""
    source = PreparedData.open(prepared, snapshot, progress)
    if source.index["target_layer_ids"] != layer_ids:
        fix = ("prepare it again with `prepare-head-data --arch eagle3`" if arch == "eagle3" else
               "pass the --layers it was prepared with, or prepare again (without --arch eagle3)")
        raise GlanceError(f"{prepared} holds taps of layers {source.index['target_layer_ids']} but the {arch} head "
                          f"reads {layer_ids}; {fix}")
    progress(f"stage 1/2: {len(source.sequences)} prepared sequences in {prepared}")
    embed, lm_head = token_layers(snapshot, world.device)
    return source.sequences, source, embed, lm_head


def _held_out(snapshot: Snapshot, model, s: HeadTraining) -> HeldOut | None:
    """The held-out prompts (every row of --eval-data must be usable: they are few and chosen)."""
    if s.eval_data is None:
        return None
    tally = Tally()
    samples = read_samples([s.eval_data], tally, "--eval-data")
    if tally.bad or not samples:
        raise GlanceError(f"--eval-data {s.eval_data}: {tally.summary() if tally.bad else 'no rows'}; held-out "
                          "prompts must all be usable")
    return HeldOut([prompt_of(snapshot, x) for x in samples], tuple(sorted({EVAL_BUDGET, s.eval_budget})),
                   s.max_new_tokens)


def _train(snapshot: Snapshot, data: list[Path], prepared: Path | None, out_dir: Path, s: HeadTraining, world: World,
           progress: Callable[[str], None]) -> Path:
    torch.manual_seed(s.seed)
    signature = run_signature(snapshot.path, data or [Path(prepared) / INDEX], **s.identity(world.size))
    state = load_state(out_dir, signature)
    eagle3 = s.arch == "eagle3"
    draft_vocab = s.draft_vocab
    if eagle3 and draft_vocab is None:
        draft_vocab = min(EAGLE3_DRAFT_VOCAB, snapshot.text_config["vocab_size"])
    if state is not None:
        head = load_eagle3(out_dir) if eagle3 else load_head(out_dir)
    elif s.resume is not None:
        head = load_eagle3(s.resume) if eagle3 else load_head(s.resume)
    elif eagle3:
        check_size(draft_vocab, snapshot.text_config["vocab_size"])
        head = init_eagle3(eagle3_config_for(snapshot, draft_vocab, s.layers), s.seed)
    else:
        cfg = head_config_for(snapshot, s.layers, s.block_size, pick_mask_token(snapshot))
        check_size(s.draft_vocab, cfg.vocab_size)
        head = init_head(replace(cfg, draft_vocab_size=s.draft_vocab), s.seed)
    if head.config.draft_vocab_size != draft_vocab:
        raise GlanceError(f"the head to continue drafts over {head.config.draft_vocab_size or 'the whole'} vocabulary "
                          f"but --draft-vocab is {draft_vocab}; pass the same --draft-vocab, or start a new head")
    if eagle3:
        _check_eagle3_trainable(head, snapshot)
    head = head.to(world.device).train()
    cfg = head.config
    layer_ids = cfg.taps(snapshot.text_config["num_hidden_layers"]) if eagle3 else cfg.target_layer_ids
    model = None
    if prepared is None:
        model, seqs, source, embed, lm_head = _online(snapshot, data, s, layer_ids, world, progress)
    else:
        seqs, source, embed, lm_head = _offline(snapshot, prepared, layer_ids, world, progress, s.arch)
    seqs = [q for q in seqs if q.length - q.answer_start >= 2]
    if not seqs:
        raise GlanceError("the target produced no answer longer than one token; nothing to train on")
    if draft_vocab and state is None and s.resume is None:
        frequent = frequent_tokens([source.ids_of(q)[q.answer_start:] for q in seqs], draft_vocab, cfg.vocab_size)
        if eagle3:
            set_draft_vocab(head, frequent)
        else:
            head.draft_vocab_ids.copy_(frequent)
        progress(f"drafting over the {draft_vocab} tokens most frequent in the target's answers")
    held_out = _held_out(snapshot, model, s) if world.main else None
    if held_out is not None and model is None:  # offline: the draft/verify loop needs the whole target
        model = _frozen_target(snapshot, world.device)
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    sched = _schedule(opt, s.steps)
    done = 0
    if state is not None:
        done = restore(state, opt, sched)
        progress(f"resuming from the checkpoint in {out_dir} at step {done}")
    saved = done if state is not None else None  # the step of the checkpoint in out_dir, if it holds one
    log = RunLog(out_dir, done)
    data_names = data_lines(data) if data else [f"prepared `{Path(prepared).name}`"]

    def save(extra: Callable[[Path], None] | None) -> None:
        settings = {k: v for k, v in s.identity(world.size).items() if k != "resume"}
        files = log.files(card(snapshot.path, data_names, done, s.steps, settings, len(seqs), log.last_eval(),
                               s.eval_data, "EAGLE-3" if eagle3 else "GLANCE"))
        save = save_eagle3 if eagle3 else save_head
        save(head.eval(), out_dir, made_by=MADE_BY, also=lambda d: (files(d), extra and extra(d)))
        head.train()

    global_batch = s.batch * world.size
    progress(f"stage 2/2: {s.steps} steps on {len(seqs)} sequences, {global_batch} a step"
             + (f" over {world.size} processes" if world.size > 1 else "")
             + (f", unrolled {s.ttt_steps} steps" if eagle3 else f", block {cfg.block_size}"))
    bar = Bar(s.steps, done, world.main)
    t0 = t_log = time.time()
    logged = done
    for step in range(done + 1, s.steps + 1):
        items = step_items(s.seed, step, global_batch, len(seqs))
        slots = rank_slots(global_batch, world.rank, world.size)
        chosen = [seqs[items[j]] for j in slots]
        loaded = [source(q) for q in chosen]
        opt.zero_grad()
        if eagle3:
            batch = make_eagle3_batch([ids for ids, _ in loaded], [taps for _, taps in loaded],
                                      [q.answer_start for q in chosen])
            with _precision(world.device):
                stats = ttt_loss(head, embed, batch, s.ttt_steps, s.ttt_decay)
        else:
            picks = [anchors_for(s.seed, step, j, q.answer_start, q.length - 2, s.anchors)
                     for j, q in zip(slots, chosen)]
            batch = make_batch([ids for ids, _ in loaded], [taps for _, taps in loaded], picks)
            with _precision(world.device):
                stats = batch_loss(head, embed, lm_head, batch, s.gamma)
        stats.loss.backward()
        world.average_gradients(params)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if world.any(not bool(torch.isfinite(stats.loss.detach()) & torch.isfinite(norm))):
            raise _diverged(step, stats.loss.item(), norm.item(), out_dir, saved)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        done = step
        bar.update(step)
        evaluate = held_out is not None and (step == s.steps or (s.eval_every and step % s.eval_every == 0))
        if step % s.log_every == 0 or step == s.steps or evaluate:
            totals = world.total(torch.cat([stats.loss.detach()[None] / world.size, stats.hits.float(),
                                            stats.counts.float()]))
            scored = len(stats.hits)  # offsets 1..B-1 of a block, or the steps of an EAGLE-3 unroll
            loss, hits, counts = totals[0].item(), totals[1:1 + scored], totals[1 + scored:]
            record = {"step": step, "loss": round(loss, 5),
                      "accuracy": [round(h / c, 4) if c else None for h, c in zip(hits.tolist(), counts.tolist())],
                      "lr": lr, "samples_per_s": round(global_batch * (step - logged) / (time.time() - t_log), 3)}
            if evaluate:
                with torch.no_grad():
                    record["held_out"] = measure(snapshot, model, head, held_out)
            t_log, logged = time.time(), step
            log.add(record)
            progress(f"step {step}/{s.steps} loss {loss:.4f} {'step-0' if eagle3 else 'offset-1'} acc "
                     f"{record['accuracy'][0] or 0:.3f} "
                     f"{record['samples_per_s']:.1f} samples/s, ETA {bar.eta(step, s.steps)}"
                     + (f"; held-out tau {record['held_out']['tau']}" if evaluate else ""))
        if step % s.checkpoint_every == 0 and step < s.steps:
            if world.main:
                save(writer(capture(signature, step, opt, sched)))
            world.barrier()
            saved = step
            progress(f"checkpoint at step {step}")
        if world.any(s.time_budget_s is not None and time.time() - t0 > s.time_budget_s):
            progress(f"time budget reached after {step} steps")
            break
    bar.close()
    if world.main:
        save(writer(capture(signature, done, opt, sched)) if done < s.steps else None)
    world.barrier()
    progress(f"saved head to {out_dir} after {done} steps")
    return out_dir


def _diverged(step: int, loss: float, norm: float, out_dir: Path, saved: int | None) -> GlanceError:
    """A non-finite loss or gradient would turn every weight into NaN at the optimizer step: the run stops before
    it, and the head already on disk (the last checkpoint, if any) is what remains."""
    kept = f"{out_dir} keeps its checkpoint of step {saved}" if saved is not None else f"nothing was saved to {out_dir}"
    return GlanceError(f"the loss or its gradient at step {step} is not finite (loss {loss:g}, gradient norm "
                       f"{norm:g}); training stopped and {kept}; lower --lr (or check the training data) and run "
                       "again")


def _check_eagle3_trainable(head: Eagle3Head, snapshot: Snapshot) -> None:
    """The head must fit the target, and train with the plain stream positions the trainer gives it."""
    check_eagle3_matches(head, snapshot)
    if head.config.mrope_section is not None:
        raise GlanceError("the EAGLE-3 head to continue rotates with M-RoPE sections (rope_scaling.mrope_section), "
                          "which train-head does not train; start a new head (it uses plain stream positions)")
