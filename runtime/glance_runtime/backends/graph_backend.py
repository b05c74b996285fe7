"""The Backend protocol over exported graphs whose state lives on a device: shared by ONNX Runtime
(CPU or CUDA, through IOBinding) and TensorRT.

It mirrors the torch reference step for step (same positions, masks, head context and commit rule).
Everything a pass reads or writes is a preallocated `Buffer`, bound by address:
- KV caches (`kv_cache`): a pass reads the committed rows in place and writes its new rows right after
  them; a commit moves only the accepted rows, on the device.
- The vocab graph's projections return the top-k tokens' embeddings; the next anchor and every tree
  node is one of them, so inputs are assembled by device copies, not by another graph run.
- Per round the host sends the tree (ids, positions, mask: kilobytes) and reads back top-k ids,
  log-probs and one entropy (kilobytes). KV never crosses. Device calls per round, for a T-row tree
  with `kept` rows committed of which `moved` change place: 18 + T + kept + moved with a draft
  (draft 3, each projection 6, verify 3 + T embedding rows, commit kept taps rows + moved KV rows),
  9 + T + kept + moved without: independent of the context length and of the number of layers.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..device import Buffer, Device, Tensor
from ..errors import GlanceError
from ..graphs import draft_kv_names, target_kv_names
from ..kv_cache import KVCache
from ..manifest import Manifest
from ..prefix import images_after
from ..preprocess import Prompt, PromptBuilder
from ..rope_index import rope_index
from ..vision_indices import vision_index_inputs


class Graph(Protocol):
    """One graph that runs on bound device views (ONNX Runtime IOBinding, a TensorRT context)."""

    input_names: frozenset[str]

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """Run with every input and output bound at the given views; returns once outputs are written
        (on the device's stream)."""


def runtime_limit(flag: str, asked: int | None, built: int, source: str, command: str) -> int:
    """A runtime limit: the export's or build's bound by default, never above it (graphs, profiles and
    buffers are sized to it)."""
    if asked is None:
        return built
    if not 1 <= asked <= built:
        raise GlanceError(f"{flag} {asked} is outside 1..{built}, the range these {source}; "
                          f"{command} with a larger `{flag}`")
    return asked


class GraphBackend:
    """prefill / draft / verify / commit on the vision, target, draft and vocab graphs."""

    def __init__(self, manifest: Manifest, device: Device, graphs: dict[str, Graph], *, max_context: int,
                 max_tree: int, name: str):
        self.name, self.manifest, self.device, self.graphs = name, manifest, device, graphs
        m = manifest
        self.prompts = PromptBuilder(m.path, m.image_token_id if m.is_vl else None)
        self.stop_token_ids = m.stop_token_ids
        self.block_size, self.max_context, self.max_tree = m.block_size, max_context, max_tree
        self.float = np.dtype(m.float_dtype)
        hidden, k, width = m.hidden_size, m.branch_k, m.tap_width
        rows = max(max_tree, m.block_size - 1)
        self.kv = KVCache(device, m.target.num_layers, m.target.kv_heads, m.target.head_dim, max_context, self.float)
        self.head_kv = KVCache(device, m.head.num_layers, m.head.kv_heads, m.head.head_dim, max_context, self.float)
        self.kv_in, self.kv_out = target_kv_names(m.target.num_layers)
        self.head_in, self.head_out = draft_kv_names(m.head.num_layers)
        new = device.empty
        self.ids = new((max_context,), np.int64)  # target input_ids and vocab ids
        self.embeds = new((max_context, hidden), self.float)  # target inputs_embeds
        self.positions = new((3 * max_context,), np.int64)
        self.mask = new((max_context * max_context,), np.bool_)
        self.hidden = new((max_context, hidden), self.float)  # target output
        self.taps = new((max_tree, width), self.float)  # a verify pass's taps
        self.pending = new((max_context, width), self.float)  # committed rows' taps not yet in the head cache
        self.block = new((m.block_size, hidden), self.float)  # [anchor, MASK x (B-1)] embeddings
        self.draft_hidden = new((m.block_size - 1, hidden), self.float)
        self.ctx_positions = new((max_context,), np.int64)
        self.start_in = new((1,), np.int64)
        self.top_ids = new((rows, k), np.int64)
        self.top_logp = new((rows, k), np.float32)
        self.entropy = new((1,), np.float32)
        # top-k embeddings of the last projections, flat [rows * K, H]: row i belongs to token i of top_ids
        self.cands = {"draft": new(((m.block_size - 1) * k, hidden), self.float), "verify": new((rows * k, hidden), self.float)}
        self.scratch_row = new((1, hidden), self.float)
        self.no_id = new((1,), np.int64)  # the dummy id of a projection-only vocab run (token 0, set once)
        self.scratch_cands = new((k, hidden), self.float)
        self.no_image = new((1, hidden), self.float).rows(0)
        self.no_deep = new((max(m.deepstack_layers, 1), 1, hidden), self.float).tensor((m.deepstack_layers, 0, hidden))
        self._images: dict[str, Buffer] = {}  # vision inputs and outputs, sized by the largest image so far
        self._reset()
        device.upload(self.no_id.rows(1), np.zeros(1, np.int64))  # device memory is not zeroed
        self.embed_rows(np.array([m.mask_token_id], np.int64), self.block, 1)
        for row in range(2, m.block_size):
            device.copy(self.block.rows(1, row), self.block.rows(1, 1))

    def _reset(self) -> None:
        self.kv.clear()
        self.head_kv.clear()
        self.start = 0  # stream position of the current anchor == committed target KV rows
        self.delta = 0  # M-RoPE offset: text position = stream position + delta
        self.pending_rows, self.pending_from = 0, 0
        self.known: dict[int, tuple[Buffer, int]] = {}  # token -> where its embedding row is on the device

    def build_prompt(self, text: str, image=None) -> Prompt:
        return self.prompts.build(text, image)

    def detokenize(self, ids) -> str:
        return self.prompts.decode(ids)

    def close(self) -> None:
        """Free every device buffer (caches, staging, image rows) and drop the graphs: nothing of this backend
        stays allocated, so an application can load and close models for as long as it runs."""
        found: dict[int, Buffer] = {}
        for value in vars(self).values():
            for item in (value.values() if isinstance(value, dict) else [value]):
                buf = item.buffer if isinstance(item, (Tensor, KVCache)) else item
                if isinstance(buf, Buffer):
                    found[id(buf)] = buf
        for buf in found.values():
            self.device.free(buf)
        self._images.clear()
        self.graphs = {}

    # -- the vocab graph ------------------------------------------------------------------------------

    def embed_rows(self, tokens: np.ndarray, dst: Buffer, first: int) -> None:
        """Write the embeddings of `tokens` into rows first.. of dst: copied from where the last projections
        left them, or (for tokens from elsewhere: a prompt, a seeded test draft) one vocab run."""
        found = [self.known.get(int(t)) for t in tokens]
        if all(found):
            for i, (buf, row) in enumerate(found):
                self.device.copy(dst.rows(1, first + i), buf.rows(1, row))
            return
        count = len(tokens)
        self.device.upload(self.ids.rows(count), tokens)
        outputs = {"embeds": dst.rows(count, first), "topk_ids": self.top_ids.rows(1), "topk_logprobs": self.top_logp.rows(1),
                   "entropy": self.entropy.rows(1), "topk_embeds": self.scratch_cands.tensor((1, *self.scratch_cands.shape))}
        self.graphs["vocab"].run({"ids": self.ids.rows(count), "hidden": self.scratch_row.rows(1)}, outputs)

    def project(self, hidden: Tensor, into: str, extra: dict[int, tuple[Buffer, int]] | None = None
                ) -> tuple[np.ndarray, np.ndarray, float]:
        """Top-k ids and log-probs of hidden rows and the entropy of the first; their top-k embeddings land in
        `self.cands[into]` and become where later passes copy their input embeddings from."""
        rows, k = hidden.shape[0], self.manifest.branch_k
        cands = self.cands[into]
        outputs = {"embeds": self.scratch_row.rows(1), "topk_ids": self.top_ids.rows(rows),
                   "topk_logprobs": self.top_logp.rows(rows), "entropy": self.entropy.rows(1),
                   "topk_embeds": cands.tensor((rows, k, cands.shape[1]))}
        self.graphs["vocab"].run({"ids": self.no_id.rows(1), "hidden": hidden}, outputs)
        ids = self.device.download(self.top_ids.rows(rows))
        logp = self.device.download(self.top_logp.rows(rows))
        entropy = float(self.device.download(self.entropy.rows(1))[0])
        self.known = {int(t): (cands, i) for i, t in enumerate(ids.reshape(-1))}
        self.known.update(extra or {})
        return ids, logp, entropy

    # -- the target graph -----------------------------------------------------------------------------

    def _positions(self, stream: np.ndarray) -> np.ndarray:
        """Stream positions + delta: [3, 1, T] (same on every M-RoPE axis) for VL targets, else [1, T]."""
        pos = np.empty((3 if self.manifest.is_vl else 1, 1, len(stream)), np.int64)
        pos[:] = stream + self.delta
        return pos if self.manifest.is_vl else pos[0]

    def _run_target(self, ids: np.ndarray, positions: np.ndarray, tree_mask: np.ndarray, taps: Buffer,
                    image: Tensor, deep: Tensor) -> Tensor:
        """One target pass over T rows after the committed ones: new K/V rows land in the cache, taps in
        the first T rows of `taps`; returns the hidden rows (on the device). Room is checked before any view."""
        rows = len(ids)
        self.kv.check_room(rows)
        self.embed_rows(ids, self.embeds, 0)
        self.device.upload(self.ids.rows(rows), ids)
        self.device.upload(self.positions.tensor(positions.shape), positions)
        self.device.upload(self.mask.tensor((rows, rows)), np.ascontiguousarray(tree_mask, dtype=bool))
        inputs = {"input_ids": self.ids.tensor((1, rows)), "inputs_embeds": self.embeds.rows(rows),
                  "position_ids": self.positions.tensor(positions.shape), "tree_mask": self.mask.tensor((rows, rows)),
                  **dict(zip(self.kv_in, self.kv.past()))}
        if self.manifest.is_vl:
            inputs["image_embeds"] = image
            if self.manifest.deepstack_layers:
                inputs["deepstack_embeds"] = deep
        hidden = self.hidden.rows(rows)
        outputs = {"hidden": hidden, "taps": taps.rows(rows), **dict(zip(self.kv_out, self.kv.new_rows(rows)))}
        self.graphs["target"].run({n: t for n, t in inputs.items() if n in self.graphs["target"].input_names}, outputs)
        self.kv.appended(rows)
        return hidden

    def _image_buffer(self, name: str, shape: tuple[int, ...], dtype) -> Tensor:
        """A view of `shape` in a per-name buffer that grows to the largest image seen, so a long run over
        many prompts allocates nothing after its largest image."""
        dtype = np.dtype(dtype)
        buf = self._images.get(name)
        if buf is None or buf.dtype != dtype or buf.nbytes < int(np.prod(shape)) * dtype.itemsize:
            if buf is not None:
                self.device.free(buf)
            buf = self._images[name] = self.device.empty((int(np.prod(shape)),), dtype)
        return buf.tensor(tuple(shape))

    def _encode_image(self, prompt: Prompt) -> tuple[Tensor, Tensor]:
        """Image rows (and Qwen3-VL deepstack rows) on the device; inputs are the pixels and the grid-derived
        index tensors the graph declares."""
        feeds = {"pixel_values": prompt.pixel_values.astype(self.float), "image_grid_thw": prompt.image_grid_thw}
        feeds.update(vision_index_inputs(prompt.image_grid_thw, self.manifest.vision_index_params))
        graph = self.graphs["vision"]
        inputs = {}
        for name, array in feeds.items():
            if name in graph.input_names:
                inputs[name] = self._image_buffer(name, array.shape, array.dtype)
                self.device.upload(inputs[name], array)
        merged = len(prompt.pixel_values) // self.manifest.spatial_merge_size ** 2
        hidden = self.manifest.hidden_size
        outputs = {"image_embeds": self._image_buffer("image_embeds", (merged, hidden), self.float)}
        deep = self.no_deep
        if self.manifest.deepstack_layers:
            deep = outputs["deepstack_embeds"] = self._image_buffer(
                "deepstack_embeds", (self.manifest.deepstack_layers, merged, hidden), self.float)
        graph.run(inputs, outputs)
        return outputs["image_embeds"], deep

    def _encode_images(self, prompt: Prompt) -> tuple[Tensor, Tensor]:
        """Every image's rows, concatenated in prompt order (deepstack rows too, per layer): the vision graph
        takes one image per run, the target graph takes all of a pass's image rows at once."""
        grids = np.asarray(prompt.image_grid_thw, dtype=np.int64).reshape(-1, 3)
        if len(grids) == 1:
            return self._encode_image(prompt)
        merge2 = self.manifest.spatial_merge_size ** 2
        patches = grids.prod(axis=1)
        total = int(patches.sum()) // merge2
        hidden, layers = self.manifest.hidden_size, self.manifest.deepstack_layers
        item = self.float.itemsize
        rows = self._image_buffer("all_image_embeds", (total, hidden), self.float)
        deep = self.no_deep
        if layers:
            deep = self._image_buffer("all_deepstack_embeds", (layers, total, hidden), self.float)
        first_patch, first_row = 0, 0
        for grid, count in zip(grids, patches.tolist()):
            one = Prompt(prompt.input_ids, prompt.pixel_values[first_patch:first_patch + count], grid[None])
            image, image_deep = self._encode_image(one)
            merged = count // merge2
            self.device.copy(rows.buffer.tensor((merged, hidden), first_row * hidden * item), image)
            for layer in range(layers):
                self.device.copy(deep.buffer.tensor((merged, hidden), (layer * total + first_row) * hidden * item),
                                 image_deep.buffer.tensor((merged, hidden), layer * merged * hidden * item))
            first_patch, first_row = first_patch + count, first_row + merged
        return rows, deep

    # -- the Backend protocol -------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, keep: int = 0) -> tuple[int, float]:
        """`keep`: committed rows (target and head) the prompt starts with, kept instead of recomputed."""
        if keep:
            return self._prefill_after(prompt, keep)
        self._reset()
        ids = np.asarray(prompt.input_ids, dtype=np.int64)
        length = ids.shape[0]
        image, deep = self.no_image, self.no_deep
        if self.manifest.is_vl:
            pos, self.delta = rope_index(ids, self.manifest.image_token_id, prompt.image_grid_thw,
                                         self.manifest.spatial_merge_size)
            if prompt.pixel_values is not None:
                image, deep = self._encode_images(prompt)
        else:
            pos = np.arange(length, dtype=np.int64)[None]
        hidden = self._run_target(ids, pos, np.tri(length, dtype=bool), self.pending, image, deep)
        self.start = length
        self.pending_rows, self.pending_from = length, 0
        top, _, entropy = self.project(hidden.buffer.rows(1, length - 1), "verify")
        return int(top[0, 0]), entropy

    def _prefill_after(self, prompt: Prompt, keep: int) -> tuple[int, float]:
        """Run only rows keep.. of the prompt, at the full prompt's positions, with the images they hold; the
        head keeps its context rows below `keep` and queues the taps of the rest after them."""
        if not 0 < keep <= self.start:
            raise ValueError(f"cannot keep {keep} rows of {self.start} committed")
        ids = np.asarray(prompt.input_ids, dtype=np.int64)
        length = ids.shape[0]
        self.kv.truncate(keep)
        if keep <= self.pending_from:
            self.head_kv.truncate(keep)
            self.pending_from = keep
        kept_taps = keep - self.pending_from
        image, deep = self.no_image, self.no_deep
        if self.manifest.is_vl:
            pos, self.delta = rope_index(ids, self.manifest.image_token_id, prompt.image_grid_thw,
                                         self.manifest.spatial_merge_size)
            tail = images_after(prompt, keep, self.manifest.image_token_id, self.manifest.spatial_merge_size)
            if tail is not None:
                image, deep = self._encode_images(tail)
            pos = np.ascontiguousarray(pos[..., keep:])
        else:
            pos = np.arange(keep, length, dtype=np.int64)[None]
        rows = length - keep
        hidden = self._run_target(ids[keep:], pos, np.tri(rows, dtype=bool), self.pending.after(kept_taps), image, deep)
        self.start = length
        self.pending_rows = kept_taps + rows
        top, _, entropy = self.project(hidden.buffer.rows(1, rows - 1), "verify")
        return int(top[0, 0]), entropy

    def draft(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k > self.manifest.branch_k:
            raise GlanceError(f"--branch-k {k} exceeds the draft graph's top-{self.manifest.branch_k}; "
                              f"lower it or re-export with `glance-export onnx --branch-k {k}`")
        rows = self.pending_rows
        self.head_kv.check_room(rows)
        self.embed_rows(np.array([anchor], np.int64), self.block, 0)
        self.device.upload(self.ctx_positions.rows(rows), np.arange(self.pending_from, self.pending_from + rows))
        self.device.upload(self.start_in.rows(1), np.array([self.start], np.int64))
        inputs = {"context_taps": self.pending.rows(rows), "context_positions": self.ctx_positions.rows(rows),
                  "block_embeds": self.block.rows(self.block_size), "start": self.start_in.rows(1),
                  **dict(zip(self.head_in, self.head_kv.past()))}
        outputs = {"hidden": self.draft_hidden.rows(self.block_size - 1),
                   **dict(zip(self.head_out, self.head_kv.new_rows(rows)))}
        self.graphs["draft"].run(inputs, outputs)
        self.head_kv.appended(rows)
        self.pending_rows, self.pending_from = 0, self.start
        ids, logp, _ = self.project(self.draft_hidden.rows(self.block_size - 1), "draft",
                                    extra={anchor: (self.block, 0)})
        return ids[:, :k].astype(np.int64), logp[:, :k].astype(np.float64)

    def verify(self, tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray
               ) -> tuple[np.ndarray, float, np.ndarray]:
        size = len(tokens)
        if size > self.max_tree:
            raise GlanceError(f"tree of {size} rows exceeds --max-tree {self.max_tree}; "
                              f"lower --budget to {self.max_tree - 1} or raise --max-tree (up to the build's limit)")
        positions = self._positions(self.start + np.asarray(depths, dtype=np.int64))
        hidden = self._run_target(np.asarray(tokens, dtype=np.int64), positions, visible, self.taps,
                                  self.no_image, self.no_deep)
        top, logp, entropy = self.project(hidden, "verify")
        return top[:, 0].astype(np.int64), entropy, logp[:, 0].astype(np.float64)

    def commit(self, rows: np.ndarray) -> None:
        """Compact the pack's KV on the device (kept rows move down after the prefix); queue their taps."""
        rows = np.asarray(rows, dtype=np.int64)
        self.kv.compact(rows)
        for i, row in enumerate(rows):
            self.device.copy(self.pending.rows(1, self.pending_rows + i), self.taps.rows(1, int(row)))
        self.pending_rows += len(rows)
        self.start += len(rows)
