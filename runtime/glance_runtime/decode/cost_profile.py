"""What a round costs on this device: the verify side of a round against its tree rows, and a draft pass.

`--budget auto` weighs expected tokens against these costs. They are measured, not modelled: on a GPU
a 64-row verify costs about what one row does, on a CPU or a small Jetson it costs several, and the
Python around the graphs counts as much as the graphs on a tiny model. So a measurement times real
rounds through the Backend protocol, split the way the loop splits them:
- draft: the draft pass plus building the tree from it (what a round skips by not drafting), at the full
  depth and, timed apart, at shallower depths (`depth_grid`): a graph that drafts short blocks runs its head over
  a few rows for a shallow round, so auto weighs how deep to draft as well as whether to;
- verify(T): mask, verify pass, walk and commit of a T-row tree (a plain greedy step is verify(1)).
Each row count is timed several times, interleaved, and the fastest kept (other processes only ever add
time); counts implausible against the one-row cost, wide in spread or dearer than a larger count are timed
again, and a profile still in doubt is kept provisional, with the spread and load average it was measured
at. The measurement commits one row per round (a plain greedy step), so it needs a short prompt and a few
dozen rows of context.

A profile is stored beside the artifacts or engines it was measured with (a file per backend, provider,
thread count and processor or GPU, since the same graphs cost differently elsewhere), or in the cache
when that directory is read-only, and measured again only when missing or unreadable (or asked to:
`--remeasure`); the decode's own rounds refine a stored profile (`cost_watch`).
"""
from __future__ import annotations

import hashlib
import os
import statistics
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from .backend import STEP_DRAFTERS, Backend
from .dynamic_tree import grow_dynamic
from ..store.atomic import file_format
from ..store.cache import cache_root, file_lock
from ..errors import GlanceError
from ..formats import cost as cost_format
from ..formats.cost import LARGE_SPREAD, MONOTONE_SLACK, CostProfile
from .limits import reachable_nodes
from .loop import room_left
from .tree import Tree, build_tree, fit, visibility, walk

PROBE_PROMPT = "Describe what you see in one sentence."
MIN_REPEATS, MAX_REPEATS = 3, 9  # timed rounds per row count: at least, and at most within `seconds`
RETIMES = 2  # times doubtful row counts are timed again before the profile is kept as provisional
MIN_MS = 1e-4  # the least cost a profile holds, its resolution: a cost rounded to 0 would be no cost, and whatever
# compared a later cost with it divided by zero


def kept_ms(ms: float) -> float:
    """`ms` as a profile keeps it: to its resolution, and never below it."""
    return max(round(float(ms), 4), MIN_MS)


