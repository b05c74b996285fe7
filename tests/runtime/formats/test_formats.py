"""The on-disk formats, read as an adversarial user writes them: task files, round logs, artifacts and
engine manifests. Whatever the bytes or the JSON, reading gives the right values or one GlanceError line,
never another exception. Property-based (hypothesis) over the bytes, the JSON values and the fields."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import glance_export
import glance_runtime
from glance_runtime.errors import GlanceError
from glance_runtime.formats import artifacts, engines, rounds, tasks
from glance_runtime.formats.common import MAX_DEPTH, parse

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

DEFAULT_ARTIFACTS = Path(__file__).parents[3] / "models" / "glance-vl-tiny-onnx"
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _one_line(exc: GlanceError) -> None:
    assert str(exc) and "\n" not in str(exc) and "Traceback" not in str(exc)


def test_one_version_for_the_package():
    from importlib.metadata import version

    assert glance_runtime.__version__ == glance_export.__version__ == version("glance-toolkit")


# --- task files -------------------------------------------------------------------------------------

def _tasks(tmp_path: Path, *lines: str | bytes) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def _refused(path: Path, match: str, **kw) -> str:
    with pytest.raises(GlanceError, match=match) as err:
        tasks.read(path, **kw)
    _one_line(err.value)
    return str(err.value)


def test_task_rows_read_with_every_field(tmp_path):
    path = _tasks(tmp_path, '\ufeff{"prompt": "What?", "image": "a.png", "kind": "receipt", "answer": "7"}\r',
                  "", '{"prompt": "Two?", "answers": ["2", "two"]}')
    first, second = tasks.read(path, need_answers=True)
    assert first == tasks.Task("What?", tmp_path / "a.png", "receipt", "7", ("7",))
    assert second == tasks.Task("Two?", None, None, None, ("2", "two"))


def test_task_rows_round_trip(tmp_path):
    rows = [tasks.Task("What is shown?", tmp_path / "images" / "x.png", "scene", "a circle", ("a circle",)),
            tasks.Task("Say hi", None, None, None, ("hi", "hello")), tasks.Task("Bare")]
    assert tasks.read(tasks.write(tmp_path / "t.jsonl", rows)) == rows
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["image"] == "images/x.png"


@pytest.mark.parametrize("line,match", [
    ('{"prompt": 5}', r'tasks.jsonl:1: "prompt" is 5; it must be a string'),
    ('{"image": "a.png"}', 'the "prompt" field is missing'),
    ('{"prompt": "ok", "image": 12}', '"image" is 12; it must be a string'),
    ('{"prompt": "ok", "image": ["a.png"]}', r'"image" is \[\'a.png\'\]'),
    ('{"prompt": "ok", "image": "a\\u0000.png"}', "NUL"),
    ('{"prompt": "\\ud800"}', "lone surrogate"),
    ('{"prompt": "ok", "image": "\\udfff.png"}', "lone surrogate"),
    ('{"prompt": "ok", "kind": {"a": 1}}', '"kind" is'),
    ('{"prompt": "ok", "answers": "7"}', '"answers" must be a list of strings'),
    ('{"prompt": "ok", "answers": [7]}', r'"answers"\[0\] is 7'),
    ('{"prompt": ' + "[" * 10000 + "]" * 10000 + "}", "nested too deeply"),
    ('{"prompt": "ok", "x": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}", "nested too deeply"),
    ('{"prompt": NaN}', "NaN is not a JSON number"),
    ('{"prompt": "ok", "n": ' + "9" * 5000 + "}", "not valid JSON"),
    ('["prompt"]', "tasks.jsonl:1 is a JSON array, not an object"),
    ('"prompt"', "is a JSON string, not an object"),
    ('{"prompt": "cut', r"tasks.jsonl:1 is not valid JSON"),
])
def test_bad_task_rows_are_one_line_with_file_and_line(tmp_path, line, match):
    assert "glance-export corpus" in _refused(_tasks(tmp_path, line), match) or "UTF-8" in match


def test_task_file_encoding_and_kind_of_path(tmp_path):
    _refused(_tasks(tmp_path, b'{"prompt": "\xff"}'), r"tasks.jsonl:1 is not valid UTF-8")
    _refused(tmp_path / "none.jsonl", "does not exist")
    _refused(tmp_path, "is a directory, not a file")
    _refused(_tasks(tmp_path, "", "  "), "has no tasks")


def test_scoring_needs_an_answer_on_every_row(tmp_path):
    path = _tasks(tmp_path, '{"prompt": "a", "answer": "1"}', '{"prompt": "b"}')
    assert len(tasks.read(path)) == 2
    _refused(path, r'tasks.jsonl:2 has no "answer"', need_answers=True)


@PROPERTY
@given(data=st.binary(max_size=400))
def test_any_bytes_as_a_task_file(tmp_path, data):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    try:
        read = tasks.read(path)
    except GlanceError as exc:
        _one_line(exc)
        return
    assert read and all(isinstance(t.prompt, str) for t in read)


@PROPERTY
@given(rows=st.lists(st.dictionaries(st.sampled_from(["prompt", "image", "kind", "answer", "answers", "x"]),
                                     json_values, max_size=5), min_size=1, max_size=4))
def test_any_json_rows_as_a_task_file(tmp_path, rows):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        read = tasks.read(path)
    except GlanceError as exc:
        _one_line(exc)
        return
    for row, task in zip(rows, read):
        assert task.prompt == row["prompt"]
        assert task.image == (path.parent / row["image"] if row.get("image") else None)
        (task.prompt + (task.kind or "") + "".join(task.answers)).encode("utf-8")


# --- round logs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("line,match", [
    ('{"entropy": "0.1", "accepted": 2}', 'rounds.jsonl:1 needs a finite numeric "entropy"'),
    ('{"entropy": NaN, "accepted": 2}', "needs a finite"),
    ('{"entropy": 0.1, "accepted": 0}', "at least 1"),
    ('{"entropy": 0.1, "accepted": true}', "needs a finite"),
    ("[1]", "is a JSON array"),
])
def test_bad_round_rows(tmp_path, line, match):
    path = tmp_path / "rounds.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(GlanceError, match=match) as err:
        rounds.read(path)
    _one_line(err.value)


def test_round_log_round_trip(tmp_path):
    rows = [{"kind": "chart", "mode": "tree-7", "entropy": 0.25, "accepted": 3, "surprisal": None}]
    rounds.write(tmp_path / "rounds.jsonl", rows)
    assert rounds.read(tmp_path / "rounds.jsonl") == rows


@PROPERTY
@given(data=st.binary(max_size=300))
def test_any_bytes_as_a_round_log(tmp_path, data):
    path = tmp_path / "rounds.jsonl"
    path.write_bytes(data)
    try:
        assert rounds.read(path)
    except GlanceError as exc:
        _one_line(exc)


# --- artifacts manifest -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped_raw() -> dict:
    return json.loads((DEFAULT_ARTIFACTS / "manifest.json").read_text())


@pytest.fixture(scope="module")
def linked(tmp_path_factory) -> Path:
    """The shipped export's files linked into a directory of its own, so its manifest can be rewritten."""
    out = tmp_path_factory.mktemp("linked")
    for p in DEFAULT_ARTIFACTS.iterdir():
        if p.name != "manifest.json":
            (out / p.name).symlink_to(p.resolve())
    return out


