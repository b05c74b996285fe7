"""`glance-run`: answer one prompt about one image, streaming the answer as rounds commit."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cache import cache_root
from .cli_parser import OneLineParser, check_dirs, decode_flags, guarded, runner_flags, source
from .defaults import AUTO, BUDGET, RUN_MAX_NEW_TOKENS, resolve
from .errors import GlanceError
from .preprocess import check_image_path
from .session import Settings, open_session


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-run", description="Lossless speculative decoding of one prompt.")
    p.add_argument("--prompt", required=True, help="the question or instruction")
    p.add_argument("--image", type=Path, help="image file (omit for text-only prompts)")
    runner_flags(p)
    p.add_argument("--no-spec", action="store_true", help="plain greedy decoding, no draft head")
    decode_flags(p, max_new_tokens=RUN_MAX_NEW_TOKENS, budget_help="tree nodes verified per round besides the "
                 "anchor, or auto: sized each round from the draft's confidence and this device's measured costs "
                 "(default: auto where a cost profile exists or is measured on first use, i.e. exported graphs "
                 f"and engines; else {BUDGET})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return p


def _check_inputs(args: argparse.Namespace) -> None:
    """Missing or unreadable inputs are named before anything else is concluded from their absence."""
    check_dirs(args)
    if args.image is not None:
        check_image_path(args.image)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise GlanceError("--prompt is not valid UTF-8 text (the shell passed undecodable bytes); pass the prompt "
                          "in UTF-8, e.g. with a UTF-8 locale") from None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    _check_inputs(args)
    cache_root()  # exports, hash stamps and cost profiles live there: a broken location is refused before loading
    model, head, artifacts, backend = resolve(args.model, args.head, args.artifacts, args.backend)
    if not args.no_spec and head is None and backend == "torch":
        raise GlanceError("speculative decoding needs --head (or pass --no-spec for plain greedy decoding)")
    progress = lambda line: print(line, file=sys.stderr)  # noqa: E731
    settings = Settings(budget=args.budget, max_new_tokens=args.max_new_tokens, branch_k=args.branch_k,
                        speculative=not args.no_spec)
    session = open_session(source(args, backend, model=model, head=head, artifacts=artifacts), settings, progress)
    answer = session.generate(args.prompt, args.image, on_text=None if args.json else _write)
    result, cfg = answer.result, session.config
    stats = {"backend": session.runner.backend.name, "speculative": cfg.speculative,
             "budget": AUTO if cfg.auto else cfg.budget if cfg.speculative else 0, **result.stats(),
             "tokens_per_s": round(1e3 / result.ms_per_token, 2) if result.ms_per_token else None}
    if args.json:
        log = [{"entropy": round(r.entropy, 4), "accepted": r.accepted, "tree_size": r.tree_size,
                "drafted": r.drafted, "ms": round(r.total_ms, 3)} for r in result.rounds]
        print(json.dumps({"text": answer.text, "token_ids": result.tokens, **stats, "round_log": log}))
        return 0
    sys.stdout.write("\n")
    print(f"[{stats['backend']}] tau {stats['tau']:.2f} | {stats['tokens']} tokens in {stats['rounds']} rounds | "
          f"{stats['tokens_per_s']} tok/s | {stats['ms_per_token']:.1f} ms/token "
          f"({stats['ms_per_token_decode']:.1f} without prefill)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded("glance-run", lambda: run(parser().parse_args(argv)))
