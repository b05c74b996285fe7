"""ONNX export of the target, draft and vision graphs: files, manifest, validation, atomicity, errors,
and a real decode replayed through the exported graphs (numpy KV) that must match the greedy oracle."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from glance_runtime.backends.seeded import SeededDrafter
from glance_export import __version__
from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts, validate_artifacts
from glance_runtime.prompt.vision_indices import vision_index_inputs
from glance_export.onnx import artifacts as artifacts_mod
from glance_export.model.torch_backend import TorchBackend, greedy_reference
from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import draft_kv_names, target_kv_names
from glance_runtime.decode.backend import Prefilled, Verified
from glance_runtime.decode.loop import DecodeConfig, decode
from support import ALL_FAMILIES, VL_FAMILIES, export_once, tiny_head

BLOCK = 6
MAX_NEW = 16
@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    return lambda family, variant="fp32": export_once(snapshot_dir, tmp_path_factory, family, variant, BLOCK)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_graphs_pass_checker_with_contract_names(exported, family):
    _, _, out = exported(family)
    manifest = json.loads((out / "manifest.json").read_text())
    layers, head_layers = manifest["graphs"]["target"]["num_layers"], manifest["graphs"]["draft"]["num_layers"]
    expected = {"target.onnx", "draft.onnx", "vocab.onnx"} | (
        {"vision.onnx"} if family in VL_FAMILIES else set())
    assert {p.name for p in out.glob("*.onnx")} == expected
    for name in expected:
        onnx.checker.check_model(str(out / name), full_check=True)
    target = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    pool, present = target_kv_names(layers)
    images = ["input_ids", "inputs_embeds", "image_embeds"] + (["deepstack_embeds"] if family == "qwen3_vl" else []) \
        if family in VL_FAMILIES else ["inputs_embeds"]
    assert [i.name for i in target.input] == [*images, "position_ids", "tree_mask", "slots", "past_lengths",
                                              "past_rows", *pool]
    assert [o.name for o in target.output] == ["hidden", *present, "taps"]
    draft = onnx.load(str(out / "draft.onnx"), load_external_data=False).graph
    ctx_in, ctx_out = draft_kv_names(head_layers)
    assert [i.name for i in draft.input] == ["context_taps", "context_positions", "context_lengths", "block_embeds",
                                             "start", "slots", "past_lengths", "past_rows", *ctx_in]
    assert [o.name for o in draft.output] == ["hidden", *ctx_out]
    vocab = onnx.load(str(out / "vocab.onnx"), load_external_data=False).graph
    assert [i.name for i in vocab.input] == ["ids", "hidden"]
    assert [o.name for o in vocab.output] == ["embeds", "topk_ids", "topk_logprobs", "entropy", "topk_embeds",
                                              "logits"]
    assert max(imp.version for imp in onnx.load(str(out / "target.onnx"), load_external_data=False).opset_import
               if imp.domain in ("", "ai.onnx")) == 17


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_manifest_describes_the_export(exported, family):
    model_dir, head_dir, out = exported(family)
    m = json.loads((out / "manifest.json").read_text())
    snap = Snapshot(model_dir)
    assert m["format"] == "glance-onnx" and m["toolkit_version"] == __version__ and m["family"] == family
    assert (m["dtype"], m["opset"], m["branch_k"], m["block_size"]) == ("fp32", 17, 8, BLOCK)
    assert m["limits"] == {"max_tree": 32, "max_context": 256, "max_batch": 16}
    assert m["axes"]["T"] == [1, 256] and m["axes"]["S"] == [0, 255] and m["axes"]["T_verify"] == [1, 32]
    assert (m["axes"]["B"], m["axes"]["P"], m["axes"]["C_pool"], m["axes"]["N"]) == ([1, 16], [1, 16], [1, 256],
                                                                                     [1, 256])
    assert m["stop_token_ids"] == list(snap.stop_token_ids)
    assert m["mask_token_id"] == json.loads((head_dir / "config.json").read_text())["dflash_config"]["mask_token_id"]
    assert m["head"]["config"]["block_size"] == BLOCK
    t = m["graphs"]["target"]
    assert (t["num_layers"], t["num_kv_heads"], t["head_dim"]) == (4, 2, 16)
    assert t["inputs"]["pool_key_0"]["shape"] == ["P", "C_pool", 2, 16]
    assert t["outputs"]["present_key_0"]["shape"] == ["B", "T", 2, 16]
    assert m["graphs"]["draft"]["outputs"]["hidden"]["shape"] == ["B", "Bd", 64]
    assert (m["axes"]["Bk"], m["axes"]["Bd"]) == ([2, BLOCK], [1, BLOCK - 1])
    assert m["graphs"]["vocab"]["outputs"]["topk_ids"]["shape"] == ["R", 8]
    assert m["axes"]["R"] == [1, 32] and m["axes"]["E"] == [1, 256]
    assert m["graphs"]["vocab"]["tied"] is False and m["graphs"]["vocab"]["vocab_size"] == snap.text_config["vocab_size"]
    import hashlib
    assert m["source"]["config_sha256"] == hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    assert set(m["source"]["weights_sha256"]) == {p.name for p in model_dir.glob("*.safetensors")}
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert name in m["files"] and (out / name).is_file()
    if family in VL_FAMILIES:
        assert m["image_token_id"] == snap.image_token_id and "preprocessor_config.json" in m["files"]
        v = m["graphs"]["vision"]
        assert list(v["inputs"]) == ["pixel_values", *v["index_inputs"]]
    else:
        assert m["image_token_id"] is None and "vision" not in m["graphs"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llama"])
def test_validation_passes_on_fresh_inputs(exported, family):
    model_dir, head_dir, out = exported(family)
    report = validate_artifacts(out, model_dir, head_dir, seed=7, progress=lambda _: None)
    assert set(report) == {"target", "draft", "vocab"} | ({"vision"} if family in VL_FAMILIES else set())
    assert report["vocab"]["topk_ids"] == 0 and report["target"]["taps"] < 1e-2


@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 6, 10), (1, 16, 8), (1, 22, 14)])
@pytest.mark.parametrize("family", VL_FAMILIES)
def test_vision_indices_match_transformers(family, grid):
    from transformers import vision_utils as vu

    params = {"family": family, "merge_size": 2, "patch_size": 14, "window_size": 112, "grid_per_side": 8}
    got = vision_index_inputs(np.array([grid]), params)
    g = torch.tensor([grid])
    assert np.array_equal(got["vision_pos_ids"], vu.get_vision_position_ids(g, 2).numpy())
    if family == "qwen2_5_vl":
        order, cu = vu.get_vision_window_index(g, 2, 112, 14)
        assert np.array_equal(got["window_index"], order.numpy())
        bounds = np.concatenate([[0], np.cumsum(np.bincount(got["window_ids"]))])
        assert np.array_equal(np.unique(bounds), cu.numpy())
        assert np.array_equal(got["window_index"][got["window_reverse"]], np.arange(len(order)))
    if family == "qwen3_vl":
        idx, w = vu.get_vision_interpolation_indices_and_weights(g, 8, mode="bilinear", align_corners=True,
                                                                 spatial_merge_size=2)
        assert np.array_equal(got["pos_interp_index"], idx.numpy())
        assert np.array_equal(got["pos_interp_weight"], w.numpy())


class GraphReplay:
    """The reference backend's prefill/draft/verify/commit, run through the exported graphs by hand.

    Positions of the prompt come from the torch model's own rope index; everything else is ONNX
    Runtime on numpy buffers: one sequence, a batch of one, in slot 1 of a two-slot KV pool whose other slot
    holds noise it must never read; each pass's rows are written after the committed ones on commit."""

    name = "onnx-replay"
    SLOT = 1

    def __init__(self, out: Path, reference: TorchBackend):
        import onnxruntime as ort

        self.m = json.loads((out / "manifest.json").read_text())
        self.reference, self.block_size = reference, self.m["block_size"]
        self.info = reference.info  # what it serves: the reference's limits
        self.sessions = {g: ort.InferenceSession(str(out / e["file"]), providers=["CPUExecutionProvider"])
                         for g, e in self.m["graphs"].items()}
        t, d = self.m["graphs"]["target"], self.m["graphs"]["draft"]
        self.kv_names, _ = target_kv_names(t["num_layers"])
        self.ctx_names, _ = draft_kv_names(d["num_layers"])
        rows, rng = self.m["limits"]["max_context"], np.random.default_rng(0)
        self.kv = [rng.normal(size=(2, rows, t["num_kv_heads"], t["head_dim"])).astype(np.float32)
                   for _ in self.kv_names]
        self.ctx = [rng.normal(size=(2, rows, d["num_kv_heads"], d["head_dim"])).astype(np.float32)
                    for _ in self.ctx_names]
        self.no_image = {"image_embeds": np.zeros((0, t["hidden_size"]), np.float32)} if self.m["is_vl"] else {}
        if t["deepstack_layers"]:
            self.no_image["deepstack_embeds"] = np.zeros((t["deepstack_layers"], 0, t["hidden_size"]), np.float32)

    def _vocab(self, ids=None, hidden=None) -> list[np.ndarray]:
        """The vocab graph with a dummy for whichever input is not used."""
        ids = np.zeros(1, np.int64) if ids is None else np.asarray(ids, np.int64)
        hidden = np.zeros((1, self.m["graphs"]["vocab"]["hidden_size"]), np.float32) if hidden is None else hidden
        names = ["embeds", "topk_ids", "topk_logprobs", "entropy", "topk_embeds"]  # what greedy decoding reads
        return self.sessions["vocab"].run(names, {"ids": ids, "hidden": hidden})

    def _pool(self, pool: list[np.ndarray], names: list[str], committed: int) -> dict[str, np.ndarray]:
        return {"slots": np.array([self.SLOT]), "past_lengths": np.array([committed]),
                "past_rows": np.arange(committed), **dict(zip(names, pool))}

    def _target(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        feed.update(self._pool(self.kv, self.kv_names, self.committed))
        feed["inputs_embeds"] = self._vocab(ids=feed["input_ids"][0])[0][None]
        if not self.m["is_vl"]:
            del feed["input_ids"]
        out = self.sessions["target"].run(None, feed)
        self.present, self.taps = [p[0] for p in out[1:-1]], out[-1][0]
        return out[0][0]

    def prefill(self, prompt):
        self.committed, self.ctx_committed = 0, 0
        ids = prompt.input_ids[None]
        positions, self.delta = self.reference.prompt_positions(prompt)
        feed = {"input_ids": ids, "position_ids": positions.numpy().astype(np.int64),
                "tree_mask": np.tri(ids.shape[1], dtype=bool)[None], **self.no_image}
        if prompt.pixel_values is not None:
            vision = self.sessions["vision"]
            feeds = {"pixel_values": prompt.pixel_values,
                     **vision_index_inputs(prompt.image_grid_thw, self.m["graphs"]["vision"]["index_params"])}
            embeds = vision.run(None, feeds)
            feed.update(zip(["image_embeds", "deepstack_embeds"], embeds))
        hidden = self._target(feed)
        self._write(self.kv, self.present, self.committed)
        self.committed = self.start = ids.shape[1]
        self.pending, self.pending_from = [self.taps], 0
        _, top, _, entropy, _ = self._vocab(hidden=hidden[-1:])
        return Prefilled(int(top[0, 0]), float(entropy[0]))

    def _write(self, pool: list[np.ndarray], rows: list[np.ndarray], at: int) -> None:
        for tensor, new in zip(pool, rows):
            tensor[self.SLOT, at:at + len(new)] = new

    def draft(self, anchor: int, k: int, depth: int | None = None):
        taps = np.concatenate(self.pending)
        block = self._vocab(ids=[anchor] + [self.m["mask_token_id"]] * (self.block_size - 1))[0]
        feed = {"context_taps": taps[None], "block_embeds": block[None], "start": np.array([self.start]),
                "context_positions": np.arange(self.pending_from, self.pending_from + len(taps))[None],
                "context_lengths": np.array([len(taps)]), **self._pool(self.ctx, self.ctx_names, self.ctx_committed)}
        out = self.sessions["draft"].run(None, feed)
        self._write(self.ctx, [c[0] for c in out[1:]], self.ctx_committed)
        self.ctx_committed += len(taps)
        self.pending, self.pending_from = [], self.start
        _, ids, logp, _, _ = self._vocab(hidden=out[0][0][:depth])
        return ids[:, :k], logp[:, :k].astype(np.float64)

    def verify(self, tokens, depths, visible):
        stream = (self.start + depths + self.delta)[None].astype(np.int64)
        positions = np.broadcast_to(stream, (3, 1, len(tokens))).copy() if self.m["is_vl"] else stream
        hidden = self._target({"input_ids": tokens[None].astype(np.int64), "position_ids": positions,
                               "tree_mask": visible[None], **self.no_image})
        _, top, logp, entropy, _ = self._vocab(hidden=hidden)
        return Verified(top[:, 0], float(entropy[0]), logp[:, 0].astype(np.float64))

    def commit(self, rows):
        self._write(self.kv, [p[rows] for p in self.present], self.committed)
        self.committed += len(rows)
        self.pending.append(self.taps[rows])
        self.start += len(rows)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_replayed_decode_matches_greedy_oracle(exported, images, family):
    model_dir, head_dir, out = exported(family)
    from glance_export.model.head import load_head

    reference = TorchBackend(Snapshot(model_dir), load_head(head_dir))
    prompt = reference.snapshot.build_prompt("What colour is the square?",
                                             images["wide"] if family in VL_FAMILIES else None)
    ref_token, ref_entropy, _ = reference.prefill(prompt)
    replay = GraphReplay(out, reference)
    token, entropy, _ = replay.prefill(prompt)
    assert token == ref_token and entropy == pytest.approx(ref_entropy, rel=1e-4, abs=1e-5)
    truth = greedy_reference(reference.model, reference.snapshot, prompt, MAX_NEW, ())
    columns = [0, 0, 2, None, 1, 0]  # true token first, off the first branch, absent: partial acceptance
    drafter = SeededDrafter(replay, truth, prompt.length, lambda d: columns[d % len(columns)])
    result = decode(drafter, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=24, branch_k=4))
    assert result.tokens == truth
    assert max(r.accepted for r in result.rounds) > 2 and max(r.tree_size for r in result.rounds) > BLOCK


