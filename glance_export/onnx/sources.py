"""Open the target snapshot and the head for export, refusing bad input with one-line errors,
and wrap them as the graph modules."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import Eagle3Head, check_eagle3_matches, head_kind, load_eagle3
from glance_export.model.head import DraftHead, check_head_matches, load_head
from glance_runtime.errors import GlanceError

from . import eagle3_draft
from .checkpoint import Checkpoint
from .draft import DraftGraph
from .skeleton import Skeleton, build_skeleton
from .spec import DTYPES, Dims
from .target import TargetGraph
from .vision import VisionGraph
from .vocab import DraftVocabGraph, VocabGraph


def open_sources(model_dir: str | Path, head_dir: str | Path,
                 dtype: str) -> tuple[Snapshot, Checkpoint, DraftHead | Eagle3Head]:
    """Snapshot, its tensor index and the matching head (small: loaded whole): a GLANCE/DFlash head, or an
    EAGLE-3 head where its config.json says so."""
    if dtype not in DTYPES:
        raise GlanceError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if not Path(head_dir).is_dir():
        raise GlanceError(f"head directory {head_dir} does not exist; create one with `glance-export init-head`")
    snapshot = Snapshot(model_dir)
    if head_kind(head_dir) == "eagle3":
        eagle = load_eagle3(head_dir, getattr(torch, DTYPES[dtype]))
        check_eagle3_matches(eagle, snapshot)
        checkpoint = Checkpoint(snapshot.path)
        if eagle.embed_tokens is not None:
            keys = [k for k in checkpoint.entries if k.endswith("embed_tokens.weight") and "visual" not in k]
            if len(keys) == 1:
                eagle3_draft.borrow_embeddings(eagle, checkpoint.read(keys[0]))
        eagle3_draft.check_exportable(eagle)
        return snapshot, checkpoint, eagle
    head = load_head(head_dir, getattr(torch, DTYPES[dtype]))
    check_head_matches(head, snapshot)
    if head.config.vocab_size != snapshot.text_config["vocab_size"]:
        raise GlanceError(f"head vocab size {head.config.vocab_size} differs from the target's "
                          f"{snapshot.text_config['vocab_size']}; use a head trained for this target")
    return snapshot, Checkpoint(snapshot.path), head


def target_skeleton(snapshot: Snapshot, checkpoint: Checkpoint, dtype: str, attention: str = "eager",
                    layers: int | None = None) -> Skeleton:
    """The weightless target. Eager attention exports as plain MatMul/Softmax; sdpa becomes the ONNX
    Attention op under the opset-23 (dynamo) exporter."""
    skeleton = build_skeleton(snapshot, DTYPES[dtype], checkpoint, layers)
    skeleton.model.set_attn_implementation(attention)
    return skeleton


def target_graph(model: nn.Module, dims: Dims) -> TargetGraph:
    return TargetGraph(model, list(dims.tap_ids), dims.image_token_id, dims.deepstack).eval()


def draft_vocab_graph(model: nn.Module, head: DraftHead, weights: Skeleton, branch_k: int) -> DraftVocabGraph:
    """The draft vocabulary's rows of the target's embedding and LM head, read from the snapshot now: small
    (N rows), so they are held, unlike the whole matrices, which are streamed."""
    ids = head.draft_vocab_ids.cpu()
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    rows = weights.real_rows(embed, ids)
    head_rows = None if lm_head is embed else weights.real_rows(lm_head, ids)
    return DraftVocabGraph(rows, head_rows, ids, branch_k)


def eagle3_step_graph(model: nn.Module, head: Eagle3Head, weights: Skeleton, branch_k: int) -> nn.Module:
    """The EAGLE-3 draft graph, with the target's embedding rows of the tokens the head drafts (read now: held
    beside the head, see `eagle3_draft`)."""
    embed = model.get_input_embeddings().weight
    rows = weights.real_rows(embed, eagle3_draft.draft_token_ids(head))
    return eagle3_draft.Eagle3StepGraph(head, rows, branch_k)


def build_graphs(skeleton: Skeleton, head: DraftHead | Eagle3Head, dims: Dims, branch_k: int) -> dict[str, nn.Module]:
    """The wrapped graphs by name: target, draft (GLANCE's block pass or EAGLE-3's step), vocab, (VL only) vision,
    (a GLANCE head with a draft vocabulary) draft_vocab."""
    model = skeleton.model
    drafted = head.config.drafted_vocab if isinstance(head, Eagle3Head) else dims.draft_vocab
    smallest = min(dims.vocab, drafted or dims.vocab)
    if not 1 <= branch_k <= smallest:
        raise GlanceError(f"branch_k must be between 1 and the {'draft ' if drafted else ''}vocabulary "
                          f"size {smallest}, got {branch_k}")
    draft = (eagle3_step_graph(model, head, skeleton, branch_k) if isinstance(head, Eagle3Head)
             else DraftGraph(head))
    graphs = {"target": target_graph(model, dims),
              "draft": draft,
              "vocab": VocabGraph(model.get_input_embeddings(), model.get_output_embeddings(), branch_k)}
    if dims.draft_vocab:
        graphs["draft_vocab"] = draft_vocab_graph(model, head, skeleton, branch_k)
    if dims.is_vl:
        graphs["vision"] = VisionGraph(model.model.visual, dims.family)
    return {name: g.eval() for name, g in graphs.items()}