def row_grid(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to and including max_rows: verify cost bends where the device stops being idle."""
    grid, r = [], 1
    while r < max_rows:
        grid.append(r)
        r *= 2
    return grid + [max_rows]


def measurable_rows(block_size: int, branch_k: int, max_rows: int, drafter: str = "block") -> int:
    """The largest verify a draft can fill: the anchor and every node its top-k can reach, up to max_rows."""
    return max(1, min(max_rows, 1 + reachable_nodes(block_size, branch_k, drafter)))


def depth_grid(backend: Backend) -> list[int]:
    """Draft depths whose cost is timed: 1, 2, 4, ... up to the full depth; none for a head that drafts a depth a
    pass (auto sizes its draft pass by pass) or one that drafts a single offset."""
    if backend.info.limits.drafter in STEP_DRAFTERS or backend.block_size < 3:
        return []
    return row_grid(backend.block_size - 1)


def _drafted(backend: Backend, anchor: int, branch_k: int, nodes: int, most: int, depth: int | None = None) -> Tree:
    """A round's tree of `nodes` nodes as decoding drafts it: a block draft's best `nodes` (`depth` offsets deep,
    None: all), or, from a step drafter, the prefix of the largest tree the profile times (auto grows the whole
    tree and then cuts it, so that is the draft cost auto pays)."""
    if backend.info.limits.drafter in STEP_DRAFTERS:
        return fit(grow_dynamic(anchor, backend, most, branch_k, min(backend.block_size - 1, most)), nodes + 1)
    ids, logp = backend.draft(anchor, branch_k, depth)
    return build_tree(anchor, ids, logp, nodes)


def _time_rounds(backend: Backend, prompt, grid: list[int], branch_k: int, seconds: float, depths: list[int] = ()
                 ) -> tuple[dict[int, list[float]], list[float], dict[int, list[float]], int]:
    """Timed rounds of every row count in `grid`, interleaved (the order alternates each pass, so a slow
    moment lands on several counts, not one); the first pass warms up and is not kept. Every round drafts,
    builds the tree, verifies, walks and commits the anchor alone, so the state stays a valid greedy decode.
    Each pass also drafts at every depth in `depths` (a tree of the largest count's nodes, not verified).
    Returns the verify-side ms per count, the draft ms, the draft ms per depth, and the passes kept."""
    anchor = backend.prefill(prompt).first
    room = room_left(backend)
    verify: dict[int, list[float]] = {rows: [] for rows in grid}
    draft: list[float] = []
    by_depth: dict[int, list[float]] = {depth: [] for depth in depths}
    start, repeat = time.perf_counter(), 0
    while repeat <= MIN_REPEATS or (repeat <= MAX_REPEATS and time.perf_counter() - start < seconds):
        for depth in depths if repeat % 2 else depths[::-1]:
            t0 = time.perf_counter()
            _drafted(backend, anchor, branch_k, grid[-1] - 1, grid[-1] - 1, depth)
            if repeat:
                by_depth[depth].append((time.perf_counter() - t0) * 1e3)
        order = grid if repeat % 2 else grid[::-1]
        for rows in order:
            if room is not None and room_left(backend) < rows:  # each round commits a row: start over
                anchor = backend.prefill(prompt).first
            t0 = time.perf_counter()
            tree = _drafted(backend, anchor, branch_k, rows - 1, grid[-1] - 1)
            t1 = time.perf_counter()
            argmax = backend.verify(tree.tokens, tree.depths, visibility(tree.parents)).argmax
            walk(tree, argmax)
            backend.commit(np.zeros(1, np.int64))
            t2 = time.perf_counter()
            anchor = int(argmax[0])
            if repeat:  # the first pass warms up
                draft.append((t1 - t0) * 1e3)
                verify[rows].append((t2 - t1) * 1e3)
        repeat += 1
    return verify, draft, by_depth, repeat - 1


def load_average() -> float | None:
    """The 1-minute load average, where this system reports one: how busy the machine was while measuring."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _profile(backend: Backend, grid: list[int], verify: dict[int, list[float]], latest: dict[int, list[float]],
             draft: list[float], by_depth: dict[int, list[float]], repeats: int, load: float | None) -> CostProfile:
    """The fastest of every row count's rounds (other processes only ever add time, so the fastest is the least
    disturbed), with how far the latest batch's median lay above it; each draft depth's fastest as a share of the
    full depth's, timed alike."""
    fastest = {r: max(min(verify[r]), MIN_MS) for r in grid}
    depths = sorted(by_depth)
    full = max(min(by_depth[depths[-1]]), MIN_MS) if depths else 1.0
    share = [min(max(round(min(by_depth[d]) / full, 4), MIN_MS), 1.0) for d in depths[:-1]] + [1.0] * bool(depths)
    return CostProfile(device=describe(backend), rows=tuple(grid),
                       verify_ms=tuple(kept_ms(fastest[r]) for r in grid), draft_ms=kept_ms(min(draft)),
                       repeats=repeats, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                       spread=tuple(round(statistics.median(latest[r]) / fastest[r] - 1, 3) for r in grid),
                       load_average=load, draft_depths=tuple(depths), draft_share=tuple(share))


def _doubtful(found: CostProfile) -> list[int]:
    """Row counts to time again: implausible against one row, wide in spread, or dearer than a larger count."""
    rows = found.rows
    dearer = {r for i, r in enumerate(rows)
              if any(found.verify_ms[i] > later * MONOTONE_SLACK for later in found.verify_ms[i + 1:])}
    return [r for r, ms, s in zip(rows, found.verify_ms, found.spread)
            if (r > 1 and ms > found.plausible_ms(r)) or s > LARGE_SPREAD or r in dearer]


def measure(backend: Backend, prompt, max_rows: int, branch_k: int, seconds: float = 2.0,
            progress: Callable[[str], None] = lambda _: None) -> CostProfile:
    """Time real rounds of every row count in `row_grid(max_rows)` (capped by what one draft can fill), keeping
    the fastest of each. Counts in doubt (`_doubtful`: a busy moment) are timed again with one row, RETIMES
    times at most; a profile still in doubt then is kept provisional, implausible counts at the plausible
    bound, and the decode's own rounds refine it (`cost_watch`)."""
    if backend.block_size < 2:
        raise GlanceError("a cost profile needs a draft head (block size 1 here); pass --head or artifacts "
                          "exported with one")
    limit = backend.info.limits.max_context
    if limit is not None and prompt.length >= limit:  # the probe's head leaves a row to verify: costs, not text
        prompt = replace(prompt, input_ids=prompt.input_ids[:max(1, limit - 1)])
    backend.prefill(prompt)
    room = room_left(backend)  # a small --max-context bounds the passes that can be timed, after the prompt
    grid = row_grid(measurable_rows(backend.block_size, branch_k, max_rows if room is None else min(max_rows, room),
                                    backend.info.limits.drafter))
    depths = depth_grid(backend)
    deep = f" and drafts {', '.join(map(str, depths))} deep" if depths else ""
    progress(f"measuring round costs for {', '.join(map(str, grid))} verify rows{deep}")
    load = load_average()
    verify, draft, by_depth, repeats = _time_rounds(backend, prompt, grid, branch_k, seconds, depths)
    latest = dict(verify)
    found = _profile(backend, grid, verify, latest, draft, by_depth, repeats, load)
    for _ in range(RETIMES):
        doubtful = _doubtful(found)
        if not doubtful:
            return found
        progress(f"{'; '.join(found.problems())}: timing {', '.join(map(str, sorted({1, *doubtful})))} rows again")
        again, more, _, _ = _time_rounds(backend, prompt, sorted({1, *doubtful}), branch_k, seconds / 2)
        for r, times in again.items():
            verify[r], latest[r] = verify[r] + times, times
        found = _profile(backend, grid, verify, latest, draft + more, by_depth, repeats, load)
    if not _doubtful(found):
        return found
    progress(f"{'; '.join(found.problems())} again: kept as provisional (decoding refines it from its own rounds)")
    return replace(found, provisional=True, verify_ms=tuple(min(ms, kept_ms(found.plausible_ms(r)))
                                                            for r, ms in zip(found.rows, found.verify_ms)))


def describe(backend: Backend) -> str:
    """The backend as far as its costs go: name, provider, threads, and the processor or GPU it runs on."""
    info = backend.info
    return ", ".join([backend.name, *info.providers[:1], f"{info.threads or 'default'} threads", info.hardware])


def profile_path(home: Path | None, identity: str, device: str) -> Path:
    """Beside the artifacts or engines (`home`) when that directory is writable and the name is free or holds
    a cost profile, else in the cache under what is served (`identity`): a file no glance command wrote is
    never replaced."""
    tag = hashlib.sha256(device.encode()).hexdigest()[:12]
    beside = home / f"cost-profile-{tag}.json" if home is not None else None
    if beside is not None and os.access(home, os.W_OK) and (not os.path.lexists(beside) or (
            beside.is_file() and not beside.is_symlink() and file_format(beside) == cost_format.FORMAT)):
        return beside
    place = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return cache_root() / "cost" / f"{place}-{tag}.json"


def load(path: Path) -> CostProfile | None:
    """The stored profile, or None where there is none (or it is damaged: it is then measured again)."""
    try:
        return cost_format.read(path)
    except GlanceError:
        return None


def save(profile: CostProfile, path: Path) -> None:
    cost_format.write(path, profile)


def _blocked(path: Path) -> str | None:
    """Why `path` cannot hold a file of ours (something else sits there), or None."""
    if os.path.lexists(path) and not path.is_file():
        return f"{path} is {'a directory' if path.is_dir() else 'not a regular file'}"
    return None


def stored_or_measured(backend: Backend, home: Path | None, identity: str, prompt_for: Callable[[], object],
                       max_rows: int, branch_k: int, remeasure: bool = False,
                       progress: Callable[[str], None] = lambda _: None) -> tuple[CostProfile, Path | None]:
    """The profile for this backend and device and where it is stored: loaded, or measured once and stored (under
    a lock, so two first uses measure once and never time each other's passes). A stored one that covers fewer
    rows than `max_rows` is measured again. Where something other than a file sits at the profile's or its
    lock's place, or neither can be written, the profile is measured and kept in memory for this run (path
    None), said in one line: decoding goes on. One stored before drafts were timed by depth is measured again
    where this backend's draft has depths to weigh."""
    path = profile_path(home, identity, describe(backend))
    max_rows = measurable_rows(backend.block_size, branch_k, max_rows, backend.info.limits.drafter)
    depths = bool(depth_grid(backend))

    def covers(found: CostProfile | None) -> bool:
        return found is not None and found.max_rows >= max_rows and (bool(found.draft_depths) or not depths)

    found = None if remeasure else load(path)
    if covers(found):
        return found, path
    lock = path.with_name(f".{path.name}.lock")
    with ExitStack() as held:
        reason = _blocked(path) or _blocked(lock)
        if reason is None:
            try:
                held.enter_context(file_lock(lock))
            except GlanceError as exc:
                reason = str(exc)
        found = None if remeasure or reason else load(path)
        if covers(found):
            return found, path
        found = measure(backend, prompt_for(), max_rows, branch_k, progress=progress)
        if found.max_rows < max_rows:  # cut short by a small --max-context: good for this run only
            return found, None
        if reason is None:
            try:
                save(found, path)
            except GlanceError as exc:
                reason = str(exc)
        if reason is not None:
            progress(f"cost profile kept in memory for this run only: {reason}")
            return found, None
        progress(f"cost profile stored in {path}")
    return found, path
