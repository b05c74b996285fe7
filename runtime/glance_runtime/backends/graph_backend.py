"""The Backend protocol over exported graphs whose state lives on a device: shared by ONNX Runtime
(CPU or CUDA, through IOBinding) and TensorRT.

It mirrors the torch reference step for step (same positions, masks, head context and commit rule).
Everything a pass reads or writes is a preallocated `Buffer`, bound by address:
- KV caches (`kv_cache`) are slots of a KV pool (`kv_pool`; one slot where the backend decodes one sequence):
  the target and draft graphs read the pool in place (`slots`, `past_lengths`, `past_rows` say whose rows and
  how many) and a lone sequence's new rows are written right after its committed ones; a commit moves only the
  accepted rows, on the device. The same graphs run a batched round (`batch_rounds`).
- The vocab graph's projections (a draft's through draft_vocab where the head has a reduced vocabulary, and
  only of the offsets the tree can reach) return the top-k tokens' embeddings; the next anchor and every tree
  node is one of them, so inputs are assembled by device copies, not by another graph run.
- Per round the host sends the tree (ids, positions, mask: kilobytes) and reads back top-k ids,
  log-probs and one entropy (kilobytes). KV never crosses. Device calls per round, for a T-row tree
  with `kept` rows committed of which `moved` change place: 19 + T + kept + moved with a draft
  (draft 3, each projection 6, verify 4 + T embedding rows, commit kept taps rows + moved KV rows),
  10 + T + kept + moved without: independent of the context length and of the number of layers.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from ..decode.backend import BackendInfo, Prefilled, ServeLimits, Verified, block_rows, draft_rows
from ..decode.sampling import Draw, LogProbs
from .device_buffers import Buffer, CudaDevice, Device, Tensor
from .graph_chain import ChainGraph
from .graph import Graph
from .graph_clock import GraphClock
from ..formats.graphs import draft_kv_names, target_kv_names
from .hardware import cuda_gpu, host_cpu
from .kv_cache import KVCache
from .kv_pool import KVPool
from .row_draws import RowDraws
from .step_drafts import StepDrafts, head_rows
from ..errors import GlanceError
from ..formats.artifacts import Manifest
from ..decode.limits import check_branch_k, check_tree
from ..decode.tree import walked_choices
from ..prompt.prefix_reuse import image_runs
from ..prompt.prompt_builder import Prompt
from ..prompt.rope_index import TOKENS_PER_SECOND, rope_index, video_grids
from ..prompt.vision_indices import vision_index_inputs

PRECISION_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


EAGER_SAMPLING = 1 << 18  # logits a sampled verify samples in one call (every row); past it, row by row along the
# walk: a call costs a fixed 0.1-0.2 ms on a CPU, a row of a 151,936-token vocabulary 1.5-4 ms of hashing


def one(t: Tensor) -> Tensor:
    """`t` as a batch of one sequence (a leading axis of 1: the same bytes)."""
    return Tensor(t.buffer, t.offset, (1, *t.shape))


class GraphBackend:
    """prefill / draft / verify / commit on the vision, target, draft and vocab graphs."""

    binds_every_output = False  # TensorRT runs only with every output bound (ONNX Runtime skips unbound ones)

    def __init__(self, manifest: Manifest, device: Device, graphs: dict[str, Graph], *, max_context: int,
                 max_tree: int, name: str, home: Path, precision: str | None = None,
                 providers: tuple[str, ...] = (), threads: int | None = None, max_batch: int = 1,
                 weight_bytes: int = 0):
        """The KV caches are slot 0 of pools for `max_batch` sequences (`kv_pool`); `sibling` gives the other
        slots, and `batch_rounds.BatchRounds` runs a round for several at once. An EAGLE-3 head's cache is its
        own (its step graph decodes one sequence)."""
        self.name, self.manifest, self.device, self.graphs = name, manifest, device, graphs
        m = manifest
        hardware = cuda_gpu(device.device_id, device.compute_capability()) if isinstance(device, CudaDevice) \
            else host_cpu()
        steps = m.head_kind == "eagle3"
        self.info = BackendInfo(limits=ServeLimits(m.block_size, m.branch_k, max_tree, max_context, exported=True,
                                                   drafter="steps" if steps else "block"),
                                precision=precision or PRECISION_OF_DTYPE.get(m.float_dtype, m.float_dtype),
                                hardware=hardware, providers=providers, threads=threads, home=home, manifest=m)
        self._clock: GraphClock | None = None
        self.draft_projection = "draft_vocab" if "draft_vocab" in graphs else "vocab"  # the head's vocabulary
        self._owned: list[Buffer] = []  # what close() frees
        self._closed = False
        config = m.path / "config.json"
        vision = json.loads(config.read_text()).get("vision_config", {}) if m.is_vl and config.is_file() else {}
        self.tokens_per_second = vision.get("tokens_per_second", TOKENS_PER_SECOND)  # Qwen2.5-VL's video positions
        self.block_size, self.max_context, self.max_tree = m.block_size, max_context, max_tree
        self.float = np.dtype(m.float_dtype)
        hidden, k, width = m.hidden_size, m.branch_k, m.tap_width
        rows = max(max_tree, m.block_size - 1)
        self.max_batch, self.weight_bytes = max_batch, weight_bytes
        self.pool = KVPool(device, m.target.num_layers, m.target.kv_heads, m.target.head_dim, max_batch,
                           max_context, self.float)
        self.head_pool = None if steps else KVPool(device, m.head.num_layers, m.head.kv_heads, m.head.head_dim,
                                                   max_batch, max_context, self.float)
        self.kv = self.pool.cache(0)
        self.head_kv = (self.head_pool.cache(0) if self.head_pool else
                        KVCache(device, m.head.num_layers, m.head.kv_heads, m.head.head_dim,
                                head_rows(max_context, k), self.float))
        self.kv_in, self.kv_out = target_kv_names(m.target.num_layers)
        self.head_in, self.head_out = draft_kv_names(m.head.num_layers)
        self.pool_inputs = dict(zip(self.kv_in, self.pool.tensors()))  # fixed for the backend's life
        self.head_pool_inputs = dict(zip(self.head_in, self.head_pool.tensors())) if self.head_pool else {}
        new = self._new
        self.slot_in = new((1,), np.int64)  # this backend's slot in the pools (a sibling has its own)
        self.lengths_in = new((1,), np.int64)  # a target pass's past_lengths
        self.draft_in = new((3,), np.int64)  # a draft pass's start, context_lengths and past_lengths: one upload
        self.past_rows = new((max_context,), np.int64)  # 0..max_context-1: a pass reads the first S as past_rows
        device.upload(self.slot_in.rows(1), np.zeros(1, np.int64))
        device.upload(self.past_rows.rows(max_context), np.arange(max_context, dtype=np.int64))
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
        self.top_ids = new((rows, k), np.int64)
        self.top_logp = new((rows, k), np.float32)
        self.proj_rows = rows  # the most rows one projection runs
        # the projections' logits, which only sampling reads: bound from the start where a runtime binds every
        # output (TensorRT), else made when a pass first samples
        self.logits = new((rows, m.vocab_size), np.float32) if self.binds_every_output and m.sampling else None
        self.draws = RowDraws(device)  # a draw's tokens and reports from those logits, on the device where they are
        self.entropy = new((1,), np.float32)
        # top-k embeddings of the last projections, flat [rows * K, H]: row i belongs to token i of top_ids
        self.cands = {"draft": new(((m.block_size - 1) * k, hidden), self.float), "verify": new((rows * k, hidden), self.float)}
        self.scratch_row = new((1, hidden), self.float)
        self.no_id = new((1,), np.int64)  # the dummy id of a projection-only vocab run (token 0, set once)
        self.scratch_cands = new((k, hidden), self.float)
        self.no_image = new((1, hidden), self.float).rows(0)
        self.no_deep = new((max(m.deepstack_layers, 1), 1, hidden), self.float).tensor((m.deepstack_layers, 0, hidden))
        self._images: dict[str, Buffer] = {}  # vision inputs and outputs, sized by the largest image so far
        self._kept: dict[int, tuple[Buffer, int]] = {}  # token -> its row in a kept buffer (keep_embeddings)
        self._kept_rows: Buffer | None = None
        self._verified = np.zeros(0, np.int64)  # the last verify pass's tokens (a commit records the kept ones)
        self.steps = StepDrafts(self) if steps else None  # an EAGLE-3 head's draft_root / draft_step
        self._reset()
        device.upload(self.no_id.rows(1), np.zeros(1, np.int64))  # device memory is not zeroed
        self.embed_rows(np.array([m.mask_token_id], np.int64), self.block, 1)
        for row in range(2, m.block_size):
            device.copy(self.block.rows(1, row), self.block.rows(1, 1))

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV pools (the target's and the head's): what serving `max_batch` sequences adds."""
        return self.pool.nbytes + (self.head_pool or self.head_kv).buffer.nbytes

    def memory_line(self) -> str:
        """What the load holds: the weights once, whatever the batch, and the KV pool for `max_batch` sequences."""
        mib = float(1 << 20)
        sequences = f"{self.max_batch} sequence{'s' * (self.max_batch != 1)}"
        return (f"weights {self.weight_bytes / mib:.0f} MiB (one copy for any batch), KV pool {self.kv_bytes / mib:.0f} "
                f"MiB for {sequences} of {self.max_context} rows")

    def sibling(self, slot: int) -> "GraphBackend":
        """Slot `slot` of the pools as a backend of its own: its caches, committed rows and queued taps are the
        slot's; graphs and every per-pass buffer are shared with this backend (one pass runs at a time), which
        owns and frees them all."""
        if self.max_batch < 2 or self.head_pool is None:
            raise GlanceError("this backend was opened for one sequence; open it with --max-batch 2 or more")
        other = copy.copy(self)
        other.kv, other.head_kv = self.pool.cache(slot), self.head_pool.cache(slot)
        other.pending = self._new(self.pending.shape, self.float)
        other.slot_in = self._new((1,), np.int64)
        self.device.upload(other.slot_in.rows(1), np.array([slot], np.int64))
        other._closed = True  # closing is the owner's
        other._reset()
        return other

    def _new(self, shape: tuple[int, ...], dtype) -> Buffer:
        buffer = self.device.empty(shape, dtype)
        self._owned.append(buffer)
        return buffer

    def _reset(self) -> None:
        self.kv.clear()
        self.head_kv.clear()
        self.start = 0  # stream position of the current anchor == committed target KV rows
        self.delta = 0  # M-RoPE offset: text position = stream position + delta
        self.pending_rows, self.pending_from = 0, 0
        self.known: dict[int, tuple[Buffer, int]] = {}  # token -> where its embedding row is on the device
        if self.steps is not None:
            self.steps.cached = 0

    # -- the vocab graph ------------------------------------------------------------------------------

    def embed_rows(self, tokens: np.ndarray, dst: Buffer, first: int) -> None:
        """Write the embeddings of `tokens` into rows first.. of dst: copied from where the last projections
        (or `keep_embeddings`) left them, or (for tokens from elsewhere: a prompt) one vocab run."""
        found = [self.known.get(int(t)) or self._kept.get(int(t)) for t in tokens]
        if all(found):
            for i, (buf, row) in enumerate(found):
                self.device.copy(dst.rows(1, first + i), buf.rows(1, row))
            return
        self.embed_fresh(tokens, dst, first)

    def embed_fresh(self, tokens: np.ndarray, dst: Buffer, first: int) -> None:
        """`embed_rows` by one vocab run, whatever earlier projections left: for callers whose tokens this
        backend's own projections did not produce (a batch's, whose rows those projections no longer hold)."""
        count = len(tokens)
        # A run that only embeds projects no row on the CPU: the graph's LM head then reads none of its matrix (a
        # dummy row cost a whole projection, 9 ms at 3B width int4). Elsewhere one dummy row, as engine profiles
        # and device kernels start at one.
        rows = 0 if self.device.kind == "cpu" else 1
        self.device.upload(self.ids.rows(count), tokens)
        outputs = {"embeds": dst.rows(count, first), "topk_ids": self.top_ids.rows(rows),
                   "topk_logprobs": self.top_logp.rows(rows),
                   "topk_embeds": self.scratch_cands.tensor((rows, *self.scratch_cands.shape)),
                   **self.logits_out(rows)}
        if rows:  # of no row the entropy is empty, not the one value the graph declares: ONNX Runtime keeps it
            outputs["entropy"] = self.entropy.rows(1)
        self.graphs["vocab"].run({"ids": self.ids.rows(count), "hidden": self.scratch_row.rows(rows)}, outputs)

    def keep_embeddings(self, tokens: list[int]) -> None:
        """Embed `tokens` once, into a buffer kept until the next call, and copy them from there whenever a pass
        needs them. For drafters whose tokens do not come out of this backend's projections (a seeded drafter):
        a head's drafts arrive with their embeddings, and without this each round would pay a vocab run for
        the seeded ones."""
        unique = np.array(sorted(set(int(t) for t in tokens)), np.int64)
        if self._kept_rows is not None:
            self.device.free(self._kept_rows)
            self._owned.remove(self._kept_rows)
        self._kept, self._kept_rows = {}, None
        if not len(unique):
            return
        self._kept_rows = self._new((len(unique), self.manifest.hidden_size), self.float)
        step = self.ids.shape[0]
        for first in range(0, len(unique), step):
            self.embed_rows(unique[first:first + step], self._kept_rows, first)
        self._kept = {int(t): (self._kept_rows, i) for i, t in enumerate(unique)}

    def logits_out(self, rows: int, graph: str = "vocab", wanted: bool = False) -> dict[str, Tensor]:
        """The `logits` output of a vocabulary-graph run over `rows` rows: bound where a draw reads it, where the
        runtime binds every output, and once a pass has sampled (a run's outputs then stay the same set, so ONNX
        Runtime does not rebind them all between sampled and other runs); else none (left unfetched)."""
        if not (wanted or self.logits is not None or (self.binds_every_output and self.manifest.sampling)):
            return {}
        if not self.manifest.sampling:
            raise GlanceError(f"{self.manifest.path} was exported before sampling: its vocab graph returns no "
                              "logits to sample from or to report log-probs of; re-export it with `glance-export "
                              "onnx` (and rebuild its engines), or decode greedily (temperature 0) without log-probs")
        if self.logits is None:
            self.logits = self._new((self.proj_rows, self.manifest.vocab_size), np.float32)
        width = self.manifest.draft_vocab_size if graph == "draft_vocab" else self.manifest.vocab_size
        return {"logits": self.logits.tensor((rows, width))}

    def project(self, hidden: Tensor, into: str, extra: dict[int, tuple[Buffer, int]] | None = None,
                graph: str = "vocab", logits: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
        """Top-k ids and log-probs of hidden rows and the entropy of the first; their top-k embeddings land in
        `self.cands[into]` and become where later passes copy their input embeddings from. `graph`: vocab, or
        draft_vocab (the head's reduced vocabulary: same outputs, target ids). `logits`: the rows' logits land
        in `self.logits` too (to sample from)."""
        rows, k = hidden.shape[0], self.manifest.branch_k
        cands = self.cands[into]
        outputs = {"embeds": self.scratch_row.rows(1), "topk_ids": self.top_ids.rows(rows),
                   "topk_logprobs": self.top_logp.rows(rows), "entropy": self.entropy.rows(1),
                   "topk_embeds": cands.tensor((rows, k, cands.shape[1])), **self.logits_out(rows, graph, logits)}
        self.graphs[graph].run({"ids": self.no_id.rows(1), "hidden": hidden}, outputs)
        ids = self.device.download(self.top_ids.rows(rows))
        logp = self.device.download(self.top_logp.rows(rows))
        entropy = float(self.device.download(self.entropy.rows(1))[0])
        self.known = {int(t): (cands, i) for i, t in enumerate(ids.reshape(-1))}
        self.known.update(extra or {})
        return ids, logp, entropy

    # -- the target graph -----------------------------------------------------------------------------

    def _positions(self, stream: np.ndarray) -> np.ndarray:
        """Stream positions + delta: [3, 1, T] (same on every M-RoPE axis) for VL targets, else [1, T]: a batch
        of one."""
        pos = np.empty((3 if self.manifest.is_vl else 1, 1, len(stream)), np.int64)
        pos[:] = stream + self.delta
        return pos if self.manifest.is_vl else pos[0]

    def _run_target(self, ids: np.ndarray, positions: np.ndarray, tree_mask: np.ndarray, taps: Buffer,
                    image: Tensor, deep: Tensor) -> Tensor:
        """One target pass over T rows after the committed ones, as a batch of one: new K/V rows land in the
        slot right after its committed rows, taps in the first T rows of `taps`; returns the hidden rows (on the
        device). Room is checked before any view."""
        rows = len(ids)
        self.kv.check_room(rows)
        self.embed_rows(ids, self.embeds, 0)
        self.device.upload(self.ids.rows(rows), ids)
        self.device.upload(self.positions.tensor(positions.shape), positions)
        self.device.upload(self.mask.tensor((1, rows, rows)), np.ascontiguousarray(tree_mask, dtype=bool))
        self.device.upload(self.lengths_in.rows(1), np.array([self.kv.length], np.int64))
        inputs = {"input_ids": self.ids.tensor((1, rows)), "inputs_embeds": one(self.embeds.rows(rows)),
                  "position_ids": self.positions.tensor(positions.shape), "tree_mask": self.mask.tensor((1, rows, rows)),
                  "slots": self.slot_in.rows(1), "past_lengths": self.lengths_in.rows(1),
                  "past_rows": self.past_rows.rows(self.kv.length), **self.pool_inputs}
        if self.manifest.is_vl:
            inputs["image_embeds"] = image
            if self.manifest.deepstack_layers:
                inputs["deepstack_embeds"] = deep
        hidden = self.hidden.rows(rows)
        outputs = {"hidden": one(hidden), "taps": one(taps.rows(rows)),
                   **dict(zip(self.kv_out, self.kv.new_rows(rows, (1,))))}
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

    def _encode_image(self, pixels: np.ndarray, grid: np.ndarray) -> tuple[Tensor, Tensor]:
        """Image rows (and Qwen3-VL deepstack rows) on the device; inputs are the pixels and the grid-derived
        index tensors the graph declares."""
        feeds = {"pixel_values": pixels.astype(self.float), "image_grid_thw": grid}
        feeds.update(vision_index_inputs(grid, self.manifest.vision_index_params))
        graph = self.graphs["vision"]
        inputs = {}
        for name, array in feeds.items():
            if name in graph.input_names:
                inputs[name] = self._image_buffer(name, array.shape, array.dtype)
                self.device.upload(inputs[name], array)
        merged = len(pixels) // self.manifest.spatial_merge_size ** 2
        hidden = self.manifest.hidden_size
        outputs = {"image_embeds": self._image_buffer("image_embeds", (merged, hidden), self.float)}
        deep = self.no_deep
        if self.manifest.deepstack_layers:
            deep = outputs["deepstack_embeds"] = self._image_buffer(
                "deepstack_embeds", (self.manifest.deepstack_layers, merged, hidden), self.float)
        graph.run(inputs, outputs)
        return outputs["image_embeds"], deep

    def _vision_passes(self, prompt: Prompt, keep: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Pixels and a still-image grid per vision pass, in prompt order, for the images and videos from row
        `keep` on. A video runs one pass per temporal patch: every family's tower attends within a frame group
        only (and places it the same whatever follows), so the passes give the rows one pass over it would."""
        m = self.manifest
        passes = []
        for run in image_runs(prompt, m.image_token_id, m.spatial_merge_size):
            if run.start < keep < run.start + run.tokens:
                raise ValueError(f"kept rows ({keep}) end inside an image or video; keep all of its rows or none")
            if run.start < keep:
                continue
            if not run.video:
                passes.append((prompt.pixel_values[run.offset:run.offset + run.patches],
                               prompt.image_grid_thw[run.index][None]))
                continue
            t, h, w = (int(v) for v in prompt.video_grid_thw[run.index])
            for group in range(t):
                first = run.offset + group * h * w
                passes.append((prompt.pixel_values_videos[first:first + h * w], np.array([[1, h, w]], np.int64)))
        return passes

    def _encode_images(self, passes: list[tuple[np.ndarray, np.ndarray]]) -> tuple[Tensor, Tensor]:
        """Every pass's rows, concatenated in prompt order (deepstack rows too, per layer): the vision graph
        takes one image per run, the target graph takes all of a pass's image rows at once."""
        if len(passes) == 1:
            return self._encode_image(*passes[0])
        merge2 = self.manifest.spatial_merge_size ** 2
        total = sum(len(pixels) for pixels, _ in passes) // merge2
        hidden, layers = self.manifest.hidden_size, self.manifest.deepstack_layers
        item = self.float.itemsize
        rows = self._image_buffer("all_image_embeds", (total, hidden), self.float)
        deep = self.no_deep
        if layers:
            deep = self._image_buffer("all_deepstack_embeds", (layers, total, hidden), self.float)
        first_row = 0
        for pixels, grid in passes:
            image, image_deep = self._encode_image(pixels, grid)
            merged = len(pixels) // merge2
            self.device.copy(rows.buffer.tensor((merged, hidden), first_row * hidden * item), image)
            for layer in range(layers):
                self.device.copy(deep.buffer.tensor((merged, hidden), (layer * total + first_row) * hidden * item),
                                 image_deep.buffer.tensor((merged, hidden), layer * merged * hidden * item))
            first_row += merged
        return rows, deep

    def _prompt_positions(self, prompt: Prompt) -> tuple[np.ndarray, int]:
        m = self.manifest
        grids, steps = video_grids(m.family, prompt.video_grid_thw, prompt.second_per_grid_ts, self.tokens_per_second)
        return rope_index(prompt.input_ids, m.image_token_id, prompt.image_grid_thw, m.spatial_merge_size,
                          prompt.video_token_id, grids, steps)

    def _graph_ids(self, prompt: Prompt) -> np.ndarray:
        """The prompt's ids as the target graph reads them: video tokens carry the image token id, since the
        graph places vision rows (of images and videos alike, in prompt order) at image tokens."""
        ids = np.asarray(prompt.input_ids, dtype=np.int64)
        if prompt.video_token_id is None:
            return ids
        return np.where(ids == prompt.video_token_id, self.manifest.image_token_id, ids)

    # -- the Backend protocol -------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, keep: int = 0, draw: Draw | None = None) -> Prefilled:
        """`keep`: committed rows (target and head) the prompt starts with, kept instead of recomputed; `draw`:
        the first token sampled, not the argmax, and reported."""
        if keep:
            return self._prefill_after(prompt, keep, draw)
        self._reset()
        ids = self._graph_ids(prompt)
        length = ids.shape[0]
        image, deep = self.no_image, self.no_deep
        if self.manifest.is_vl:
            pos, self.delta = self._prompt_positions(prompt)
            passes = self._vision_passes(prompt)
            if passes:
                image, deep = self._encode_images(passes)
        else:
            pos = np.arange(length, dtype=np.int64)[None]
        self.kv.check_prompt(length)  # before the [length, length] mask below is allocated
        hidden = self._run_target(ids, pos, np.tri(length, dtype=bool), self.pending, image, deep)
        self.start = length
        self.pending_rows, self.pending_from = length, 0
        if self.steps is not None:
            self.steps.prompt(np.asarray(prompt.input_ids, np.int64), pos, 0, self.delta)
        return self._first(hidden.buffer.rows(1, length - 1), draw)

    def _first(self, row: Tensor, draw: Draw | None) -> Prefilled:
        """The first generated token from the prompt's last hidden row (the argmax, or sampled at position 0), the
        entropy it was taken from, and its report."""
        top, logp, entropy = self.project(row, "verify", logits=draw is not None)
        if draw is None:
            return Prefilled(int(top[0, 0]), entropy)
        token, _, report = self._drawn(top, logp, draw, np.zeros(1, np.int64), np.zeros(1, np.int64))
        return Prefilled(int(token[0]), entropy, report)

    def _drawn(self, top: np.ndarray, logp: np.ndarray, draw: Draw, depths: np.ndarray, rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, LogProbs | None]:
        """`RowDraws.drawn` over the last projection's `rows` (top-k ids and log-probs `top`, `logp`; tree depths
        `depths` of every projected row)."""
        return self.draws.drawn(self.logits, self.manifest.vocab_size, draw, rows, depths[rows], top[rows, 0],
                                logp[rows, 0])

    def _prefill_after(self, prompt: Prompt, keep: int, draw: Draw | None) -> Prefilled:
        """Run only rows keep.. of the prompt, at the full prompt's positions, with the images they hold; the
        head keeps its context rows below `keep` and queues the taps of the rest after them."""
        if not 0 < keep <= self.start:
            raise ValueError(f"cannot keep {keep} rows of {self.start} committed")
        ids = self._graph_ids(prompt)
        length = ids.shape[0]
        self.kv.truncate(keep)
        if keep <= self.pending_from:
            self.head_kv.truncate(keep)
            self.pending_from = keep
        kept_taps = keep - self.pending_from
        image, deep = self.no_image, self.no_deep
        if self.manifest.is_vl:
            pos, self.delta = self._prompt_positions(prompt)
            passes = self._vision_passes(prompt, keep)
            if passes:
                image, deep = self._encode_images(passes)
            pos = np.ascontiguousarray(pos[..., keep:])
        else:
            pos = np.arange(keep, length, dtype=np.int64)[None]
        rows = length - keep
        hidden = self._run_target(ids[keep:], pos, np.tri(rows, dtype=bool), self.pending.after(kept_taps), image, deep)
        self.start = length
        self.pending_rows = kept_taps + rows
        if self.steps is not None:
            self.steps.prompt(np.asarray(prompt.input_ids, np.int64), pos, keep, self.delta)
        return self._first(hidden.buffer.rows(1, rows - 1), draw)

    def draft(self, anchor: int, k: int, depth: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.steps is not None:
            raise GlanceError("this EAGLE-3 head drafts one depth per pass: use draft_root and draft_step")
        check_branch_k(self.info.limits, k)
        offsets = draft_rows(self.block_size, depth)
        block = block_rows(self.block_size, depth, self.manifest.short_blocks)
        rows = self.pending_rows
        self.head_kv.check_room(rows)
        self.embed_rows(np.array([anchor], np.int64), self.block, 0)
        self.device.upload(self.ctx_positions.rows(rows), np.arange(self.pending_from, self.pending_from + rows))
        self.device.upload(self.draft_in.rows(3), np.array([self.start, rows, self.head_kv.length], np.int64))
        inputs = {"context_taps": one(self.pending.rows(rows)), "context_positions": one(self.ctx_positions.rows(rows)),
                  "block_embeds": one(self.block.rows(block)), "start": self.draft_in.rows(1),
                  "context_lengths": self.draft_in.rows(1, 1), "past_lengths": self.draft_in.rows(1, 2),
                  "slots": self.slot_in.rows(1), "past_rows": self.past_rows.rows(self.head_kv.length),
                  **self.head_pool_inputs}
        outputs = {"hidden": one(self.draft_hidden.rows(block - 1)),
                   **dict(zip(self.head_out, self.head_kv.new_rows(rows, (1,))))}
        self.graphs["draft"].run(inputs, outputs)
        self.head_kv.appended(rows)
        self.pending_rows, self.pending_from = 0, self.start
        ids, logp, _ = self.project(self.draft_hidden.rows(offsets), "draft", extra={anchor: (self.block, 0)},
                                    graph=self.draft_projection)
        return ids[:, :k].astype(np.int64), logp[:, :k].astype(np.float64)

    def draft_root(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """An EAGLE-3 round's first depth (`decode.backend.StepDrafter`)."""
        if self.steps is None:
            raise GlanceError("this head drafts a whole block per pass (GLANCE): use draft")
        return self.steps.draft_root(anchor, k)

    def draft_step(self, tokens: np.ndarray, parents: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One more depth of an EAGLE-3 round (`decode.backend.StepDrafter`)."""
        if self.steps is None:
            raise GlanceError("this head drafts a whole block per pass (GLANCE): use draft")
        return self.steps.draft_step(tokens, parents, k)

    def verify(self, tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray, draw: Draw | None = None
               ) -> Verified:
        """`Backend.verify`; with `draw`, a tree of more than EAGER_SAMPLING logits samples and reports only the
        walk's path (the other rows keep their argmax: the walk never reads them), as many rows as it accepts,
        plus one."""
        check_tree(self.info.limits, len(tokens))
        self._verified = np.asarray(tokens, dtype=np.int64)
        positions = self._positions(self.start + np.asarray(depths, dtype=np.int64))
        hidden = self._run_target(np.asarray(tokens, dtype=np.int64), positions, visible, self.taps,
                                  self.no_image, self.no_deep)
        top, logp, entropy = self.project(hidden, "verify", logits=draw is not None)
        chosen, confidence = top[:, 0].astype(np.int64), logp[:, 0].astype(np.float64)
        if draw is None:
            return Verified(chosen, entropy, confidence)
        depths = np.asarray(depths, np.int64)
        report = LogProbs.blank(len(tokens), draw.top_n or 0) if draw.reports else None
        if len(tokens) * self.manifest.vocab_size <= EAGER_SAMPLING:  # one call for every row: cheaper when small
            rows = np.arange(len(tokens))
        elif not draw.samples:  # the argmax is known: report the walk's rows in one call
            rows = np.array(sorted(walked_choices(tokens, depths, visible, lambda row: int(chosen[row]))))
        else:
            def choose(row: int) -> int:  # sample only where the walk reads: the accepted path and the row after it
                token, log_prob, part = self._drawn(top, logp, draw, depths, np.array([row]))
                chosen[row], confidence[row] = token[0], log_prob[0]
                if part is not None:
                    report.put(np.array([row]), part)
                return int(token[0])

            walked_choices(tokens, depths, visible, choose)
            return Verified(chosen, entropy, confidence, report)
        chosen[rows], confidence[rows], part = self._drawn(top, logp, draw, depths, rows)
        return Verified(chosen, entropy, confidence, report if part is None else report.put(rows, part))

    def margins(self, rows: int) -> np.ndarray:
        """Top-1 minus top-2 log-prob (the logit gap) of the first `rows` rows of the last verify pass: how near
        a tie each greedy choice was (an audit reports it where two decodes part)."""
        logp = self.device.download(self.top_logp.rows(rows)).astype(np.float64)
        return logp[:, 0] - logp[:, 1] if logp.shape[1] > 1 else np.full(rows, np.inf)

    def commit(self, rows: np.ndarray) -> None:
        """Compact the pack's KV on the device (kept rows move down after the prefix); queue their taps."""
        rows = np.asarray(rows, dtype=np.int64)
        self.kv.compact(rows)
        if self.steps is not None:
            self.steps.committed(self.start, self._verified[rows], self.delta)
        for i, row in enumerate(rows):
            self.device.copy(self.pending.rows(1, self.pending_rows + i), self.taps.rows(1, int(row)))
        self.pending_rows += len(rows)
        self.start += len(rows)

    def time_graphs(self) -> GraphClock:
        """The backend's own graphs swapped for timed ones, once; later calls return the same clock."""
        if self._clock is None:
            self._clock = GraphClock(self.graphs, self.device.synchronize)
            self.graphs.update(self._clock.graphs)
        return self._clock

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.draws.close()
        caches = [self.pool.buffer, (self.head_pool or self.head_kv).buffer]
        for buffer in [*self._owned, *self._images.values(), *caches]:
            self.device.free(buffer)
        for graph in self.graphs.values():
            graph = getattr(graph, "graph", graph)  # a timed graph's own
            if isinstance(graph, ChainGraph):
                graph.close()  # the buffers between its parts
        self._owned, self._images, self.graphs = [], {}, {}
