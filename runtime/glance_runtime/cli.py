"""`glance-run`: answer one prompt about one image, streaming the answer as rounds commit."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cache import cache_root
from .cli_parser import OneLineParser, guarded, parse_budget
from .errors import GlanceError
from .limits import check_decode
from .auto_budget import AUTO, decode_config
from .loop import DecodeConfig, decode
from .defaults import resolve
from .preprocess import check_image_path
from .runner import BACKENDS, open_runner


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-run", description="Lossless speculative decoding of one prompt.")
    p.add_argument("--prompt", required=True, help="the question or instruction")
    p.add_argument("--image", type=Path, help="image file (omit for text-only prompts)")
    p.add_argument("--model", type=Path, help="target model: a HF snapshot directory (default: the embedded "
                   "glance-vl-tiny with its head)")
    p.add_argument("--head", type=Path, help="GLANCE/DFlash draft head directory")
    p.add_argument("--backend", choices=BACKENDS, help="default: onnxruntime where installed, else torch")
    p.add_argument("--artifacts", type=Path, help="exported graphs for --backend onnxruntime (glance-export onnx)")
    p.add_argument("--engines", type=Path, help="TensorRT engines for --backend tensorrt (glance-export build)")
    p.add_argument("--provider", action="append", help="ONNX Runtime execution provider (cpu, cuda, tensorrt or a "
                   "full name); repeat for a priority list; CPU is the fallback")
    p.add_argument("--max-context", type=int, help="KV rows to allocate (default: the export's bound)")
    p.add_argument("--max-tree", type=int, help="largest verify pass (default: the export's bound)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads")
    p.add_argument("--no-spec", action="store_true", help="plain greedy decoding, no draft head")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--budget", type=parse_budget, help="tree nodes verified per round besides the anchor, or auto: "
                   "sized each round from the draft's confidence and this device's measured costs (default: auto "
                   "where a cost profile exists or is measured on first use, i.e. exported graphs and engines; else 63)")
    p.add_argument("--branch-k", type=int, default=8, help="top-k per draft offset")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return p


def _stream(detokenize, tokens: list[int]):
    """Print only the newly decodable suffix, so multi-token characters come out whole."""
    shown = [""]

    def on_commit(new: list[int]) -> None:
        tokens.extend(new)
        text = detokenize(tokens)
        if text.startswith(shown[0]) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    return on_commit, shown


def _check_inputs(args: argparse.Namespace) -> None:
    """Missing or unreadable inputs are named before anything else is concluded from their absence."""
    for flag, path in (("--model", args.model), ("--head", args.head), ("--artifacts", args.artifacts),
                       ("--engines", args.engines)):
        if path is not None and not path.is_dir():
            state = "is not a directory" if path.exists() else "does not exist"
            raise GlanceError(f"{flag} {path} {state}; pass an existing directory")
    if args.image is not None:
        check_image_path(args.image)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise GlanceError("--prompt is not valid UTF-8 text (the shell passed undecodable bytes); pass the prompt "
                          "in UTF-8, e.g. with a UTF-8 locale") from None


def run(args: argparse.Namespace) -> int:
    _check_inputs(args)
    cache_root()  # exports, hash stamps and cost profiles live there: a broken location is refused before loading
    args.model, args.head, args.artifacts, args.backend = resolve(args.model, args.head, args.artifacts, args.backend)
    if not args.no_spec and args.head is None and args.backend == "torch":
        raise GlanceError("speculative decoding needs --head (or pass --no-spec for plain greedy decoding)")
    fixed = args.budget if args.budget not in (None, AUTO) else 0
    check_decode(None, DecodeConfig(max_new_tokens=args.max_new_tokens, budget=fixed, branch_k=args.branch_k))
    ort = {} if args.backend == "torch" else dict(providers=args.provider, max_context=args.max_context,
                                                  max_tree=args.max_tree, threads=args.threads)
    progress = lambda line: print(line, file=sys.stderr)  # noqa: E731
    runner = open_runner(args.backend, model=args.model, head=args.head, artifacts=args.artifacts,
                         engines=args.engines, progress=progress, **ort)
    prompt = runner.build_prompt(args.prompt, args.image)  # a bad image or prompt is refused before any measuring
    cfg = decode_config(runner, args.budget, max_new_tokens=args.max_new_tokens, branch_k=args.branch_k,
                        speculative=not args.no_spec, progress=progress)
    check_decode(runner.limits, cfg)
    streamed: list[int] = []
    on_commit, shown = _stream(runner.detokenize, streamed) if not args.json else (None, [""])
    result = decode(runner.backend, prompt, cfg, runner.stop_ids, on_commit=on_commit)
    text = runner.detokenize(result.tokens)
    stats = {"backend": runner.backend.name, "speculative": cfg.speculative,
             "budget": AUTO if cfg.auto else cfg.budget if cfg.speculative else 0, **result.stats(),
             "tokens_per_s": round(1e3 / result.ms_per_token, 2) if result.ms_per_token else None}
    if args.json:
        log = [{"entropy": round(r.entropy, 4), "accepted": r.accepted, "tree_size": r.tree_size,
                "drafted": r.drafted, "ms": round(r.total_ms, 3)} for r in result.rounds]
        print(json.dumps({"text": text, "token_ids": result.tokens, **stats, "round_log": log}))
        return 0
    sys.stdout.write(text[len(shown[0]):] + "\n")
    print(f"[{stats['backend']}] tau {stats['tau']:.2f} | {stats['tokens']} tokens in {stats['rounds']} rounds | "
          f"{stats['tokens_per_s']} tok/s | {stats['ms_per_token']:.1f} ms/token "
          f"({stats['ms_per_token_decode']:.1f} without prefill)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded("glance-run", lambda: run(parser().parse_args(argv)))
