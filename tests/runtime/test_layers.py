"""The package layers: the runtime never imports the export side, and imports whole on an edge install."""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from support import BLOCK_TRAINING_STACK

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime" / "glance_runtime"
CODE_MAP = ROOT / "tools" / "code_map.py"


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


def _code_map():
    spec = importlib.util.spec_from_file_location("code_map", CODE_MAP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.edge
def test_neither_package_has_an_import_cycle():
    """code_map reads every import of both packages (inside functions and under TYPE_CHECKING too) and fails
    naming any cycle among their modules, package __init__ files included."""
    proc = subprocess.run([sys.executable, str(CODE_MAP)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "import cycles: none" in proc.stdout, proc.stdout


@pytest.mark.edge
def test_the_cycle_check_names_a_cycle_through_an_init_and_a_type_checking_import(tmp_path):
    code_map = _code_map()
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "p.c": {"p.a"}, "p.d": {"p.e"}, "p.e": {"p.d"}}
    assert code_map.cycles(graph) == [["p", "p.a", "p.b", "p"], ["p.d", "p.e", "p.d"]]
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from glance_runtime.decode import loop\ndef f():\n    from .. import errors\n")
    found = code_map.imports(module, "glance_runtime.decode.m",
                             frozenset({"glance_runtime.decode.loop", "glance_runtime.errors"}))
    assert found == {"glance_runtime.decode.loop", "glance_runtime.errors"}


@pytest.mark.edge
def test_a_sub_module_imports_without_the_api():
    """The package loads its API on first use: the pure modules import without Pillow or the backends."""
    proc = _edge_python("import glance_runtime.decode.tree, glance_runtime\n"
                        "print(sorted(m for m in ('PIL', 'glance_runtime.api', 'tokenizers') if m in sys.modules))\n"
                        "print(glance_runtime.__version__, glance_runtime.load.__module__)")
    assert proc.returncode == 0, proc.stderr
    loaded, version = proc.stdout.splitlines()
    assert loaded == "[]" and version.endswith("glance_runtime.api"), proc.stdout
