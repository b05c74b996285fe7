"""`glance-run`: answer a prompt about any number of images and videos, or hold a conversation (`--chat`), streaming
the answer as rounds commit. A thin caller of the Python API (`glance_runtime.api`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import api
from ..store.cache import cache_root
from .flags import (OneLineParser, at_least, check_applicable, check_dirs, decode_flags, guarded, positive,
                    runner_flags, sampling_flags, sampling_of)
from ..decode.limits import check_speculation
from ..decode.sampling import MAX_TOP_N
from ..defaults import BUDGET, RUN_MAX_NEW_TOKENS, resolve
from ..errors import GlanceError
from ..formats.logprobs import token_logprobs
from ..prompt.images import check_image_path
from ..prompt.token_bytes import TokenBytes
from ..prompt.video import DEFAULT_FPS


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-run", description="Lossless speculative decoding of one prompt.")
    p.add_argument("--prompt", help="the question or instruction (required unless --chat)")
    p.add_argument("--image", type=Path, action="append", default=[], help="image file, in prompt order; repeat for "
                   "several (omit for text-only prompts)")
    p.add_argument("--video", type=Path, nargs="+", action="append", default=[], metavar="FRAME",
                   help="a video as its frame files in order, after the images; repeat for several")
    p.add_argument("--fps", type=positive("--fps"), default=DEFAULT_FPS,
                   help=f"the rate the --video frames were taken at, frames per second (default {DEFAULT_FPS:g})")
    p.add_argument("--system", help="a system message before the prompt")
    p.add_argument("--chat", action="store_true", help="an interactive conversation on the terminal that keeps its "
                   "KV between turns (--prompt and --image give the first turn); /reset starts over, /exit ends")
    runner_flags(p)
    p.add_argument("--no-spec", action="store_true", help="plain decoding, no draft head")
    decode_flags(p, max_new_tokens=RUN_MAX_NEW_TOKENS, budget_help="tree nodes verified per round besides the "
                 "anchor, or auto: sized each round from the draft's confidence and this device's measured costs "
                 "(default: auto where a cost profile exists or is measured on first use, i.e. exported graphs "
                 f"and engines; else {BUDGET})")
    p.add_argument("--remeasure", action="store_true", help="measure this device's cost profile for --budget "
                   "auto again instead of reading the stored one")
    sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--logprobs", type=at_least("--logprobs", 0), default=None, metavar="N",
                   help=f"with --json: each token's log-prob and the N best alternatives (0..{MAX_TOP_N}), the same "
                   "with the draft on or off (default: none)")
    return p


def _check_inputs(args: argparse.Namespace) -> None:
    """Missing or unreadable inputs are named before anything else is concluded from their absence."""
    check_dirs(args)
    for image in [*args.image, *(frame for video in args.video for frame in video)]:
        check_image_path(image)
    if args.prompt is None and not args.chat:
        raise GlanceError("--prompt is required (or pass --chat for a conversation)")
    if args.logprobs is not None and (args.chat or not args.json):
        raise GlanceError("--logprobs reports in the --json output of one prompt; add --json (without --chat)")
    if args.logprobs is not None and args.logprobs > MAX_TOP_N:
        raise GlanceError(f"--logprobs {args.logprobs} is over {MAX_TOP_N}; pass 0 (each token's own log-prob) to "
                          f"{MAX_TOP_N} alternatives")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError:
            raise GlanceError(f"{flag} is not valid UTF-8 text (the shell passed undecodable bytes); pass it "
                              "in UTF-8, e.g. with a UTF-8 locale") from None


def _videos(args: argparse.Namespace) -> list[dict]:
    return [{"video": frames, "fps": args.fps} for frames in args.video]


class Terminal:
    """The streamed answer on stdout and notices on stderr, which a terminal shows on one screen: a notice that
    comes while an answer's line is open (auto's "cost profile refined ..." mid-decode) is held until the line
    ends, so it never lands inside the answer."""

    def __init__(self) -> None:
        self.open = False  # an answer's line has begun and not ended
        self.held: list[str] = []

    def notice(self, line: str) -> None:
        if self.open:
            self.held.append(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def write(self, piece: str) -> None:
        self.open = True
        sys.stdout.write(piece)
        sys.stdout.flush()

    def end(self, always: bool = True) -> None:
        """End the answer's line (`always`: even where nothing was written), then show the notices held."""
        if always or self.open:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.open = False
        held, self.held = self.held, []
        for line in held:
            print(line, file=sys.stderr, flush=True)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _stats_line(out: api.Output) -> str:
    """tau is tokens per round; the prefill's token is no round's, so the line counts it apart."""
    s = out.stats
    return (f"[{s['backend']}] tau {s['tau']:.2f} | {_count(s['tokens'], 'token')} (1 from the prefill, "
            f"{s['tokens'] - 1} in {_count(s['rounds'], 'round')}) | "
            f"{s['tokens_per_s']} tok/s | {s['ms_per_token']:.1f} ms/token ({s['ms_per_token_decode']:.1f} without "
            f"prefill) | prefilled {s['prefill_tokens']} of {s['prompt_tokens']} prompt tokens"
            + ("" if out.seed is None else f" | sampled with seed {out.seed}"))


