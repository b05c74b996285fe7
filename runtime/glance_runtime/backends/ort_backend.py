"""The ONNX Runtime backend: the Backend protocol on the exported graphs, with numpy and onnxruntime only.

It mirrors the torch reference backend step for step (same positions, masks, head context and
commit rule), but the KV caches are preallocated seq-major buffers (`kv_cache`) handed to the graphs
as zero-copy views, prompts are built without transformers (`preprocess`), and M-RoPE prefill
positions come from the numpy port of the model's rope-index function (`rope_index`).

The vocab graph holds the embedding and LM head. Each projection also returns the embeddings of its
top-k tokens, and every token a later pass feeds (the next anchor, the tree's nodes) is one of them,
so a round is four runs: draft, vocab, target, vocab. Only tokens from elsewhere (a prompt, a test's
seeded draft) cost an embedding run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import GlanceError
from ..graphs import DRAFT_GRAPH, TARGET_GRAPH, VISION_GRAPH, VOCAB_GRAPH, draft_kv_names, target_kv_names
from ..kv_cache import KVCache
from ..manifest import Manifest, load_manifest
from ..preprocess import Prompt, PromptBuilder
from ..rope_index import rope_index
from ..vision_indices import vision_index_inputs

PROVIDER_ALIASES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                    "tensorrt": "TensorrtExecutionProvider", "trt": "TensorrtExecutionProvider",
                    "nv_tensorrt_rtx": "NvTensorRTRTXExecutionProvider", "coreml": "CoreMLExecutionProvider",
                    "dml": "DmlExecutionProvider"}


def _onnxruntime():
    """onnxruntime, or a one-line fix when this install lacks it."""
    try:
        import onnxruntime
    except ImportError:
        raise GlanceError("the onnxruntime backend needs onnxruntime: pip install 'glance-toolkit[onnxruntime]' "
                          "(on Jetson, onnxruntime-gpu from the Jetson AI Lab index)") from None
    return onnxruntime


def resolve_providers(requested: Sequence[str] | str | None) -> list[str]:
    """Full provider names in priority order, CPU last as the fallback; unknown or missing ones fail here."""
    available = _onnxruntime().get_available_providers()
    if requested is None:
        return ["CPUExecutionProvider"]
    names = [requested] if isinstance(requested, str) else list(requested)
    chosen = []
    for name in names:
        full = PROVIDER_ALIASES.get(name.lower(), name)
        if full not in available:
            raise GlanceError(f"execution provider {name!r} is not available in this onnxruntime "
                              f"(available: {', '.join(available)}); install the matching onnxruntime build")
        chosen.append(full)
    return chosen + ([] if "CPUExecutionProvider" in chosen else ["CPUExecutionProvider"])


def _limit(flag: str, asked: int | None, exported: int) -> int:
    """A runtime limit: the export's bound by default, never above it (graphs and profiles are sized to it)."""
    if asked is None:
        return exported
    if not 1 <= asked <= exported:
        raise GlanceError(f"{flag} {asked} is outside 1..{exported}, the range these artifacts were exported for; "
                          f"re-export with a larger `glance-export onnx {flag}`")
    return asked


