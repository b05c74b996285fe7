"""Sizes of a target/head pair, and the symbolic axes of each graph with their bounds.

One place derives every number the graphs, the sample inputs, the manifest and the TensorRT profiles
need, so they cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import Eagle3Head
from glance_export.model.head import DraftHead
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import VOCABULARY_GRAPHS

from . import eagle3_draft

DTYPES = {"fp32": "float32", "fp16": "float16"}


@dataclass(frozen=True)
class Dims:
    family: str
    is_vl: bool
    hidden: int
    vocab: int
    layers: int
    kv_heads: int
    head_dim: int
    tap_ids: tuple[int, ...]
    deepstack: int  # Qwen3-VL layers that add deepstack rows; 0 elsewhere
    head_layers: int
    head_kv_heads: int
    head_head_dim: int
    block_size: int
    mask_token_id: int
    image_token_id: int | None
    vision: dict[str, Any] | None  # index_params plus patch_dim / max_patches, VL only
    tied: bool  # the LM head is the embedding matrix (one tensor in the vocab graph)
    draft_vocab: int | None = None  # the head drafts over this many target tokens (its draft_vocab graph)
    head_kind: str = "glance"  # "eagle3": an autoregressive head, its draft graph run once per depth
    head_mrope: bool = False  # the EAGLE-3 head rotates with the target's three M-RoPE axes
    max_batch: int = 1  # sequences one target or draft pass serves: the B axis's bound (1 for an EAGLE-3 head)

    @property
    def n_taps(self) -> int:
        return len(self.tap_ids)

    @property
    def position_axes(self) -> int:
        return 3 if self.is_vl else 1


def vision_params(snapshot: Snapshot) -> dict[str, Any]:
    """What `vision_indices.vision_index_inputs` needs, plus the pixel row width and the size bounds."""
    vc = snapshot.config["vision_config"]
    proc = snapshot.image_processor
    merge, patch = int(vc["spatial_merge_size"]), int(vc["patch_size"])
    max_pixels = int(getattr(proc, "max_pixels", None) or proc.size["longest_edge"])
    min_pixels = int(getattr(proc, "min_pixels", None) or proc.size["shortest_edge"])
    return {"family": snapshot.family, "merge_size": merge, "patch_size": patch,
            "window_size": vc.get("window_size"),
            "grid_per_side": int(vc.get("num_position_embeddings", 0) ** 0.5),
            "patch_dim": int(vc.get("in_channels", vc.get("in_chans", 3))) * int(vc["temporal_patch_size"]) * patch * patch,
            "min_patches": min_pixels // (patch * patch), "max_patches": max_pixels // (patch * patch)}


def dims_for(snapshot: Snapshot, head: DraftHead | Eagle3Head, max_batch: int = 1) -> Dims:
    """`max_batch` bounds the target and draft graphs' batch axis; an EAGLE-3 head drafts one sequence, so 1."""
    tc, hc = snapshot.text_config, head.config
    deep = snapshot.config.get("vision_config", {}).get("deepstack_visual_indexes") or []
    if snapshot.family == "qwen3_vl" and len(deep) > tc["num_hidden_layers"]:
        raise GlanceError(f"{snapshot.path} has {tc['num_hidden_layers']} text layers but Qwen3-VL adds its "
                          f"{len(deep)} deepstack features to the first {len(deep)}; a model cut that short cannot be "
                          f"exported: keep at least {len(deep)} text layers")
    eagle3 = isinstance(head, Eagle3Head)
    head_fields = (dict(tap_ids=tuple(hc.taps(tc["num_hidden_layers"])), block_size=EAGLE3_DEPTH + 1, mask_token_id=0,
                        draft_vocab=None, head_kind="eagle3", head_mrope=hc.mrope_section is not None) if eagle3 else
                   dict(tap_ids=tuple(hc.target_layer_ids), block_size=hc.block_size, mask_token_id=hc.mask_token_id,
                        draft_vocab=hc.draft_vocab_size))
    return Dims(family=snapshot.family, is_vl=snapshot.is_vl, hidden=tc["hidden_size"], vocab=tc["vocab_size"],
                layers=tc["num_hidden_layers"], kv_heads=tc.get("num_key_value_heads") or tc["num_attention_heads"],
                head_dim=tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"],
                deepstack=len(deep) if snapshot.family == "qwen3_vl" else 0,
                head_layers=hc.num_hidden_layers, head_kv_heads=hc.num_key_value_heads, head_head_dim=hc.head_dim,
                image_token_id=snapshot.image_token_id if snapshot.is_vl else None,
                vision=vision_params(snapshot) if snapshot.is_vl else None,
                tied=bool(snapshot.config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
                max_batch=1 if eagle3 else max_batch, **head_fields)


def axis_bounds(dims: Dims, max_tree: int, max_context: int, branch_k: int = 8) -> dict[str, list[int]]:
    """[min, max] of every symbolic axis; the runtime sizes buffers and TensorRT profiles from these."""
    bounds = {"B": [1, dims.max_batch], "T": [1, max_context], "S": [0, max_context - 1], "N": [1, max_context],
              "S_h": [0, max_context - 1], "P": [1, dims.max_batch], "C_pool": [1, max_context],
              "T_verify": [1, max_tree], "E": [1, max_context], "R": [1, max(max_tree, dims.block_size - 1)]}
    if dims.head_kind == "eagle3":
        bounds.update(eagle3_draft.axis_bounds(max_context, branch_k))
    else:  # a draft pass's block rows (anchor and masks) and the drafted rows it returns, one fewer
        bounds.update({"Bk": [2, dims.block_size], "Bd": [1, dims.block_size - 1]})
    if dims.is_vl:
        v = dims.vision
        unit = v["merge_size"] ** 2
        bounds["N_patch"] = [v["min_patches"], v["max_patches"]]
        bounds["N_img"] = [0, v["max_patches"] // unit]
        bounds["N_merged"] = [v["min_patches"] // unit, v["max_patches"] // unit]
    return bounds


def dynamic_axes(dims: Dims, graph: str, input_names: list[str], output_names: list[str]) -> dict[str, dict[int, str]]:
    """Symbolic axes per tensor name, in the letters of `glance_runtime.formats.graphs`."""
    if graph == "target":
        axes = {"input_ids": {0: "B", 1: "T"}, "inputs_embeds": {0: "B", 1: "T"}, "image_embeds": {0: "N_img"},
                "deepstack_embeds": {1: "N_img"}, "position_ids": {1: "B", 2: "T"} if dims.is_vl else {0: "B", 1: "T"},
                "tree_mask": {0: "B", 1: "T", 2: "T"}, "hidden": {0: "B", 1: "T"}, "taps": {0: "B", 1: "T"},
                **_pool_axes(input_names, "S")}
        axes.update({n: {0: "B", 1: "T"} for n in output_names if n.startswith("present_")})
    elif graph == "draft" and dims.head_kind == "eagle3":
        axes = eagle3_draft.dynamic_axes(set(input_names) | set(output_names))
    elif graph == "draft":
        axes = {"context_taps": {0: "B", 1: "N"}, "context_positions": {0: "B", 1: "N"}, "context_lengths": {0: "B"},
                "block_embeds": {0: "B", 1: "Bk"}, "start": {0: "B"}, "hidden": {0: "B", 1: "Bd"},
                **_pool_axes(input_names, "S_h")}
        axes.update({n: {0: "B", 1: "N"} for n in output_names if n.startswith("ctx_")})
    elif graph in VOCABULARY_GRAPHS:
        axes = {"ids": {0: "E"}, "embeds": {0: "E"}, "hidden": {0: "R"}, "topk_ids": {0: "R"},
                "topk_logprobs": {0: "R"}, "topk_embeds": {0: "R"}, "logits": {0: "R"}}
    else:
        axes = {"pixel_values": {0: "N_patch"}, "vision_pos_ids": {0: "N_patch"}, "window_ids": {0: "N_patch"},
                "pos_interp_index": {0: "N_patch"}, "pos_interp_weight": {0: "N_patch"},
                "window_index": {0: "N_merged"}, "window_reverse": {0: "N_merged"},
                "image_embeds": {0: "N_merged"}, "deepstack_embeds": {1: "N_merged"}}
    names = set(input_names) | set(output_names)
    return {k: v for k, v in axes.items() if k in names}


def _pool_axes(input_names: list[str], past: str) -> dict[str, dict[int, str]]:
    """B sequences' slots and past lengths, `past` rows read from a P x C_pool pool."""
    axes: dict[str, dict[int, str]] = {"slots": {0: "B"}, "past_lengths": {0: "B"}, "past_rows": {0: past}}
    axes.update({n: {0: "P", 1: "C_pool"} for n in input_names if n.startswith("pool_")})
    return axes


def output_shapes(dims: Dims, graph: str, branch_k: int) -> dict[str, list[int | str]]:
    """Declared output shapes; the tracer loses some static sizes (rotary halves, top-k rows)."""
    if graph == "target":
        shapes: dict[str, list[int | str]] = {"hidden": ["B", "T", dims.hidden],
                                              "taps": ["B", "T", dims.n_taps * dims.hidden]}
        for l in range(dims.layers):
            shapes[f"present_key_{l}"] = shapes[f"present_value_{l}"] = ["B", "T", dims.kv_heads, dims.head_dim]
        return shapes
    if graph == "draft" and dims.head_kind == "eagle3":
        return eagle3_draft.output_shapes(dims, branch_k)
    if graph == "draft":
        shapes = {"hidden": ["B", "Bd", dims.hidden]}
        for j in range(dims.head_layers):
            shapes[f"ctx_key_{j}"] = shapes[f"ctx_value_{j}"] = ["B", "N", dims.head_kv_heads, dims.head_head_dim]
        return shapes
    if graph in VOCABULARY_GRAPHS:
        vocab = dims.draft_vocab if graph == "draft_vocab" else dims.vocab
        return {"embeds": ["E", dims.hidden], "topk_ids": ["R", branch_k], "topk_logprobs": ["R", branch_k],
                "entropy": [1], "topk_embeds": ["R", branch_k, dims.hidden], "logits": ["R", vocab]}
    shapes = {"image_embeds": ["N_merged", dims.hidden]}
    if dims.deepstack:
        shapes["deepstack_embeds"] = [dims.deepstack, "N_merged", dims.hidden]
    return shapes
