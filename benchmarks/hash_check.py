"""What checking an export's hashes costs on load: the first load (every file hashed) against a
stamped one (only stat calls), on the shipped default graphs or any artifacts directory.

    python benchmarks/hash_check.py [ARTIFACTS] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.formats.artifacts import read as load_manifest


def timed(artifacts: Path) -> float:
    t0 = time.perf_counter()
    load_manifest(artifacts)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="?", type=Path, default=DEFAULT_ARTIFACTS)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    size = sum(f.stat().st_size for f in args.artifacts.iterdir() if f.is_file())
    first, stamped = [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as cache:
            os.environ["GLANCE_CACHE"] = cache  # an empty stamp cache: every file is hashed
            first.append(timed(args.artifacts))
            stamped.append(min(timed(args.artifacts) for _ in range(5)))
    print(f"{args.artifacts} ({size / 1e6:.1f} MB): first load {min(first):.2f} ms (all files hashed, "
          f"{size / 1e6 / (min(first) / 1e3):.0f} MB/s), stamped load {min(stamped):.2f} ms")


if __name__ == "__main__":
    main()
