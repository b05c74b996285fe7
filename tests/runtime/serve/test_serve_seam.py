"""The server is a thin layer over the public Python API: nothing under `serve/` touches a private name
(one starting with an underscore) of another `glance_runtime` module, whether imported, read as an
attribute of another object, or fetched by `getattr`; and the public calls it is made of (`Model.reuse`,
`check_room`, `budget`) do what it relies on."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import glance_runtime as gr

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

ROOT = Path(__file__).resolve().parents[3]
SERVE = ROOT / "runtime" / "glance_runtime" / "serve"
RECEIPT = ROOT / "examples" / "demo" / "receipt.png"
CHART = ROOT / "examples" / "demo" / "chart.png"


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


# -- the public calls the server is made of ------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    with gr.load(threads=1) as m:
        yield m


def _turn(text: str, image: Path | None = None) -> dict:
    parts = [{"type": "text", "text": text}]
    if image is not None:
        with Image.open(image) as img:
            parts.insert(0, {"type": "image", "image": img.convert("RGB")})
    return {"role": "user", "content": parts}


def test_reuse_decodes_generates_tokens_and_prefills_only_a_new_turn(model):
    rows = model.reuse()
    first = [_turn("What is the total?", RECEIPT)]
    alone = rows.decode(model.build(messages=first))
    assert alone.stats["prefill_tokens"] == alone.stats["prompt_tokens"]  # nothing kept yet
    again = rows.decode(model.build(messages=first))
    assert again.token_ids == alone.token_ids and again.stats["prefill_tokens"] == 1  # all but the last prompt row
    longer = [*first, {"role": "assistant", "content": alone.text}, _turn("Is it more than 30?")]
    follow = rows.decode(model.build(messages=longer), max_new_tokens=12)
    assert follow.stats["prefill_tokens"] < follow.stats["prompt_tokens"] - 16  # the image and first turn kept
    assert alone.token_ids == model.generate(messages=first).token_ids
    assert follow.token_ids == model.generate(messages=longer, max_new_tokens=12).token_ids
    after = rows.decode(model.build(messages=first))  # generate changed the backend's rows: nothing is kept
    assert after.stats["prefill_tokens"] == after.stats["prompt_tokens"] and after.token_ids == alone.token_ids


def test_another_image_of_the_same_size_is_not_taken_for_the_kept_one(model):
    rows = model.reuse()
    with Image.open(RECEIPT) as img:
        receipt = img.convert("RGB")
    other = receipt.transpose(Image.Transpose.FLIP_LEFT_RIGHT)  # same grid, same tokens, other pixels
    ask = lambda image: [{"role": "user", "content": [{"type": "image", "image": image},  # noqa: E731
                                                      {"type": "text", "text": "What is the total?"}]}]
    rows.decode(model.build(messages=ask(receipt)))
    flipped = rows.decode(model.build(messages=ask(other)))
    assert flipped.token_ids == model.generate(messages=ask(other)).token_ids
    image_start = int(np.argmax(model.build(messages=ask(other)).input_ids == model.runner.conversations.image_token_id))
    assert flipped.stats["prefill_tokens"] == flipped.stats["prompt_tokens"] - image_start


def test_a_cancelled_decode_stops_at_a_round_and_leaves_the_rows_consistent(model):
    rows = model.reuse()
    messages = [_turn("Describe this.", CHART)]
    prompt = model.build(messages=messages)
    rounds = []
    cut = rows.decode(prompt, cancelled=lambda: rounds.append(1) or len(rounds) >= 1)
    full = model.generate(messages=messages)
    assert cut.stats["finish"] == "cancelled" and len(rounds) == 1
    assert 0 < len(cut.token_ids) < len(full.token_ids) and full.token_ids[:len(cut.token_ids)] == cut.token_ids
    rows.decode(prompt, cancelled=lambda: True)
    after = rows.decode(prompt)  # keeps what the cancelled decode committed
    assert after.token_ids == full.token_ids and after.stats["finish"] == full.stats["finish"]
    assert after.stats["prefill_tokens"] < after.stats["prompt_tokens"]


def test_check_room_refuses_with_the_callers_fix_and_budget_is_what_decodes_use(model):
    prompt = model.build("What is the total?")
    model.check_room(prompt, 8)
    with pytest.raises(gr.LimitError, match="context rows .* ask for less"):
        model.check_room(prompt, 10 ** 6, fix="ask for less")
    assert model.budget == model.generate("Hi", max_new_tokens=2).stats["budget"]
