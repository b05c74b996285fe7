"""Argument errors in the same one-line form as every other refusal of the commands, and the one wrapper
that turns a command's refusals and Ctrl-C into that line and an exit code."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

from .errors import GlanceError, check_stdout, machine_failure, silence_stdout


class OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block before its error; here it is one line that points at --help."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def parse_budget(text: str) -> int | str:
    """`--budget` values: "auto" or an integer >= 0."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a budget: pass auto or an integer --budget >= 0")
    return value


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