def test_fp16_export_validates(exported):
    _, _, out = exported("qwen3_vl", "fp16")
    m = json.loads((out / "manifest.json").read_text())
    assert m["dtype"] == "fp16" and m["float_io_dtype"] == "float16"
    assert m["graphs"]["target"]["inputs"]["pool_key_0"]["dtype"] == "float16"
    assert m["graphs"]["vocab"]["outputs"]["entropy"]["dtype"] == "float32"
    assert m["graphs"]["vocab"]["outputs"]["topk_embeds"]["dtype"] == "float16"
    assert m["graphs"]["vocab"]["outputs"]["logits"]["dtype"] == "float32"  # sampling reads them in full precision


def test_external_data_when_weights_are_large(exported):
    _, _, out = exported("qwen3", "external")
    m = json.loads((out / "manifest.json").read_text())
    for graph in ("target", "draft", "vocab"):
        assert m["graphs"][graph]["data_file"] == f"{graph}.onnx.data" and (out / f"{graph}.onnx.data").is_file()
        onnx.checker.check_model(str(out / f"{graph}.onnx"), full_check=True)


def test_failed_export_leaves_nothing(snapshot_dir, tmp_path, monkeypatch):
    head = tiny_head(snapshot_dir("qwen2"), tmp_path / "head_qwen2", BLOCK)

    def broken(*args, **kwargs):
        raise GlanceError("target graph: output taps max error 1 exceeds 0.1")

    monkeypatch.setattr(artifacts_mod, "validate_graphs", broken)
    parent = tmp_path / "arts"
    with pytest.raises(GlanceError, match="exceeds"):
        export_artifacts(snapshot_dir("qwen2"), head, parent / "out", max_tree=8, max_context=64,
                         progress=lambda _: None)
    assert list(parent.iterdir()) == []


