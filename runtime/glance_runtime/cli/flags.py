"""What the commands share on their command lines: the flags that name a model and backend (declared once,
for glance-run, glance-bench and glance-export), argument errors in the same one-line form as every other
refusal, and the one wrapper that turns a command's refusals and Ctrl-C into that line and an exit code."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn

from ..decode import limits
from ..defaults import BRANCH_K
from ..errors import GlanceError, check_stdout, machine_failure, silence_stdout
from ..backends.registry import BACKENDS
from ..decode.session import Source

BACKEND_DEFAULT = "default: onnxruntime where installed, else torch"


class OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block before its error; here it is one line that points at --help."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def runner_flags(p: argparse.ArgumentParser, *, backend_help: str = BACKEND_DEFAULT,
                 threads_help: str = "ONNX Runtime intra-op threads (1 up to this machine's CPUs)") -> None:
    """--backend, --model, --head, --artifacts, --engines, --provider, --threads, --max-context, --max-tree."""
    p.add_argument("--backend", choices=BACKENDS, help=backend_help)
    p.add_argument("--model", type=Path, help="target model: a HF snapshot directory (default: the embedded "
                   "glance-vl-tiny with its head)")
    p.add_argument("--head", type=Path, help="GLANCE/DFlash draft head directory")
    p.add_argument("--artifacts", type=Path, help="exported graphs for --backend onnxruntime (glance-export onnx)")
    p.add_argument("--engines", type=Path, help="TensorRT engines for --backend tensorrt (glance-export build)")
    p.add_argument("--provider", action="append", help="ONNX Runtime execution provider (cpu, cuda, tensorrt or a "
                   "full name); repeat for a priority list; CPU is the fallback")
    p.add_argument("--threads", type=limits.threads, help=threads_help)
    p.add_argument("--max-context", type=limits.integer("--max-context"),
                   help="KV rows to allocate (default: the export's or build's bound)")
    p.add_argument("--max-tree", type=limits.integer("--max-tree"),
                   help="largest verify pass (default: the export's or build's bound)")


def decode_flags(p: argparse.ArgumentParser, *, max_new_tokens: int | None, budget_help: str,
                 budget_default: int | None = None, max_new_tokens_help: str | None = None) -> None:
    """--budget, --branch-k and --max-new-tokens, each with its one range rule (`limits`)."""
    p.add_argument("--budget", type=limits.budget, default=budget_default, help=budget_help)
    p.add_argument("--branch-k", type=limits.at_least("--branch-k", 1), default=BRANCH_K,
                   help=f"top-k per draft offset (default {BRANCH_K})")
    p.add_argument("--max-new-tokens", type=limits.at_least("--max-new-tokens", 1), default=max_new_tokens,
                   help=max_new_tokens_help or f"longest answer in tokens (default {max_new_tokens})")


def check_dirs(args: argparse.Namespace) -> None:
    """Missing or unreadable inputs are named before anything else is concluded from their absence."""
    for flag, path in (("--model", args.model), ("--head", args.head), ("--artifacts", args.artifacts),
                       ("--engines", args.engines)):
        if path is not None and not path.is_dir():
            state = "is not a directory" if path.exists() else "does not exist"
            raise GlanceError(f"{flag} {path} {state}; pass an existing directory")


def check_applicable(args: argparse.Namespace, backend: str) -> None:
    """Flags the chosen backend would ignore are refused, not silently dropped."""
    if args.engines is not None and backend != "tensorrt":
        raise GlanceError(f"--engines is for --backend tensorrt, not {backend}; drop --engines or pass "
                          "--backend tensorrt")
    if backend != "torch" and (args.artifacts is not None or args.engines is not None) and \
            (args.model is not None or args.head is not None):
        given = "--artifacts" if args.artifacts is not None else "--engines"
        raise GlanceError(f"{given} already holds the model and its head, so --model and --head would be ignored; "
                          f"drop --model/--head, or drop {given} to export them")
    if args.artifacts is not None and backend == "torch":
        raise GlanceError("--artifacts is for the onnxruntime and tensorrt backends; drop it or pick one of them")
    if backend == "torch" and (args.provider or args.threads is not None or args.max_context is not None
                               or args.max_tree is not None):
        raise GlanceError("--provider, --threads, --max-context and --max-tree are for the graph backends "
                          "(onnxruntime, tensorrt); drop them for --backend torch")


def source(args: argparse.Namespace, backend: str, **resolved) -> Source:
    """The Source the runner flags name; `resolved` overrides what the command resolved itself (model, ...)."""
    named = dict(model=args.model, head=args.head, artifacts=args.artifacts, engines=args.engines,
                 providers=args.provider, threads=args.threads, max_context=args.max_context,
                 max_tree=args.max_tree)
    return Source(backend=backend, **{**named, **resolved})


def guarded(prog: str, command: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a command: a GlanceError is one `prog: error:` line and exit 2, Ctrl-C one line and exit 130."""
    try:
        closed = check_stdout()
        if closed is not None:
            raise closed
        code = command()
        sys.stdout.flush()  # a full device fails here, inside the guard, not at the interpreter's exit
        return code
    except GlanceError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        failure = machine_failure(exc)
        if failure is None:
            raise
        silence_stdout()
        print(f"{prog}: error: {failure}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