def test_the_shipped_manifest_is_this_format(shipped_raw):
    assert (shipped_raw["format"], shipped_raw["format_version"]) == (artifacts.FORMAT, artifacts.VERSION)
    m = artifacts.read(DEFAULT_ARTIFACTS)
    assert m.stop_token_ids == tuple(shipped_raw["stop_token_ids"]) and m.branch_k == shipped_raw["branch_k"]


def _paths(value, prefix=()):
    """Every (path, value) inside a JSON document, shallow ones first."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _set(doc, path, value):
    for key in path[:-1]:
        doc = doc[key]
    if value is _DELETE:
        del doc[path[-1]]
    else:
        doc[path[-1]] = value


_DELETE = object()


@PROPERTY
@given(data=st.data())
def test_any_field_of_a_manifest_written_with_its_hash(linked, shipped_raw, data):
    raw = json.loads(json.dumps(shipped_raw))
    paths = [p for p in _paths(raw) if p[0] not in ("format", "format_version", "content_sha256")]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        try:
            _set(raw, path, data.draw(json_values | st.just(_DELETE)))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed or replaced its parent
    raw = json.loads(json.dumps(raw))  # as a file holds it: an index set into a dict that replaced a list is a str key
    artifacts.write(linked, raw)
    try:
        m = artifacts.read(linked)
    except GlanceError as exc:
        _one_line(exc)
        return
    assert m.branch_k == raw["branch_k"] and m.stop_token_ids == tuple(raw["stop_token_ids"])
    assert m.max_tree < m.max_context == raw["limits"]["max_context"]
    assert 0 <= m.mask_token_id < m.vocab_size and m.block_size >= 1


@PROPERTY
@given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_as_a_manifest(linked, data):
    (linked / "manifest.json").write_bytes(data)
    with pytest.raises(GlanceError) as err:
        artifacts.read(linked)
    _one_line(err.value)


# --- engines manifest -------------------------------------------------------------------------------

def _engines_doc() -> dict:
    return {"toolkit_version": "0.1.0", "target": "rtx", "tensorrt": {"module": "tensorrt_rtx", "version": "1.2"},
            "device": {"name": "ahead-of-time, no GPU", "compute_capability": None,
                       "runs_on_compute_capabilities": ["8.6", "8.9"]},
            "precision": {"name": "fp16"}, "limits": {"max_context": 256, "max_tree": 32, "max_batch": 4},
            "artifacts": {"path": "/x", "manifest_sha256": "ab"},
            "engines": {"target": {"file": "target.engine", "bytes": 4, "sha256": "cd"}}}


def test_engines_record_round_trip(tmp_path):
    engines.write(tmp_path, _engines_doc())
    record = engines.read(tmp_path)
    assert (record.module, record.max_context, record.max_tree, record.precision) == ("tensorrt_rtx", 256, 32, "fp16")
    assert record.compute_capabilities == ("8.6", "8.9")
    assert [e.file for e in record.engines["target"]] == ["target.engine"]


def _parts_doc() -> dict:
    doc = _engines_doc()
    doc["engines"]["target"] = {"parts": [
        {"file": "target.part1.engine", "bytes": 4, "sha256": "a", "inputs": ["x"], "outputs": ["h"]},
        {"file": "target.part2.engine", "bytes": 5, "sha256": "b", "inputs": ["h", "x"], "outputs": ["y"]}]}
    return doc


def test_a_graph_built_in_parts_is_read_in_run_order(tmp_path):
    engines.write(tmp_path, _parts_doc())
    parts = engines.read(tmp_path).engines["target"]
    assert [(p.file, p.inputs, p.outputs) for p in parts] == [("target.part1.engine", ("x",), ("h",)),
                                                              ("target.part2.engine", ("h", "x"), ("y",))]


@pytest.mark.parametrize("change,match", [
    (lambda d: d["engines"]["target"].update(parts=[]), r"engines\.target\.parts must be a non-empty list"),
    (lambda d: d["engines"]["target"]["parts"][1].pop("inputs"), r"engines\.target\.parts\[1\]\.inputs must be"),
    (lambda d: d["engines"]["target"]["parts"][0].update(outputs=[3]), r"parts\[0\]\.outputs\[\] is 3"),
    (lambda d: d["engines"]["target"]["parts"][1].update(file="target.part1.engine"), "name one file twice"),
    (lambda d: d["engines"]["target"]["parts"][0].update(file="../x"), "must name a file in the engines"),
])
def test_bad_parts_are_one_line(tmp_path, change, match):
    doc = _parts_doc()
    change(doc)
    engines.write(tmp_path, doc)
    with pytest.raises(GlanceError, match=match) as err:
        engines.read(tmp_path)
    _one_line(err.value)


def test_records_of_another_version_are_refused_naming_the_rebuild(tmp_path):
    """Version 3 engines read a past of their own and batched rounds had engines of their own: neither runs the
    graphs of today, so they are refused, as a newer record is."""
    from glance_runtime.formats.common import stamped

    for version, match in ((3, "format v3, an older format than the v4 this toolkit reads; rebuild"),
                           (5, "format v5, a newer format than the v4 this toolkit reads"),
                           (2, "format v2, an older format")):
        doc = stamped(_engines_doc(), engines.FORMAT, version, engines.HASH_FIELD)
        (tmp_path / engines.FILE).write_text(json.dumps(doc))
        with pytest.raises(GlanceError, match=match) as err:
            engines.read(tmp_path)
        _one_line(err.value)


def test_a_record_without_its_batch_bound_is_refused(tmp_path):
    doc = _engines_doc()
    del doc["limits"]["max_batch"]
    engines.write(tmp_path, doc)
    with pytest.raises(GlanceError, match="limits.max_batch is missing; rebuild") as err:
        engines.read(tmp_path)
    _one_line(err.value)


@pytest.mark.parametrize("change,match", [
    (lambda d: d["precision"].update(name="fp32"), None),
    (lambda d: d["limits"].update(max_tree=0), "limits.max_tree is 0"),
    (lambda d: d["limits"].update(max_context="256"), "limits.max_context is '256'"),
    (lambda d: d["engines"]["target"].update(file="../target.engine"), "must name a file in the engines"),
    (lambda d: d.update(engines={}), "engines lists no engine"),
    (lambda d: d["tensorrt"].update(module="os"), "tensorrt.module is 'os'"),
])
def test_engines_record_edits(tmp_path, change, match):
    doc = _engines_doc()
    engines.write(tmp_path, doc)
    raw = json.loads((tmp_path / engines.FILE).read_text())
    change(raw)
    (tmp_path / engines.FILE).write_text(json.dumps(raw))
    with pytest.raises(GlanceError, match="was edited after the build"):
        engines.read(tmp_path)
    if match:
        change(doc)
        engines.write(tmp_path, doc)
        with pytest.raises(GlanceError, match=match) as err:
            engines.read(tmp_path)
        _one_line(err.value)


@PROPERTY
@given(data=st.data())
def test_any_field_of_an_engines_record(tmp_path, data):
    doc = _engines_doc()
    paths = list(_paths(doc))
    _set(doc, data.draw(st.sampled_from(paths)), data.draw(json_values | st.just(_DELETE)))
    engines.write(tmp_path, doc)
    try:
        record = engines.read(tmp_path)
    except GlanceError as exc:
        _one_line(exc)
        return
    assert 1 <= record.max_tree < record.max_context and record.module in ("tensorrt", "tensorrt_rtx")


def test_parse_refuses_depth_past_the_bound():
    assert parse("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    with pytest.raises(ValueError, match="nested too deeply"):
        parse("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))


@pytest.mark.parametrize("field,value", [("sample", None), ("sample", "1"), ("cap", "15"), ("kind", ["a"]),
                                         ("prompt", {"a": 1}), ("mode", 7), ("node_scores", ["x"]),
                                         ("node_depths", [-1]), ("path", [[1]]), ("surprisal", "high")])
def test_round_fields_the_law_and_calibration_use_are_typed(tmp_path, field, value):
    path = tmp_path / "rounds.jsonl"
    path.write_text(json.dumps({"entropy": 0.1, "accepted": 2, field: value}) + "\n")
    with pytest.raises(GlanceError, match=f'rounds.jsonl:1 has "{field}"') as err:
        rounds.read(path)
    _one_line(err.value)


@PROPERTY
@given(rows=st.lists(st.fixed_dictionaries(
    {"entropy": st.floats(0, 5), "accepted": st.integers(1, 16)},
    optional={k: json_values for k in ("mode", "kind", "prompt", "sample", "cap", "final")}), min_size=1, max_size=6))
def test_any_round_log_fits_or_is_one_line(tmp_path, rows):
    """The law reads whatever the log reader passes, or refuses it in one line."""
    from glance_runtime.bench.law_log import fit_log

    path = tmp_path / "rounds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        fit_log(rounds.read(path), cap=15, replicates=5)
    except GlanceError as exc:
        _one_line(exc)


@pytest.mark.parametrize("line,words", [('{"prompt": "x", "image": 3}', '"image" is 3'),
                                        ('{"prompt": "\\udc80"}', "lone surrogate"),
                                        ('{"prompt": ' + "[" * 3000 + "]" * 3000 + "}", "nested too deeply")])
def test_commands_refuse_bad_task_files_in_one_line(tmp_path, capsys, line, words):
    """audit and glance-bench read task files before opening a model: exit 2, one line, no traceback."""
    from glance_export.cli import main as export_main
    from glance_runtime.cli.bench import main as bench_main

    path = _tasks(tmp_path, line)
    for run in (lambda: export_main(["audit", "--data", str(path), "--backend", "onnxruntime"]),
                lambda: bench_main(["--data", str(path), "--out", str(tmp_path / "bench")])):
        assert run() == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err and "Traceback" not in err, err
