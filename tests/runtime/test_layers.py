"""The package layers: the runtime never imports the export side, and imports whole on an edge install."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from support import BLOCK_TRAINING_STACK

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime" / "glance_runtime"


def _imported(tree: ast.AST) -> list[str]:
    """Every module an import statement names, at any depth (inside functions, branches, try blocks)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names.append(str(node.args[0].value))
    return names


@pytest.mark.edge
def test_no_runtime_module_imports_the_export_package():
    upward = [f"{path.relative_to(ROOT)}: {name}" for path in sorted(RUNTIME.rglob("*.py"))
              for name in _imported(ast.parse(path.read_text(), str(path)))
              if name.split(".")[0] == "glance_export"]
    assert not upward, upward


@pytest.mark.edge
def test_the_scan_sees_nested_and_dynamic_imports():
    code = "def f():\n    try:\n        from glance_export.x import y\n    except ImportError:\n        pass\n" \
           "import importlib\nimportlib.import_module('glance_export.onnx')\n"
    assert sorted(_imported(ast.parse(code))) == ["glance_export.onnx", "glance_export.x", "importlib"]


def _edge_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-c", BLOCK_TRAINING_STACK + code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.edge
def test_every_runtime_module_imports_without_torch_or_the_export_package():
    modules = sorted(".".join(p.relative_to(RUNTIME.parent).with_suffix("").parts).removesuffix(".__init__")
                     for p in RUNTIME.rglob("*.py") if p.stem != "plots")  # plots needs matplotlib (bench extra)
    proc = _edge_python(f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
                        "print('imported', len(sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert "imported" in proc.stdout


def test_the_export_package_registers_what_the_runtime_asks_for():
    """Installed metadata declares both entry points, and each loads the export package's own function."""
    from glance_export.onnx import export_artifacts
    from glance_export.model.torch_backend import open_reference
    from glance_runtime.backends.extensions import EXPORT, GROUP, REFERENCE

    found = {ep.name: ep.load() for ep in entry_points(group=GROUP)}
    assert found.get(REFERENCE) is open_reference and found.get(EXPORT) is export_artifacts, \
        "entry points missing: reinstall the toolkit (pip install -e .)"


@pytest.mark.edge
def test_torch_backend_without_the_export_stack_is_a_one_line_fix():
    proc = _edge_python("from glance_runtime.cli.run import main\nsys.exit(main(['--backend', 'torch', '--no-spec', "
                        "'--prompt', 'hi']))")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "needs the export extra" in lines[0] and "pip install" in lines[0]
