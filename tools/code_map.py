"""The code's shape in numbers: files and lines per package, and which package imports which.

    python tools/code_map.py            # tables for a reader
    python tools/code_map.py --json     # the same as JSON, to diff two revisions

Imports are read with `ast` (every `import` and `from ... import`, at any indentation), so a lazy import
inside a function counts as much as one at the top. An edge from `glance_runtime` to `glance_export`
runs against the layering (the runtime is the ground floor) and is printed as such. A cycle among the
modules (a package's `__init__` counting as a module, an import under `TYPE_CHECKING` as much as any other)
is printed with its path and fails the run, as the upward edge does.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"glance_runtime": REPO / "runtime" / "glance_runtime", "glance_export": REPO / "glance_export"}
ELSEWHERE = {"tests": REPO / "tests", "benchmarks": REPO / "benchmarks", "tools": REPO / "tools"}


def package_of(module: str) -> str:
    """`glance_runtime.bench.report` -> `glance_runtime.bench`; top-level modules stay with their root."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def module_name(root: str, path: Path) -> str:
    rel = path.relative_to(ROOTS[root]).with_suffix("")
    parts = [root, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str, modules: frozenset[str] = frozenset()) -> set[str]:
    """Absolute names of the project modules that `path` imports; `from package import name` names the
    submodule where `name` is one of `modules`, else the package."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.update(f"{name}.{alias.name}" if f"{name}.{alias.name}" in modules else name
                         for alias in node.names)
    return {name for name in found if name.split(".")[0] in ROOTS}


def module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, for every module of both packages."""
    paths = {module_name(root, path): path for root, folder in ROOTS.items() for path in sorted(folder.rglob("*.py"))}
    names = frozenset(paths)
    return {module: {t for t in imports(path, module, names) if t in names and t != module}
            for module, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle per strongly connected group of modules (Tarjan's algorithm), each as a path that
    starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_within(graph, group) for group in groups]


def _path_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module, staying inside the group (breadth first)."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        step = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came:
                    came[nxt] = node
                    step.append(nxt)
        frontier = step
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def survey() -> dict:
    files: Counter = Counter()
    lines: Counter = Counter()
    edges: dict[str, set[str]] = defaultdict(set)
    upward: list[str] = []
    for root, folder in ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            module = module_name(root, path)
            package = package_of(module)
            files[package] += 1
            lines[package] += len(path.read_text().splitlines())
            for target in imports(path, module):
                other = package_of(target)
                if other != package:
                    edges[package].add(other)
                if root == "glance_runtime" and target.split(".")[0] == "glance_export":
                    upward.append(f"{path.relative_to(REPO)} imports {target}")
    for name, folder in ELSEWHERE.items():
        for path in sorted(folder.rglob("*.py")):
            files[name] += 1
            lines[name] += len(path.read_text().splitlines())
    return {"packages": {p: {"files": files[p], "lines": lines[p]} for p in sorted(files)},
            "imports": {p: sorted(edges[p]) for p in sorted(edges)}, "upward": upward,
            "cycles": [" -> ".join(cycle) for cycle in cycles(module_graph())]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    data = survey()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    width = max(map(len, data["packages"]))
    print(f"{'package':<{width}}  files  lines")
    for name, row in data["packages"].items():
        print(f"{name:<{width}}  {row['files']:>5}  {row['lines']:>5}")
    print("\nimports (package -> packages it uses)")
    for name, targets in data["imports"].items():
        print(f"{name:<{width}}  -> {', '.join(targets)}")
    print("\nimports against the layering (glance_runtime -> glance_export):",
          "none" if not data["upward"] else "")
    for line in data["upward"]:
        print(f"  {line}")
    print("\nimport cycles:", "none" if not data["cycles"] else "")
    for line in data["cycles"]:
        print(f"  {line}")
    return 1 if data["upward"] or data["cycles"] else 0


if __name__ == "__main__":
    sys.exit(main())
