"""The server is a thin layer over the public Python API: nothing under `serve/` touches a private name
(one starting with an underscore) of another `glance_runtime` module, whether imported, read as an
attribute of another object, or fetched by `getattr`."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "runtime" / "glance_runtime" / "serve"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _reaches_outside(node: ast.ImportFrom) -> bool:
    """Whether an import from a module under serve/ names a module outside it."""
    if node.level == 0:
        return (node.module or "").startswith("glance_runtime") and not (node.module or "").startswith(
            "glance_runtime.serve")
    return node.level >= 2


def private_uses(tree: ast.AST) -> list[str]:
    """Every private name of another module a serve/ module uses: private names it imports from outside
    serve/, private modules it imports, private attributes of anything but `self` or `cls`, and
    `getattr`/`setattr`/`hasattr` with a private constant name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if _reaches_outside(node):
                found += [f"import {alias.name}" for alias in node.names if _private(alias.name)]
                if any(map(_private, parts)):
                    found.append(f"import module {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"import {alias.name}" for alias in node.names if any(map(_private, alias.name.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"attribute .{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                _private(node.args[1].value):
            found.append(f"{node.func.id}(..., {node.args[1].value!r}) (line {node.lineno})")
    return found


def test_serve_uses_only_public_names_of_the_runtime():
    files = sorted(SERVE.rglob("*.py"))
    assert len(files) >= 5  # the scan reads the server's modules, not an empty directory
    used = [f"{path.relative_to(ROOT)}: {use}" for path in files
            for use in private_uses(ast.parse(path.read_text(), str(path)))]
    assert not used, used


def test_the_scan_catches_every_way_of_reaching_a_private_name():
    code = ("from ..api import _check\n"
            "from glance_runtime.api import _Hidden\n"
            "from .._internal import thing\n"
            "import glance_runtime._internal\n"
            "def f(model):\n"
            "    model._run(1)\n"
            "    self.model._config(1)\n"
            "    return getattr(model, '_side')\n")
    assert sorted(private_uses(ast.parse(code))) == sorted([
        "import _check", "import _Hidden", "import module _internal", "import glance_runtime._internal",
        "attribute ._run (line 6)", "attribute ._config (line 7)", "getattr(..., '_side') (line 8)"])


def test_the_scan_allows_what_is_the_servers_own():
    code = ("from .engine import _Helper\n"
            "from ..api import Model, load\n"
            "class A:\n"
            "    def f(self):\n"
            "        self._state = 1\n"
            "        return self._helper(), type(self).__name__\n")
    assert private_uses(ast.parse(code)) == []
