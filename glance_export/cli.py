"""`glance-export`: make heads, audit losslessness, export and build. Each command calls one library function."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from glance_runtime.cli import flags
from glance_runtime.cli.flags import OneLineParser, decode_flags, guarded, runner_flags, source
from glance_runtime.defaults import BRANCH_K, BUDGET, EAGLE3_DEPTH, MEASURE_MAX_NEW_TOKENS, default_model, resolve
from glance_runtime.errors import GlanceError
from glance_runtime.formats.common import MAX_BATCH as BATCH_BOUND
from glance_runtime.backends.registry import BACKENDS
from glance_runtime.backends.registry import open_session
from glance_runtime.decode.session import Settings

from .build.targets import PROFILE_NAMES
from .onnx.batching import MAX_BATCH
from .onnx.quant_scheme import ACCURACY, ACCURACY_LEVELS, GROUP_SIZES
from .model.vocab_choice import ALL as VOCAB_ALL, AUTO as VOCAB_AUTO, DEFAULT_SIZE, LARGE_VOCAB

# Upper bounds of sizes that would otherwise run until stopped or exhaust the machine.
HEAD_LAYERS = flags.between("--layers", 1, 64, "a draft head has a few layers; 64 is deeper than any target")
BLOCK_SIZE = flags.between("--block-size", 2, 64, "the anchor plus up to 63 drafted offsets")
STEPS = flags.between("--steps", 1, 10_000_000, "optimizer steps")
BATCH = flags.between("--batch", 1, 4096, "sequences held in memory at once")
GEN_BATCH = flags.between("--gen-batch", 1, 4096, "prompts the target answers at once")
DRAFT_VOCAB = flags.at_least("--draft-vocab", BRANCH_K)  # a draft offset branches into BRANCH_K tokens
SEED = flags.between("--seed", 0, 2**32 - 1, "the seeds torch and numpy accept")
ANSWER_TOKENS = flags.at_least("--max-new-tokens", 1)
BATCHED = flags.between("--max-batch", 1, BATCH_BOUND, "the most a manifest's readers accept")
MAX_TASKS = 1_000_000
from .build.precision import PRECISIONS


def _export_draft_vocab(text: str) -> int | str:
    """`glance-export onnx --draft-vocab`: auto, all, or a size."""
    if text in (VOCAB_AUTO, VOCAB_ALL):
        return text
    try:
        return DRAFT_VOCAB(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or auto, or all)") from None


class DefaultsShown(argparse.HelpFormatter):
    """--help ends each flag's text with its default, unless the text already says it or the flag has none (an
    unset flag's text says what applies instead)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default is None or default is False or default == [] \
                or default is argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class ExportParser(OneLineParser):
    """glance-export and each subcommand (argparse makes the subcommands' parsers of this class too)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)


def _progress(line: str) -> None:
    print(line, file=sys.stderr)


def _init_head(args: argparse.Namespace) -> int:
    from .model.adapters import Snapshot
    from .model.head import check_head_out, head_config_for, init_head, pick_mask_token, save_head

    if args.arch == "eagle3":
        return _init_eagle3(args)
    if args.draft_vocab is not None:
        raise GlanceError("--draft-vocab is for --arch eagle3 heads; drop it or pass --arch eagle3")
    check_head_out(args.out, [args.model])
    snapshot = Snapshot(args.model)
    block_size = args.block_size if args.block_size is not None else 16
    if args.layers < 1 or block_size < 2:
        raise GlanceError("--layers must be >= 1 and --block-size >= 2")
    mask = args.mask_token_id if args.mask_token_id is not None else pick_mask_token(snapshot)
    if not 0 <= mask < snapshot.text_config["vocab_size"]:
        raise GlanceError(f"--mask-token-id {mask} is outside the target's vocabulary; pass an id below "
                          f"{snapshot.text_config['vocab_size']}")
    cfg = head_config_for(snapshot, args.layers, block_size, mask)
    out = save_head(init_head(cfg, args.seed), args.out)
    print(f"wrote untrained head to {out} (layers {cfg.num_hidden_layers}, block {cfg.block_size}, "
          f"taps {cfg.target_layer_ids}, mask token {mask})")
    return 0


def _init_eagle3(args: argparse.Namespace) -> int:
    """An untrained EAGLE-3 head in the published layout; its draft vocabulary (--draft-vocab N) is the target's
    first N ids, since an untrained head has no token counts to choose the frequent ones by."""
    from .model.adapters import Snapshot
    from .model.eagle3 import check_eagle3_out, eagle3_config_for, init_eagle3, save_eagle3

    for flag, value in (("--block-size", args.block_size), ("--mask-token-id", args.mask_token_id)):
        if value is not None:
            raise GlanceError(f"{flag} is for GLANCE heads; an EAGLE-3 head drafts one token per pass with no mask "
                              f"token: drop {flag} or pass --arch glance")
    check_eagle3_out(args.out, [args.model])
    snapshot = Snapshot(args.model)
    vocab = snapshot.text_config["vocab_size"]
    if args.draft_vocab is not None and args.draft_vocab > vocab:
        raise GlanceError(f"--draft-vocab {args.draft_vocab} exceeds the target's vocabulary of {vocab}; pass at "
                          f"most {vocab}")
    drafted = None if args.draft_vocab in (None, vocab) else args.draft_vocab
    cfg = eagle3_config_for(snapshot, drafted, args.layers)
    out = save_eagle3(init_eagle3(cfg, args.seed), args.out)
    print(f"wrote untrained EAGLE-3 head to {out} (layers {cfg.num_hidden_layers}, taps {cfg.aux_layer_ids}, "
          f"draft vocabulary {cfg.drafted_vocab})")
    return 0


def _audit_settings(args: argparse.Namespace, max_new_tokens: int) -> Settings:
    return Settings(budget=args.budget, max_new_tokens=max_new_tokens, branch_k=args.branch_k)


def _audit_oracle(args: argparse.Namespace) -> int:
    """The default mode: GLANCE against the torch greedy oracle (or, without a model, the backend's own greedy)."""
    from glance_runtime.formats.tasks import read as read_tasks

    from .audit.greedy_audit import audit

    model, head, artifacts, backend = resolve(args.model, args.head, args.artifacts, args.backend or "torch")
    if backend == "torch" and head is None:
        raise GlanceError("the torch audit needs --head")
    _threads(args.threads)
    tasks = read_tasks(args.data)
    max_new = MEASURE_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    session = open_session(source(args, backend, model=model, head=head, artifacts=artifacts),
                           _audit_settings(args, max_new), _progress)
    sampling = flags.sampling_of(args)
    report = audit(session, tasks, progress=_progress, sampling=sampling)
    plain = "greedy" if sampling.greedy else f"plain sampling (temperature {sampling.temperature:g}, seed " \
        f"{sampling.seed} + task)"
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for d in report["divergences"]:
            print(f"parts from {plain} at token {d['token']} (top-2 margin {d['margin']}): {d['prompt']}")
        print(f"{report['identical']}/{report['n']} identical to {plain} (self-consistent {report['self_consistent']}/"
              f"{report['n']}), tau {report['tau']:.2f} over {report['rounds']} rounds: "
              f"{'PASS' if report['passed'] else 'FAIL'}"
              f"{' (int8 activations: gated as fp16 is)' if report['int8_activations'] else ''}")
        vocabulary = report["draft_vocab"]
        if vocabulary is not None and vocabulary["coverage"] is not None:
            print(f"the draft vocabulary ({vocabulary['size']:,} tokens) holds {100 * vocabulary['coverage']:.1f}% "
                  "of the greedy answers' tokens (a token outside it is never drafted)")
    return 0 if report["passed"] else 1


def _drift(args: argparse.Namespace) -> int:
    """How far quantized artifacts' greedy output is from the fp32 export's (the quality cost, apart from GLANCE)."""
    from .audit.drift import drift, drift_lines

    if args.backend not in (None, "onnxruntime") or args.artifacts is None:
        raise GlanceError("--drift-from compares two exports on onnxruntime: pass --artifacts QUANTIZED")
    max_new = MEASURE_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    report = drift(args.artifacts, args.drift_from, args.data, max_new, providers=args.provider)
    print(json.dumps(report, indent=2) if args.json else "\n".join(drift_lines(report)))
    return 0


def _save_reference(args: argparse.Namespace) -> int:
    """Workstation side: the fp32 PyTorch greedy tokens and margins of --data, written to a file."""
    from .audit.reference_match import check_destination, write_reference

    model = args.model or default_model()[0]
    inputs = [args.data, model, args.head, args.artifacts]
    check_destination(args.save_reference, inputs)  # first: an output it may not replace is refused as such
    try:
        from .audit.record_reference import record_reference
    except ImportError as exc:
        missing = exc.name or "torch"
        raise GlanceError(f"--save-reference runs the PyTorch model and needs the export extra ({missing} is "
                          "missing): record on a workstation with `pip install 'glance-toolkit[export]'`, "
                          "then audit here with --reference FILE") from None
    _threads(args.threads)
    max_new = MEASURE_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    ref = record_reference(model, args.data, max_new, progress=_progress)
    path = write_reference(args.save_reference, ref, inputs)
    margins = [m for task in ref.tasks for m in task.margins]
    print(f"wrote the fp32 greedy reference of {len(ref.tasks)} prompts ({len(margins)} tokens, smallest top-2 "
          f"margin {min(margins):.4g}) to {path}")
    return 0


def _audit_reference(args: argparse.Namespace) -> int:
    """Device side, no torch: the backend's GLANCE and own greedy output against a recorded reference."""
    from glance_runtime.formats.tasks import read as read_tasks

    from .audit.recorded_audit import audit_against_reference, summary
    from glance_runtime.formats.recorded_reference import read as load_reference

    from .audit.reference_match import check_reference, model_source

    ref = load_reference(args.reference)
    model, head, artifacts, backend = resolve(args.model, args.head, args.artifacts, args.backend)
    if backend == "torch" and (model is None or head is None):
        raise GlanceError("the torch audit needs --model and --head")
    tasks = read_tasks(args.data)
    max_new = ref.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    session = open_session(source(args, backend, model=model if backend == "torch" else None, head=head,
                                  artifacts=artifacts), _audit_settings(args, max_new), _progress)
    manifest = session.backend.info.manifest
    source_record, where = (manifest.source, str(manifest.path)) if manifest is not None \
        else (model_source(model), str(model))
    check_reference(ref, args.reference, source=source_record, where=where, tasks=tasks, tasks_path=args.data,
                    stop_ids=session.stop_ids, max_new_tokens=max_new)
    report = audit_against_reference(session, ref, args.reference, tasks, progress=_progress)
    print(json.dumps(report, indent=2) if args.json else "\n".join(summary(report)))
    return 0 if report["passed"] else 1


AUDIT_MODES = {"save_reference": _save_reference, "reference": _audit_reference, "drift_from": _drift}


def _audit(args: argparse.Namespace) -> int:
    """One of audit's four modes, picked by its flag (at most one: the parser refuses two)."""
    chosen = [flag for flag in AUDIT_MODES if vars(args)[flag] is not None]
    if chosen and args.temperature > 0:
        raise GlanceError(f"--temperature is for the default audit (GLANCE against plain sampling); --"
                          f"{chosen[0].replace('_', '-')} compares greedy tokens: drop one of them")
    return AUDIT_MODES[chosen[0]](args) if chosen else _audit_oracle(args)


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _mix(pairs: list[str] | None) -> dict[str, float] | None:
    from .train.corpus import KINDS

    if not pairs:
        return None
    mix = {}
    for pair in pairs:
        kind, _, weight = pair.partition("=")
        try:
            mix[kind] = float(weight)
        except ValueError:
            mix[kind] = -1.0
        if kind not in KINDS or mix[kind] < 0:
            raise GlanceError(f"--mix {pair!r} is not KIND=WEIGHT; pass pairs with KIND one of {', '.join(KINDS)} "
                              "and WEIGHT >= 0")
    if not sum(mix.values()):
        raise GlanceError("--mix: at least one weight must be positive")
    return mix


def _train_target(args: argparse.Namespace) -> int:
    from .train.target import train_target

    mix = _mix(args.mix)
    _threads(args.threads)
    out = train_target(args.out, steps=args.steps, seed=args.seed, time_budget_s=args.time_budget,
                       batch_size=args.batch_size, lr=args.lr, mix=mix)
    for task_file in args.eval:
        _print_scores(out, task_file)
    return 0


def _print_scores(model: Path, task_file: Path) -> None:
    from .train.target import evaluate

    for kind, m in evaluate(model, task_file).items():
        print(f"{task_file}: {kind} exact match {m['exact']:.0%} of {m['n']} (blank image {m['exact_blank']:.0%})",
              flush=True)


def _eval(args: argparse.Namespace) -> int:
    from .model.adapters import Snapshot

    _threads(args.threads)
    model = args.model or default_model()[0]
    family = Snapshot(model).family
    if family != "qwen2_5_vl":
        raise GlanceError(f"{model} is a {family} model; eval scores Qwen2.5-VL targets on the synthetic corpus")
    for task_file in args.data:
        if not Path(task_file).is_file():
            raise GlanceError(f"{task_file} does not exist; write one with `glance-export corpus`")
        _print_scores(model, task_file)
    return 0


def _corpus(args: argparse.Namespace) -> int:
    from .train import corpus
    from .train.head_data import write_training_tasks

    if args.n < 1:
        raise GlanceError(f"--n {args.n}: pass at least 1 task")
    if args.kind == "train":
        path = write_training_tasks(args.out, args.n, seed=args.seed)
    else:
        path = corpus.write_task_file(args.out, args.kind, args.n, seed=args.seed)
    print(f"wrote {args.n} {args.kind} tasks to {path}")
    return 0


def _prepare_head_data(args: argparse.Namespace) -> int:
    from .train.prepared import prepare
    from .train.world import World, parse_device

    if args.arch == "eagle3" and args.layers is not None:
        raise GlanceError("--layers picks a GLANCE head's taps; an EAGLE-3 head (--arch eagle3) reads its three "
                          "default aux layers, so drop --layers")
    _threads(args.threads)
    prepare(args.model, args.data, args.out, layers=args.layers or 1, max_new_tokens=args.max_new_tokens,
            gen_batch=args.gen_batch, shard_mb=args.shard_mb, world=World(0, 1, parse_device(args.device)),
            progress=lambda line: print(line, flush=True), arch=args.arch)
    return 0


def _arch_flags(args: argparse.Namespace) -> None:
    """Refuse the flags of the other head kind: they would be silently ignored."""
    other = {"glance": (("--ttt-steps", args.ttt_steps), ("--ttt-decay", args.ttt_decay)),
             "eagle3": (("--block-size", args.block_size), ("--anchors", args.anchors), ("--gamma", args.gamma))}
    given = [flag for flag, value in other[args.arch] if value is not None]
    if given:
        kind = "an EAGLE-3 head (--arch eagle3)" if args.arch == "eagle3" else "a GLANCE head"
        named = " and ".join(given)
        raise GlanceError(f"{named} would be ignored: {kind} does not use {'them' if len(given) > 1 else 'it'}; "
                          f"drop {named}")
    if args.ttt_decay is not None and args.ttt_decay > 1:
        raise GlanceError(f"--ttt-decay {args.ttt_decay:g}: pass a weight in (0, 1] (later steps count less)")


def _train_head(args: argparse.Namespace) -> int:
    from .train.head_trainer import HeadTraining, train_head

    held_out = [flag for flag, value in (("--eval-every", args.eval_every), ("--eval-budget", args.eval_budget))
                if value is not None]
    if held_out and args.eval_data is None:
        given = " and ".join(held_out)
        raise GlanceError(f"{given} would be ignored: held-out measurement needs --eval-data; add --eval-data FILE or "
                          f"drop {given}")
    _arch_flags(args)
    _threads(args.threads)
    glance = HeadTraining()
    settings = HeadTraining(layers=args.layers, block_size=args.block_size or glance.block_size, steps=args.steps,
                            lr=args.lr, batch=args.batch, anchors=args.anchors or glance.anchors,
                            gamma=args.gamma or glance.gamma,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, gen_batch=args.gen_batch,
                            device=args.device, time_budget_s=args.time_budget, checkpoint_every=args.checkpoint_every,
                            resume=args.resume, log_every=args.log_every, eval_data=args.eval_data,
                            eval_every=args.eval_every or 0,
                            eval_budget=BUDGET if args.eval_budget is None else args.eval_budget,
                            draft_vocab=args.draft_vocab, arch=args.arch,
                            ttt_steps=args.ttt_steps or glance.ttt_steps, ttt_decay=args.ttt_decay or glance.ttt_decay)
    train_head(args.model, args.data or [], args.out, settings, progress=lambda line: print(line, flush=True),
               prepared=args.prepared)
    return 0


def _onnx(args: argparse.Namespace) -> int:
    from .onnx import export_artifacts

    for flag, value in (("--group-size", args.group_size), ("--accuracy", args.accuracy)):
        if value is not None and args.quantize is None:
            raise GlanceError(f"{flag} applies to quantized graphs only; add --quantize int8|int4 or drop it")
    out = export_artifacts(args.model, args.head, args.out, dtype=args.dtype, opset=args.opset, max_tree=args.max_tree,
                           max_context=args.max_context, branch_k=args.branch_k, quantize=args.quantize,
                           group_size=args.group_size, accuracy=args.accuracy or ACCURACY,
                           max_batch=args.max_batch, draft_vocab=args.draft_vocab,
                           progress=(lambda _: None) if args.quiet else (lambda line: print(line, flush=True)))
    print(f"wrote ONNX artifacts to {out}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from .build.local_gpu import probe_device
    from .build.engine_build import BuildRequest, build

    request = BuildRequest(target=args.target, out=args.out, model=args.model, head=args.head,
                           artifacts=args.artifacts, precision=args.precision, max_context=args.max_context,
                           max_tree=args.max_tree, max_batch=args.max_batch, memory_gib=args.memory_gib,
                           workspace_gib=args.workspace_gib, max_part_gib=args.max_part_gib,
                           timing_cache=args.timing_cache, plan_only=args.plan_only)
    build(request, probe_device(), progress=lambda line: print(line, flush=True))
    return 0


def _triton(args: argparse.Namespace) -> int:
    from .triton.launch import HOST, find_wheel, install_hint, launch_commands
    from .triton.repository import TritonRepo, write_repository

    repo = write_repository(TritonRepo(out=args.out, artifacts=args.artifacts, engines=args.engines, model=args.model,
                                       head=args.head, backend=args.backend, providers=tuple(args.provider or ()),
                                       instances_per_gpu=args.instances_per_gpu, gpus=args.gpu,
                                       python_env=args.python_env, max_tokens=args.max_tokens,
                                       max_batch=args.max_batch), progress=_progress)
    wheel = find_wheel(args.python_env)
    if wheel is None:
        _progress(install_hint(args.python_env))
        return 0
    _progress(f"launch it on {HOST}:{args.port} with the tritonserver in {wheel.site} (the commands below, on stdout):")
    print("\n".join(launch_commands(repo, wheel, args.port)))
    _progress(f"then: curl -s http://{HOST}:{args.port}/v2/models/glance/generate -d '{{\"prompt\": \"Say hello.\"}}'")
    return 0


def _add_triton(sub) -> None:
    x = sub.add_parser("triton", help="write a Triton Inference Server model repository serving GLANCE (Python backend)")
    x.add_argument("--out", type=Path, required=True, help="the model repository to write")
    x.add_argument("--artifacts", type=Path, help="exported graphs (default, with no model flags: the embedded model)")
    x.add_argument("--engines", type=Path, help="TensorRT engines (glance-export build)")
    x.add_argument("--model", type=Path, help="target snapshot (with --head; exported into the cache on first use)")
    x.add_argument("--head", type=Path, help="draft head of --model")
    x.add_argument("--backend", choices=BACKENDS, help="the backend the instances decode on (default: tensorrt with "
                   "--engines, else onnxruntime)")
    x.add_argument("--provider", action="append", help="ONNX Runtime execution provider; repeat for a priority list")
    x.add_argument("--instances-per-gpu", type=int, default=1, help="model instances (stub processes) per GPU")
    x.add_argument("--gpu", action="store_true", help="KIND_GPU instance groups (default KIND_CPU)")
    x.add_argument("--python-env", type=Path, help="virtual environment the stubs run in (EXECUTION_ENV_PATH)")
    x.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask for")
    x.add_argument("--max-batch", type=int,
                   help="requests an instance decodes together (default: glance-serve's; 1: one at a time)")
    x.add_argument("--port", type=flags.between("--port", 1, 65533, "gRPC and metrics take the next two"),
                   default=8000, help="the HTTP port in the printed launch commands (gRPC: +1, metrics: +2; "
                   "default 8000)")
    x.set_defaults(func=_triton)


def parser() -> argparse.ArgumentParser:
    p = ExportParser(prog="glance-export", description="GLANCE export toolkit.")
    sub = p.add_subparsers(dest="command", required=True)

    h = sub.add_parser("init-head", help="write an untrained draft head for a target")
    h.add_argument("--model", type=Path, required=True, help="target snapshot the head drafts for")
    h.add_argument("--out", type=Path, required=True, help="head directory to write (replaced whole)")
    h.add_argument("--layers", type=HEAD_LAYERS, default=1, help="transformer layers of the head")
    h.add_argument("--arch", choices=("glance", "eagle3"), default="glance",
                   help="glance: a block head (default); eagle3: an EAGLE-3 head in its published layout")
    h.add_argument("--block-size", type=BLOCK_SIZE, help="GLANCE heads only (default 16)")
    h.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    h.add_argument("--mask-token-id", type=int, help="GLANCE heads only (default: an id the tokenizer never emits)")
    h.add_argument("--draft-vocab", type=DRAFT_VOCAB,
                   help=f"EAGLE-3 heads only: draft over the target's first N ids, at least the {BRANCH_K} a draft "
                   "step branches into (default: its whole vocabulary)")
    h.set_defaults(func=_init_head)

    c = sub.add_parser("corpus", help="write a synthetic task file (held-out kinds, or training prompts)")
    c.add_argument("--out", type=Path, required=True, help="directory for the task file and its images")
    c.add_argument("--kind", choices=("receipt", "chart", "scene", "caption", "train"), required=True,
                   help="a held-out task kind, or 'train' for mixed training prompts (head training data)")
    c.add_argument("--n", type=flags.between("--n", 1, MAX_TASKS, "each task is an image file written to disk"),
                   default=20, help="tasks to write")
    c.add_argument("--seed", type=int, default=0, help="seed of the generated tasks")
    c.set_defaults(func=_corpus)

    g = sub.add_parser("train-target", help="train the embedded default VLM from scratch on the synthetic corpus")
    g.add_argument("--out", type=Path, required=True, help="run directory; holds checkpoints and the snapshot")
    g.add_argument("--steps", type=STEPS, default=3600, help="3600 from scratch; resume with a larger value to continue")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    g.add_argument("--time-budget", type=float, default=3000.0, help="seconds; stops early and saves")
    g.add_argument("--batch-size", type=BATCH, default=16, help="sequences per optimizer step")
    g.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    g.add_argument("--threads", type=flags.threads, help="torch CPU threads (1 up to this machine's CPUs)")
    g.add_argument("--mix", nargs="+", metavar="KIND=WEIGHT",
                   help="training mix by task kind (default receipt=0.1 chart=0.35 scene=0.45 caption=0.1)")
    g.add_argument("--eval", type=Path, nargs="*", default=[], help="task files to score at the end")
    g.set_defaults(func=_train_target)

    e = sub.add_parser("eval", help="greedy exact match per task kind, with the same prompts on a blank image")
    e.add_argument("--model", type=Path, help="target snapshot (default: the embedded glance-vl-tiny)")
    e.add_argument("--data", type=Path, nargs="+", required=True, help="task files (corpus format)")
    e.add_argument("--threads", type=flags.threads, help="torch CPU threads (1 up to this machine's CPUs)")
    e.set_defaults(func=_eval)

    t = sub.add_parser("train-head", help="train a GLANCE (or EAGLE-3) head on the target's own answers to training "
                       "prompts (runs under torchrun for several processes)")
    t.add_argument("--model", type=Path, required=True, help="target snapshot the head drafts for")
    t.add_argument("--arch", choices=("glance", "eagle3"), default="glance",
                   help="glance: a block-diffusion head (the DFlash recipe); eagle3: an EAGLE-3 head in the published "
                   "layout, trained by its training-time test (borrows the target's embedding, drafts over "
                   "--draft-vocab tokens, default 32000 or the whole vocabulary if smaller)")
    t.add_argument("--data", type=Path, action="append",
                   help="training prompts, repeatable: TASKS.jsonl, LLaVA-style JSON/JSONL or OpenAI-style messages "
                   "JSONL (image paths relative to the file); every assistant turn is regenerated by the target")
    t.add_argument("--prepared", type=Path, help="instead of --data: a directory from prepare-head-data (only the "
                   "target's embedding and LM head are loaded)")
    t.add_argument("--out", type=Path, required=True, help="head directory to write; a run stopped early continues "
                   "from the checkpoint there")
    t.add_argument("--resume", type=Path, help="continue from this head directory")
    t.add_argument("--layers", type=HEAD_LAYERS, default=1, help="transformer layers of a new head")
    t.add_argument("--block-size", type=BLOCK_SIZE, help="GLANCE: the anchor and the offsets drafted (default 16)")
    t.add_argument("--steps", type=STEPS, default=2000, help="optimizer steps")
    t.add_argument("--lr", type=flags.positive("--lr"), default=3e-3, help="peak learning rate")
    t.add_argument("--batch", type=BATCH, default=8, help="sequences per step and process")
    t.add_argument("--gen-batch", type=GEN_BATCH, default=16, help="prompts the target answers in one batch")
    t.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (under torchrun: each process its GPU)")
    t.add_argument("--anchors", type=flags.at_least("--anchors", 1),
                   help="GLANCE: anchors sampled per sequence (default 16)")
    t.add_argument("--gamma", type=flags.positive("--gamma"), help="GLANCE: offset k is weighted exp(-(k-1)/gamma) "
                   "(default 7)")
    t.add_argument("--ttt-steps", type=flags.between("--ttt-steps", 1, EAGLE3_DEPTH, "the deepest tree an EAGLE-3 "
                   "round drafts"), help=f"EAGLE-3: steps the head is unrolled over its own guesses (default "
                   f"{EAGLE3_DEPTH})")
    t.add_argument("--ttt-decay", type=flags.positive("--ttt-decay"),
                   help="EAGLE-3: unrolled step j's loss is weighted DECAY**j (default 0.8)")
    t.add_argument("--max-new-tokens", type=ANSWER_TOKENS, default=64, help="length of the target's answers")
    t.add_argument("--seed", type=SEED, default=0, help="seed of a new head's weights, the samples and the anchors")
    t.add_argument("--time-budget", type=flags.finite("--time-budget", 0),
                   help="stop after this many seconds of training (0: after the first step)")
    t.add_argument("--checkpoint-every", type=flags.at_least("--checkpoint-every", 1), default=500,
                   help="save head and trainer state every N steps; the same command continues from there")
    t.add_argument("--draft-vocab", type=DRAFT_VOCAB, metavar="N",
                   help="draft over the N tokens most frequent in the target's answers (a cheaper draft pass; at "
                   f"least the {BRANCH_K} a draft offset branches into); default: the whole vocabulary (EAGLE-3: "
                   "32000, or the whole vocabulary if smaller)")
    t.add_argument("--log-every", type=flags.at_least("--log-every", 1), default=50,
                   help="steps between log lines and metrics.jsonl records")
    t.add_argument("--eval-data", type=Path, help="held-out prompts: tau and per-offset acceptance with the real "
                   "draft/verify loop, into metrics.jsonl and the head's card")
    t.add_argument("--eval-every", type=flags.at_least("--eval-every", 0),
                   help="steps between held-out measurements, with --eval-data (default 0: at the end only)")
    t.add_argument("--eval-budget", type=flags.between("--eval-budget", 1, 1024, "tree nodes a round"),
                   help=f"tree budget of the held-out tau besides 15, with --eval-data (default {BUDGET})")
    t.add_argument("--threads", type=flags.threads, help="torch CPU threads (1 up to this machine's CPUs)")
    t.set_defaults(func=_train_head)

    d = sub.add_parser("prepare-head-data", help="answer and tap training prompts once, into bf16 shards that "
                       "train-head --prepared reads")
    d.add_argument("--model", type=Path, required=True, help="target snapshot that answers and is tapped")
    d.add_argument("--data", type=Path, required=True, action="append",
                   help="training prompts, repeatable (the formats train-head --data takes)")
    d.add_argument("--out", type=Path, required=True, help="directory for the index and shards (replaced whole)")
    d.add_argument("--arch", choices=("glance", "eagle3"), default="glance",
                   help="the head kind the data is for: eagle3 taps the three default aux layers")
    d.add_argument("--layers", type=HEAD_LAYERS, help="layers of the GLANCE head to train (picks the taps; default 1)")
    d.add_argument("--max-new-tokens", type=ANSWER_TOKENS, default=64, help="length of the target's answers")
    d.add_argument("--gen-batch", type=GEN_BATCH, default=16, help="prompts the target answers in one batch")
    d.add_argument("--shard-mb", type=flags.positive("--shard-mb"), default=256, help="size of one shard file, MB")
    d.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    d.add_argument("--threads", type=flags.threads, help="torch CPU threads (1 up to this machine's CPUs)")
    d.set_defaults(func=_prepare_head_data)

    o = sub.add_parser("onnx", help="export vision, target and draft graphs with a manifest, validated in ONNX Runtime")
    o.add_argument("--model", type=Path, required=True, help="target model: a HF snapshot directory")
    o.add_argument("--head", type=Path, required=True, help="draft head directory: a GLANCE/DFlash head, or an "
                   "EAGLE-3 head as published")
    o.add_argument("--out", type=Path, required=True, help="artifacts directory to write (replaced whole)")
    o.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32",
                   help="weights and activations of the graphs (--quantize needs fp32)")
    o.add_argument("--opset", type=int, default=17, help="14..20 (plain ops, TensorRT 10.3) or 23 (ONNX Attention)")
    o.add_argument("--max-tree", type=flags.at_least("--max-tree", 1), default=64,
                   help="largest verify pass (anchor + tree nodes)")
    o.add_argument("--max-context", type=flags.at_least("--max-context", 2), default=2048,
                   help="KV cache rows: prompt + answer")
    o.add_argument("--branch-k", type=flags.at_least("--branch-k", 1), default=BRANCH_K,
                   help=f"top-k the draft graph returns per offset (default {BRANCH_K})")
    o.add_argument("--max-batch", type=BATCHED, default=MAX_BATCH,
                   help=f"sequences one pass of the target and draft graphs serves (their batch axis), "
                        f"1..{BATCH_BOUND} (default {MAX_BATCH}); an EAGLE-3 head's export is bounded to 1")
    o.add_argument("--quantize", choices=("int8", "int4"),
                   help="weight-only: linear layers, LM head and embedding of target and head (vision stays fp32)")
    o.add_argument("--group-size", type=int, choices=GROUP_SIZES,
                   help="weights per quantization scale, with --quantize; must divide the hidden size (default: "
                   "the largest that does)")
    o.add_argument("--accuracy", choices=tuple(ACCURACY_LEVELS),
                   help=f"with --quantize, how ONNX Runtime's CPU provider multiplies by the quantized weights: int8 "
                   "(int8 activations per block, fast for several rows; a tree pass may differ from a one-row pass "
                   "in the last bits) or exact (fp32, every row as a one-row pass computes it; slower) (default "
                   f"{ACCURACY})")
    o.add_argument("--draft-vocab", type=_export_draft_vocab, default=VOCAB_AUTO, metavar="auto|all|N",
                   help=f"tokens a GLANCE head trained without a draft vocabulary scores when it drafts: auto gives a "
                   f"target vocabulary above {LARGE_VOCAB:,} tokens a reduced one of {DEFAULT_SIZE:,} (the tokenizer's "
                   f"added tokens, then its most frequent merges), all scores every token, N picks N that way; the "
                   f"answers never change, only how often drafts are accepted (default {VOCAB_AUTO})")
    o.add_argument("--quiet", action="store_true", help="print only the final line, not each graph's progress")
    o.set_defaults(func=_onnx)

    b = sub.add_parser("build", help="build TensorRT engines for a device target (--plan-only: a bundle to build there)")
    b.add_argument("--target", required=True, choices=("jetson",) + PROFILE_NAMES,
                   help="device profile (engines/profiles); jetson picks Orin or Thor from this device")
    b.add_argument("--model", type=Path, help="target snapshot: export it (cached) with --head")
    b.add_argument("--head", type=Path, help="draft head of --model")
    b.add_argument("--artifacts", type=Path, help="an export from `glance-export onnx` (no torch needed)")
    b.add_argument("--out", type=Path, required=True, help="engines directory (the bundle with --plan-only)")
    b.add_argument("--precision", choices=PRECISIONS,
                   help="default: the target's (strongly typed builders: the export's)")
    b.add_argument("--max-context", type=flags.at_least("--max-context", 2),
                   help="lower the export's max context (default: what fits in memory)")
    b.add_argument("--max-tree", type=flags.at_least("--max-tree", 1),
                   help="lower the export's max tree (default: the target's cap)")
    b.add_argument("--max-batch", type=BATCHED,
                   help="sequences a target or draft engine's pass serves, at most the export's (default: the "
                        "target's max_batch, lowered to what fits the memory budget); 1 builds no batch profile")
    b.add_argument("--memory-gib", type=flags.positive("--memory-gib"),
                   help="device memory budget (default: this device's, else the target's)")
    b.add_argument("--workspace-gib", type=flags.positive("--workspace-gib"),
                   help="builder workspace (trtexec --memPoolSize=workspace)")
    b.add_argument("--max-part-gib", type=flags.positive("--max-part-gib"),
                   help="build a graph with more weights than this as a chain of engines, one per part "
                        "(default: 2, less where a Jetson could not build such a part)")
    b.add_argument("--timing-cache", type=Path, help="read if present, written after (trtexec --timingCacheFile)")
    b.add_argument("--plan-only", action="store_true",
                   help="write the export, target profile, README and build.sh for the device; needs no TensorRT")
    b.set_defaults(func=_build)

    a = sub.add_parser("audit", help="check GLANCE output against greedy decoding, prompt by prompt",
                       description="Four modes, picked by at most one of their flags: with none, GLANCE against "
                       "the torch greedy oracle (or, for exported graphs without --model, the backend's own "
                       "greedy); --save-reference FILE records the fp32 torch greedy tokens of --data on a "
                       "workstation; --reference FILE checks a backend against such a recording without torch; "
                       "--drift-from FP32_ART compares quantized --artifacts' greedy tokens with an fp32 export's.")
    a.add_argument("--data", type=Path, required=True, help="TASKS.jsonl")
    runner_flags(a, backend_help="default: torch; with --reference, onnxruntime where installed",
                 threads_help="CPU threads: torch's (the oracle and the torch backend) and ONNX Runtime's")
    decode_flags(a, max_new_tokens=None, budget_default=BUDGET,
                 budget_help=f"tree nodes verified per round besides the anchor (default {BUDGET}: fixed, so an "
                 "audit checks the same trees on every device), or auto: sized each round as glance-run --budget "
                 "auto does (measures this device's costs on first use)",
                 max_new_tokens_help=f"default {MEASURE_MAX_NEW_TOKENS}; with --reference, the value it was "
                 "recorded with")
    a.add_argument("--json", action="store_true", help="print the report as JSON instead of its summary lines")
    flags.sampling_flags(a, seed_default=0, seed_help="the sampling seed with --temperature above 0 (default 0): "
                         "task i samples with this seed + i, in GLANCE and in plain sampling alike")
    mode = a.add_mutually_exclusive_group()
    mode.add_argument("--save-reference", type=Path, metavar="FILE",
                      help="mode: record the fp32 PyTorch greedy tokens and top-2 margins of --data (needs torch)")
    mode.add_argument("--reference", type=Path, metavar="FILE",
                      help="mode: compare the backend with a recorded reference instead of the torch oracle (no torch)")
    mode.add_argument("--drift-from", type=Path, metavar="FP32_ARTIFACTS",
                      help="mode: greedy token agreement of --artifacts (quantized) with this fp32 export")
    a.set_defaults(func=_audit)
    _add_triton(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return guarded("glance-export", lambda: args.func(args),
                   "interrupted; outputs are left as they were before this run (a training run continues from its "
                   "last checkpoint when run again)")