def _load(args: argparse.Namespace, terminal: Terminal) -> api.Model:
    cache_root()  # exports, hash stamps and cost profiles live there: a broken location is refused before loading
    asked = args.backend or ("tensorrt" if args.engines is not None else None)
    _, head, _, backend = resolve(args.model, args.head, args.artifacts, asked)  # as api.load resolves them
    check_applicable(args, backend)
    check_speculation(args.budget, not args.no_spec, args.remeasure, cli=True)
    if not args.no_spec and head is None and backend == "torch":
        raise GlanceError("speculative decoding needs --head (or pass --no-spec for plain greedy decoding)")
    return api.load(args.artifacts, engines=args.engines, model=args.model, head=args.head, backend=args.backend,
                    provider=args.provider, budget=args.budget, branch_k=args.branch_k, speculative=not args.no_spec,
                    max_context=args.max_context, max_tree=args.max_tree, threads=args.threads,
                    remeasure=args.remeasure,
                    progress=terminal.notice)


def _sampling(args: argparse.Namespace) -> dict:
    """generate's sampling arguments from the flags."""
    s = sampling_of(args)
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p, "seed": s.seed}


def _chat(model: api.Model, args: argparse.Namespace, terminal: Terminal) -> int:
    """Read turns from stdin until /exit or end of input; a refused turn is reported and the chat goes on."""
    chat = model.chat(system=args.system)
    first = (args.prompt, args.image, _videos(args)) if args.prompt is not None else None
    if first is None and (args.image or args.video):
        raise GlanceError("--image and --video in --chat go with the first turn; pass --prompt too")
    print("glance-run chat: /reset starts over, /exit ends", file=sys.stderr)
    while True:
        if first is not None:
            (text, images, videos), first = first, None
            print(f"> {text}", file=sys.stderr)
        else:
            print("> ", end="", file=sys.stderr, flush=True)
            try:
                line = sys.stdin.readline()
            except UnicodeDecodeError:
                print("glance-run: error: that line is not valid UTF-8 text; type it again in UTF-8", file=sys.stderr)
                continue
            if not line or line.strip() == "/exit":
                return 0
            text, images, videos = line.rstrip("\n"), [], []
            if text.strip() == "/reset":
                chat.reset()
                print("(conversation reset)", file=sys.stderr)
                continue
            if not text.strip():
                continue
        try:
            out = chat.send(text, images, videos=videos, max_new_tokens=args.max_new_tokens, on_text=terminal.write,
                            **_sampling(args))
        except GlanceError as exc:
            terminal.end(always=False)
            print(f"glance-run: error: {exc}", file=sys.stderr)
            continue
        terminal.end()
        print(_stats_line(out), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    _check_inputs(args)
    _sampling(args)  # settings out of range are refused before the model loads
    terminal = Terminal()
    with _load(args, terminal) as model:
        if args.chat:
            return _chat(model, args, terminal)
        out = model.generate(args.prompt, images=args.image, videos=_videos(args), system=args.system,
                             max_new_tokens=args.max_new_tokens, on_text=None if args.json else terminal.write,
                             logprobs=args.logprobs, **_sampling(args))
        if args.json:
            log = [{"entropy": round(r.entropy, 4), "accepted": r.accepted, "tree_size": r.tree_size,
                    "drafted": r.drafted, "ms": round(r.total_ms, 3)} for r in out.rounds]
            reports = {} if out.logprobs is None else {"logprobs": token_logprobs(
                out.token_ids, out.logprobs, TokenBytes(model.session.codec.tokenizer))}
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, **out.stats, "seed": out.seed,
                              **reports, "round_log": log}))
            return 0
        terminal.end()
        print(_stats_line(out), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded("glance-run", lambda: run(parser().parse_args(argv)))