class OrtBackend:
    """Exported graphs in `artifacts_dir` (see glance_runtime.graphs) driven by ONNX Runtime."""

    name = "onnxruntime"

    def __init__(self, artifacts_dir: str | Path, providers: Sequence[str] | str | None = None,
                 max_context: int | None = None, max_tree: int | None = None, threads: int | None = None):
        ort = _onnxruntime()
        self.path = Path(artifacts_dir)
        self.manifest: Manifest = load_manifest(self.path)
        m = self.manifest
        self.providers = resolve_providers(providers)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3

        def session(graph: str):
            try:
                return ort.InferenceSession(str(self.path / graph), sess_options=options, providers=self.providers)
            except Exception as exc:  # onnxruntime's load errors share no base class short of Exception
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise GlanceError(f"onnxruntime cannot load {self.path / graph} ({reason}); "
                                  "re-export with `glance-export onnx`") from None

        self.target = session(TARGET_GRAPH)
        self.vision = session(VISION_GRAPH) if m.is_vl else None
        self.head = session(DRAFT_GRAPH)
        self.vocab = session(VOCAB_GRAPH)
        self.prompts = PromptBuilder(self.path, m.image_token_id if m.is_vl else None)
        self.stop_token_ids = m.stop_token_ids
        self.block_size = m.block_size
        self.max_tree = _limit("--max-tree", max_tree, m.max_tree)
        self.max_context = _limit("--max-context", max_context, m.max_context)
        self.float = np.dtype(m.float_dtype)
        self.kv = KVCache(m.target.num_layers, m.target.kv_heads, m.target.head_dim, self.max_context, self.float)
        self.head_kv = KVCache(m.head.num_layers, m.head.kv_heads, m.head.head_dim, self.max_context, self.float)
        self.kv_in, kv_out = target_kv_names(m.target.num_layers)
        self.head_in, head_out = draft_kv_names(m.head.num_layers)
        self.target_outputs = ["hidden", *kv_out, "taps"]
        self.draft_outputs = ["hidden", *head_out]
        self.vocab_outputs = ["embeds", "topk_ids", "topk_logprobs", "entropy", "topk_embeds"]
        # Passes without the image send zero image rows, not a dummy row: the graph substitutes rows
        # whenever a pass holds as many image-token ids as rows, and a generated token can be that id.
        self._no_image = np.zeros((0, m.hidden_size), self.float)
        self._no_deep = np.zeros((m.deepstack_layers, 0, m.hidden_size), self.float)
        self._no_ids, self._no_rows = np.zeros(1, np.int64), np.zeros((1, m.hidden_size), self.float)
        self.block = np.empty((self.block_size, m.hidden_size), self.float)  # [anchor, MASK x (B-1)] embeddings
        self.block[1:] = self._vocab(np.array([m.mask_token_id], np.int64), self._no_rows)[0]
        self._reset()

    def _reset(self) -> None:
        self.kv.clear()
        self.head_kv.clear()
        self.start = 0  # stream position of the current anchor == committed target KV rows
        self.delta = 0  # M-RoPE offset: text position = stream position + delta
        self.pending_taps: list[np.ndarray] = []  # committed rows not yet projected into the head cache
        self.pending_from = 0
        self.verify_taps = np.zeros((0, 0), self.float)  # taps of the last target pass
        self.known_ids = np.zeros(0, np.int64)  # tokens whose embeddings the last projection returned
        self.known_embeds = np.zeros((0, self.manifest.hidden_size), self.float)

    def build_prompt(self, text: str, image=None) -> Prompt:
        return self.prompts.build(text, image)

    def detokenize(self, ids) -> str:
        return self.prompts.decode(ids)

    def _positions(self, stream: np.ndarray) -> np.ndarray:
        """Stream positions + delta: [3, 1, T] (same on every M-RoPE axis) for VL targets, else [1, T]."""
        pos = np.empty((3 if self.manifest.is_vl else 1, 1, len(stream)), np.int64)
        pos[:] = stream + self.delta
        return pos if self.manifest.is_vl else pos[0]

    def _vocab(self, ids: np.ndarray, hidden: np.ndarray) -> list[np.ndarray]:
        return self.vocab.run(self.vocab_outputs, {"ids": ids, "hidden": hidden})

    def _project(self, hidden: np.ndarray, extra_ids: np.ndarray | None = None,
                 extra_embeds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Top-k ids, log-probs and entropies of hidden rows; their top-k embeddings (plus any extra
        known ones) become the lookup table for the next pass's inputs."""
        _, ids, logp, entropy, embeds = self._vocab(self._no_ids, hidden)
        self.known_ids, self.known_embeds = ids.reshape(-1), embeds.reshape(-1, embeds.shape[-1])
        if extra_ids is not None:
            self.known_ids = np.concatenate([self.known_ids, extra_ids])
            self.known_embeds = np.concatenate([self.known_embeds, extra_embeds])
        return ids, logp, entropy

    def _embed(self, tokens: np.ndarray) -> np.ndarray:
        """Embeddings of tokens: looked up among the last projection's, else one vocab run."""
        known = self.known_ids
        if known.size:
            order = np.argsort(known, kind="stable")
            at = order[np.minimum(np.searchsorted(known, tokens, sorter=order), known.size - 1)]
            if np.array_equal(known[at], tokens):
                return self.known_embeds[at]
        return self._vocab(tokens, self._no_rows)[0]

    def _run_target(self, ids: np.ndarray, positions: np.ndarray, tree_mask: np.ndarray,
                    image: np.ndarray, deep: np.ndarray | None) -> list[np.ndarray]:
        """One target pass over T rows after the committed ones; its K/V rows are appended to the cache."""
        self.kv.check_room(ids.shape[0])
        feeds = {"inputs_embeds": self._embed(ids), "position_ids": positions,
                 "tree_mask": np.ascontiguousarray(tree_mask, dtype=bool)}
        if self.manifest.is_vl:
            feeds["input_ids"], feeds["image_embeds"] = ids[None], image
            if self.manifest.deepstack_layers:
                feeds["deepstack_embeds"] = deep
        feeds.update(zip(self.kv_in, self.kv.view()))
        out = self.target.run(self.target_outputs, feeds)
        self.kv.append(out[1:-1])
        self.verify_taps = out[-1]
        return out

    def _encode_image(self, prompt: Prompt) -> tuple[np.ndarray, np.ndarray | None]:
        """Image rows (and Qwen3-VL deepstack rows); feeds the grid-derived index inputs the graph declares."""
        feeds = {"pixel_values": prompt.pixel_values.astype(self.float), "image_grid_thw": prompt.image_grid_thw}
        feeds.update(vision_index_inputs(prompt.image_grid_thw, self.manifest.vision_index_params))
        wanted = {i.name for i in self.vision.get_inputs()}
        out = self.vision.run(None, {k: v for k, v in feeds.items() if k in wanted})
        return out[0], (out[1] if self.manifest.deepstack_layers else None)

    def prefill(self, prompt: Prompt) -> tuple[int, float]:
        self._reset()
        ids = np.asarray(prompt.input_ids, dtype=np.int64)
        length = ids.shape[0]
        image, deep = self._no_image, self._no_deep
        if self.manifest.is_vl:
            pos, self.delta = rope_index(ids, self.manifest.image_token_id, prompt.image_grid_thw,
                                         self.manifest.spatial_merge_size)
            if prompt.pixel_values is not None:
                image, deep = self._encode_image(prompt)
        else:
            pos = np.arange(length, dtype=np.int64)[None]
        hidden = self._run_target(ids, pos, np.tri(length, dtype=bool), image, deep)[0]
        self.start = length
        self.pending_taps, self.pending_from = [self.verify_taps], 0
        top, _, entropy = self._project(hidden[-1:])
        return int(top[0, 0]), float(entropy[0])

    def draft(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k > self.manifest.branch_k:
            raise GlanceError(f"--branch-k {k} exceeds the draft graph's top-{self.manifest.branch_k}; "
                              f"lower it or re-export with `glance-export onnx --branch-k {k}`")
        taps = self.pending_taps[0] if len(self.pending_taps) == 1 else np.concatenate(self.pending_taps)
        self.head_kv.check_room(taps.shape[0])
        anchor_id = np.array([anchor], np.int64)
        self.block[0] = self._embed(anchor_id)[0]
        feeds = {"context_taps": taps,
                 "context_positions": np.arange(self.pending_from, self.pending_from + taps.shape[0], dtype=np.int64),
                 "block_embeds": self.block, "start": np.array([self.start], np.int64)}
        feeds.update(zip(self.head_in, self.head_kv.view()))
        out = self.head.run(self.draft_outputs, feeds)
        self.head_kv.append(out[1:])
        self.pending_taps, self.pending_from = [], self.start
        ids, logp, _ = self._project(out[0], anchor_id, self.block[:1])
        return ids[:, :k].astype(np.int64), logp[:, :k].astype(np.float64)

    def verify(self, tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray) -> tuple[np.ndarray, float]:
        size = len(tokens)
        if size > self.max_tree:
            raise GlanceError(f"tree of {size} rows exceeds --max-tree {self.max_tree}; "
                              f"lower --budget to {self.max_tree - 1} or raise --max-tree (up to the export's limit)")
        positions = self._positions(self.start + np.asarray(depths, dtype=np.int64))
        hidden = self._run_target(np.asarray(tokens, dtype=np.int64), positions, visible,
                                  self._no_image, self._no_deep)[0]
        top, _, entropy = self._project(hidden)
        return top[:, 0].astype(np.int64), float(entropy[0])

    def commit(self, rows: np.ndarray) -> None:
        """Compact the pack's KV in place (kept rows move down after the prefix); queue their taps for the head."""
        rows = np.asarray(rows, dtype=np.int64)
        self.kv.compact(rows)
        self.pending_taps.append(self.verify_taps[rows])
        self.start += len(rows)