def test_reexport_replaces_previous_artifacts(exported, tmp_path):
    model_dir, head_dir, _ = exported("qwen3")
    out = tmp_path / "again"
    export_artifacts(model_dir, head_dir, out, max_tree=8, max_context=64, progress=lambda _: None)
    (out / "notes.txt").write_text("a user's")  # not the export's: replacing the directory would delete it
    with pytest.raises(GlanceError, match="notes.txt"):
        export_artifacts(model_dir, head_dir, out, max_tree=8, max_context=64, branch_k=4, progress=lambda _: None)
    assert (out / "notes.txt").read_text() == "a user's"
    (out / "notes.txt").unlink()
    export_artifacts(model_dir, head_dir, out, max_tree=8, max_context=64, branch_k=4, progress=lambda _: None)
    assert json.loads((out / "manifest.json").read_text())["branch_k"] == 4


@pytest.mark.parametrize("change,message", [
    (dict(model_dir="missing"), "does not exist"),
    (dict(head_dir="missing"), "head directory"),
    (dict(dtype="bf16"), "unsupported dtype"),
    (dict(opset=21), "opset 21"),
    (dict(max_tree=64, max_context=64), "max_tree"),
    (dict(branch_k=0), "branch_k"),
    (dict(head_dir="other"), "head was made for"),
    (dict(out_dir="occupied"), "no glance command made, not a glance-artifacts"),
])
def test_bad_input_is_one_line_error(exported, tmp_path, change, message):
    model_dir, head_dir, _ = exported("qwen3")
    snap = Snapshot(model_dir)
    cfg = head_config_for(snap, 2, BLOCK, pick_mask_token(snap))
    cfg.num_target_layers = 6
    paths = {"missing": tmp_path / "missing", "other": save_head(init_head(cfg, 0), tmp_path / "other_head"),
             "occupied": tmp_path / "occupied"}
    paths["occupied"].mkdir()
    (paths["occupied"] / "keep.txt").write_text("user data")
    args = dict(model_dir=model_dir, head_dir=head_dir, out_dir=tmp_path / "out")
    options = {}
    for key, value in change.items():
        if key in args:
            args[key] = paths[value]
        else:
            options[key] = value
    with pytest.raises(GlanceError, match=message) as err:
        export_artifacts(args["model_dir"], args["head_dir"], args["out_dir"], progress=lambda _: None, **options)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and (paths["occupied"] / "keep.txt").is_file()


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_copied_tokenizer_tokenizes_like_transformers(exported, family):
    from tokenizers import Tokenizer

    model_dir, _, out = exported(family)
    text = "Read the total on the receipt: 42.17 and 0123456789"
    expected = Snapshot(model_dir).tokenizer(text, add_special_tokens=False)["input_ids"]
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text, add_special_tokens=False).ids == expected
