"""Progress on stderr: tqdm's bar where it is installed, else one line per prompt (the edge install has no tqdm)."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.bar = total, 0, None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, unit="prompt", file=sys.stderr, dynamic_ncols=True)

    def step(self, note: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {note}", file=sys.stderr, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
