"""What the commands share on their command lines: the flags that name a model and backend (declared once,
for glance-run, glance-bench and glance-export), argument errors in the same one-line form as every other
refusal, each flag's range rule (argparse types: every command declaring a flag refuses a bad value in the
same words, before anything is opened), and the one wrapper that turns a command's refusals and Ctrl-C into
that line and an exit code."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, NoReturn

from .._version import __version__
from ..defaults import AUTO, BRANCH_K
from ..decode.limits import threads_problem
from ..decode.sampling import SEED_LIMIT, SamplingParams, sampling_params
from ..errors import GlanceError, check_stdout, machine_failure, silence_stdout
from ..backends.registry import BACKENDS
from ..backends.registry import Source

BACKEND_DEFAULT = "default: onnxruntime where installed, else torch"


def _integer(flag: str, text: str) -> int:
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a whole number; pass an integer {flag}")
    return int(value)


def at_least(flag: str, minimum: int) -> Callable[[str], int]:
    """An integer flag with a lower bound (--max-new-tokens, --branch-k, --samples, ...)."""
    def parse(text: str) -> int:
        value = _integer(flag, text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum} (got {value}); pass {flag} {minimum} "
                                             "or more")
        return value
    return parse


def between(flag: str, low: int, high: int, why: str) -> Callable[[str], int]:
    """An integer flag with both bounds, `why` saying where the upper one comes from (sizes that would
    otherwise run until stopped or exhaust the machine: --layers, --n, --steps, ...)."""
    def parse(text: str) -> int:
        value = _integer(flag, text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} {value} is outside {low}..{high} ({why}); pass {flag} "
                                             f"{low}..{high}")
        return value
    return parse


def positive(flag: str) -> Callable[[str], float]:
    """A finite number above 0 (memory budgets in GiB, seconds)."""
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a positive number; pass a finite {flag} > 0")
        return value
    return parse


def finite(flag: str, minimum: float) -> Callable[[str], float]:
    """A finite number at or above `minimum` (nan and inf are no setting; 0 can be one, as a time budget
    that stops after the first step)."""
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a finite number >= {minimum:g}; pass a finite "
                                             f"{flag} >= {minimum:g}")
        return value
    return parse


def integer(flag: str) -> Callable[[str], int]:
    """An integer flag whose range is a backend's (--max-context, --max-tree: `decode.limits.runtime_limit`)."""
    return lambda text: _integer(flag, text)


