"""What a training run leaves beside its head: `metrics.jsonl` (a line per logged step: loss, per-offset top-1
accuracy, learning rate, samples/s, and held-out tau and acceptance where measured) and the head's card
(`README.md`: target, data, steps, held-out tau). Both are written into the head directory with every save,
in the same rename as the weights, so a resumed run continues its own log.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

METRICS = "metrics.jsonl"
CARD = "README.md"


def duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class RunLog:
    def __init__(self, out_dir: Path, resumed_at: int):
        """The log of the run in `out_dir` up to `resumed_at` (nothing for a fresh run)."""
        self.records: list[dict[str, Any]] = []
        path = Path(out_dir) / METRICS
        if resumed_at and path.is_file():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record.get("step", 0) <= resumed_at:
                    self.records.append(record)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def last_eval(self) -> dict[str, Any] | None:
        return next((r["held_out"] for r in reversed(self.records) if "held_out" in r), None)

    def files(self, card: str) -> Callable[[Path], None]:
        """A `save_head(also=...)` callback writing the log and the card."""
        def write(directory: Path) -> None:
            (directory / METRICS).write_text("".join(json.dumps(r) + "\n" for r in self.records))
            (directory / CARD).write_text(card)
        return write


def data_lines(paths: list[Path]) -> list[str]:
    """`name (sha256 prefix)` of each data file, so a card names exactly what it was trained on."""
    return [f"`{Path(p).name}` (sha256 {hashlib.sha256(Path(p).read_bytes()).hexdigest()[:12]})" for p in paths]


def card(target: Path, data: list[str], done: int, steps: int, settings: dict[str, Any], sequences: int,
         held_out: dict[str, Any] | None, eval_data: Path | None, kind: str = "GLANCE") -> str:
    lines = [f"# {kind} draft head for `{Path(target).name}`", "",
             f"Trained with `glance-export train-head` on the target's own greedy answers to {sequences} sequences.",
             "", "## Data", "", *(f"- {d}" for d in data), "", "## Training", "",
             f"- steps: {done} of {steps}", *(f"- {k}: {v}" for k, v in sorted(settings.items()) if v is not None), ""]
    if held_out is not None:
        lines += ["## Held-out acceptance", "", f"On `{Path(eval_data).name}` with the torch reference's draft/verify "
                  "loop (tau counts the bonus token; AR decoding has tau 1):", "",
                  *(f"- tau at budget {b}: {t:.2f}" for b, t in held_out["tau"].items()),
                  f"- share of drafted rounds accepting offset 1..{len(held_out['accept'])}: "
                  f"{', '.join(f'{a:.2f}' for a in held_out['accept'])}", ""]
    return "\n".join(lines)


class Bar:
    """A progress bar with ETA on a terminal (tqdm), nothing when stderr is a file or another process's pipe."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        self.t0, self.first = time.time(), initial
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def eta(self, step: int, total: int) -> str:
        rate = (step - self.first) / max(1e-9, time.time() - self.t0)
        return duration((total - step) / rate) if rate else "?"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