def threads(text: str) -> int:
    """`--threads`: the rule `limits.threads_problem` states for the API too."""
    value = _integer("--threads", text)
    if (problem := threads_problem("--threads", value)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def budget(text: str) -> int | str:
    """`--budget`: auto, or tree nodes besides the anchor (0: plain greedy steps)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = _integer("--budget", text)
    except argparse.ArgumentTypeError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a budget: pass auto or an integer --budget >= 0")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block before its error; here it is one line that points at --help. Every
    command and subcommand answers --version with the toolkit's version."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                          help="print the toolkit's version and exit")

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):  # argparse reads a value starting with '-' as a flag
            message += " (a value that starts with '-' goes after an '=': --flag=-value)"
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def runner_flags(p: argparse.ArgumentParser, *, backend_help: str = BACKEND_DEFAULT,
                 threads_help: str = "ONNX Runtime intra-op threads (1 up to this machine's CPUs; default: ONNX "
                                     "Runtime's own choice, one per physical core)") -> None:
    """--backend, --model, --head, --artifacts, --engines, --provider, --threads, --max-context, --max-tree."""
    p.add_argument("--backend", choices=BACKENDS, help=f"what runs the model: the torch reference, ONNX Runtime or "
                   f"TensorRT ({backend_help})")
    p.add_argument("--model", type=Path, help="target model: a HF snapshot directory (default: the embedded "
                   "glance-vl-tiny with its head)")
    p.add_argument("--head", type=Path, help="draft head directory: a GLANCE/DFlash head, or an EAGLE-3 head as "
                   "published (default: the embedded model's head where --model is not given, else none)")
    p.add_argument("--artifacts", type=Path, help="exported graphs for --backend onnxruntime (glance-export onnx; "
                   "default: the embedded model's shipped graphs where --model is not given, else none)")
    p.add_argument("--engines", type=Path, help="TensorRT engines for --backend tensorrt (glance-export build; "
                   "default: none)")
    p.add_argument("--provider", action="append", help="ONNX Runtime execution provider (cpu, cuda, tensorrt or a "
                   "full name); repeat for a priority list; CPU is the fallback (default: cpu)")
    p.add_argument("--threads", type=threads, help=threads_help)
    p.add_argument("--max-context", type=integer("--max-context"),
                   help="KV rows to allocate (default: the export's or build's bound)")
    p.add_argument("--max-tree", type=integer("--max-tree"),
                   help="largest verify pass (default: the export's or build's bound)")


def batch_flag(p: argparse.ArgumentParser, default: int) -> None:
    """--max-batch: requests decoded together (None when not given, so a command can tell a default apart)."""
    p.add_argument("--max-batch", type=at_least("--max-batch", 1), default=None,
                   help=f"requests decoded together (default {default} where the graphs were exported with batched "
                   "graphs, else 1; 1 decodes one request at a time)")


def decode_flags(p: argparse.ArgumentParser, *, max_new_tokens: int | None, budget_help: str,
                 budget_default: int | None = None, max_new_tokens_help: str | None = None) -> None:
    """--budget, --branch-k and --max-new-tokens, each with its one range rule."""
    p.add_argument("--budget", type=budget, default=budget_default, help=budget_help)
    p.add_argument("--branch-k", type=at_least("--branch-k", 1), default=BRANCH_K,
                   help=f"top-k per draft offset (default {BRANCH_K})")
    p.add_argument("--max-new-tokens", type=at_least("--max-new-tokens", 1), default=max_new_tokens,
                   help=max_new_tokens_help or f"longest answer in tokens (default {max_new_tokens})")


def seed(flag: str) -> Callable[[str], int]:
    """A sampling seed: a whole number 0..2**63-1, read exactly (a float would round a 63-bit seed)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = -1
        if not 0 <= value < SEED_LIMIT:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a whole number in 0..{SEED_LIMIT - 1}; pass "
                                             f"{flag} 0..{SEED_LIMIT - 1}")
        return value
    return parse


def sampling_flags(p: argparse.ArgumentParser, seed_flag: str = "--seed", seed_default: int | None = None,
                   seed_help: str = "the sampling seed (default: drawn, and reported, so the answer can be "
                                    "reproduced)") -> None:
    """--temperature, --top-p, --top-k, --min-p and the sampling seed (`seed_flag`, where a command's --seed means
    something else): numbers here, their ranges checked by `sampling.sampling_params` (one line naming the
    setting)."""
    p.add_argument("--temperature", type=finite("--temperature", 0.0), default=0.0,
                   help="above 0 samples at this temperature, the same tokens with the draft on or off for a seed "
                   "(default 0.0: greedy decoding)")
    p.add_argument("--top-p", type=finite("--top-p", 0.0), default=1.0,
                   help="sample from the smallest set of tokens holding this share of the probability (default 1.0: "
                   "off)")
    p.add_argument("--top-k", type=at_least("--top-k", 0), default=0, help="sample from the k likeliest tokens "
                   "(default 0: off)")
    p.add_argument("--min-p", type=finite("--min-p", 0.0), default=0.0,
                   help="drop tokens less likely than this share of the likeliest (default 0.0: off)")
    p.add_argument(seed_flag, dest="sampling_seed", type=seed(seed_flag), default=seed_default, help=seed_help)


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    """The sampling settings the flags ask for (one line naming a setting out of range)."""
    return sampling_params(args.temperature, args.top_p, args.top_k, args.min_p, args.sampling_seed)


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
