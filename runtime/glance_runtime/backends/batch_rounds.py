"""A decode round for several sequences at once: one draft pass, one verify pass, commits per sequence.

Sequences live in the slots of a graph backend opened with `max_batch` > 1 (`GraphBackend.sibling`): each slot
prefills as a sequence alone (a batch of one), in place in the KV pool, and every round after that runs the same
target and draft graphs (`formats.graphs`) over all the sequences taking part. Per round the host
sends each sequence's tree (ids, positions, mask) and reads back top-k ids and log-probs; KV never crosses:
a pass's new rows land in a staging buffer and the accepted ones are copied into their slots, one strided copy
per kept row across every layer. Embeddings are copied from where the last projections left them, as the
single-sequence backend does, per slot.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..decode.auto_budget import AutoBudget
from ..decode.backend import Prefilled, Verified, block_rows, draft_rows
from ..decode.batch_budget import BatchBudget, BatchCost, start_from_profile
from ..decode.batch_loop import BatchLoop
from ..decode.limits import check_branch_k, check_tree
from ..decode.sampling import Draw, LogProbs
from ..errors import GlanceError
from ..formats.common import MAX_BATCH
from ..formats.graphs import draft_kv_names, target_kv_names
from .device_buffers import Buffer, Tensor
from .graph_backend import GraphBackend

if TYPE_CHECKING:
    from ..decode.session import Session


def check_batch(manifest, max_batch: int) -> None:
    """Refuse, in one line naming the fix, a batch the artifacts cannot serve (before anything is sized for it: a
    batch past the export's bound is refused by that bound, not by the memory it would take)."""
    if manifest.head_kind == "eagle3":
        raise GlanceError("an EAGLE-3 head drafts a depth per pass and decodes one request at a time; "
                          "use --max-batch 1")
    exported = manifest.max_batch
    if max_batch > exported:
        fix = (f"re-export with `glance-export onnx --max-batch {max_batch}`" if max_batch <= MAX_BATCH else
               f"no export batches more than {MAX_BATCH}")
        raise GlanceError(f"--max-batch {max_batch} is above the {exported} these artifacts were exported for; "
                          f"lower it to {exported} or less ({fix})")


class BatchRounds:
    """Batched draft, verify and commit over the slots of `base` (slot 0 is `base` itself)."""

    def __init__(self, base: GraphBackend):
        if base.max_batch < 2 or base.head_pool is None:
            raise GlanceError("this backend was opened for one sequence; open it with --max-batch 2 or more")
        self.base, m = base, base.manifest
        self.slots = [base] + [base.sibling(i) for i in range(1, base.max_batch)]
        self.pool, self.head_pool = base.pool, base.head_pool
        self.device = dev = base.device
        P, T, k = base.max_batch, base.max_tree, m.branch_k
        self.block_size, hidden, width = m.block_size, m.hidden_size, m.tap_width
        drafted = self.block_size - 1
        new = base._new
        f = base.float
        self.embeds = new((P * T, hidden), f)
        self.ids = new((P * T,), np.int64)  # the trees' tokens (a VL target finds image tokens among them)
        self.positions = new((3 * P * T,), np.int64)
        self.mask = new((P * T * T,), np.bool_)
        self.slot_ids = new((P,), np.int64)
        self.lengths = new((P,), np.int64)
        self.rows = base.past_rows
        self.hidden = new((P * T, hidden), f)
        self.packed = new((P * max(T, drafted), hidden), f)
        self.taps = new((P * T, width), f)
        self.present = new((2 * m.target.num_layers, P * T, m.target.kv_heads, m.target.head_dim), f)
        self.ctx_taps = new((P * self.block_size, width), f)  # a round adds at most B rows a sequence
        self.ctx_positions = new((P * self.block_size,), np.int64)
        self.ctx_lengths = new((P,), np.int64)
        self.starts = new((P,), np.int64)
        self.ctx_out = new((2 * m.head.num_layers, P * self.block_size, m.head.kv_heads, m.head.head_dim), f)
        self.blocks: dict[int, Buffer] = {}  # per block length L: [anchor, MASK x (L-1)] rows of P sequences
        self.draft_hidden = new((P * drafted, hidden), f)
        rows = P * max(T, drafted)
        self.projection_rows = max(T, drafted)  # what a lone pass projects at most (the vocab graph's R bound)
        self.top_ids, self.top_logp = new((rows, k), np.int64), new((rows, k), np.float32)
        self.entropy = new((1,), np.float32)
        self.cands = {"draft": new((P * drafted * k, hidden), f), "verify": new((P * T * k, hidden), f)}
        self.anchor_rows = new((P, hidden), f)  # a joiner's first anchor, safe from the next joiner's prefill
        self.scratch_row = new((1, hidden), f)
        self.known: list[dict[int, tuple[Buffer, int]]] = [{} for _ in range(P)]
        self.mask_row = new((1, hidden), f)
        base.embed_rows(np.array([m.mask_token_id], np.int64), self.mask_row, 0)
        self.short_blocks = m.short_blocks
        self.target_pool_in, self.target_out = target_kv_names(m.target.num_layers)
        self.head_pool_in, self.head_out = draft_kv_names(m.head.num_layers)

    def _block(self, length: int) -> Buffer:
        """The block rows of a round drafting `length` rows a sequence: every sequence's masks set once, the
        anchor rows (b * length) written each round. A length is laid out the first time a round drafts it."""
        if length not in self.blocks:
            block = self.base._new((self.capacity * length, self.mask_row.shape[1]), self.base.float)
            for row in range(self.capacity * length):
                if row % length:
                    self.device.copy(block.rows(1, row), self.mask_row.rows(1))
            self.blocks[length] = block
        return self.blocks[length]

    @property
    def capacity(self) -> int:
        return len(self.slots)

    # -- joining --------------------------------------------------------------------------------------

    def prefill(self, slot: int, prompt, keep: int = 0, draw: Draw | None = None) -> Prefilled:
        """Prefill `prompt` into `slot` as a sequence alone; the first anchor's embedding is kept where
        the next prefill cannot overwrite it. The prompt's taps wait for the slot's first draft (a batched draft
        hands more rows than a round commits to a draft pass of the slot alone first: `_absorb`)."""
        backend = self.slots[slot]
        backend.known = {}  # the shared projections' rows belong to whichever slot ran last
        prefilled = backend.prefill(prompt, keep, draw)
        self.keep_anchor(slot, prefilled.first)
        return prefilled

    def _absorb(self, slot: int, anchor: int) -> None:
        """The slot's queued taps into its head cache through a draft pass of the slot alone (its draft is not
        used): a prompt's, or those of more rounds without a draft than a batched draft takes rows."""
        backend = self.slots[slot]
        found = self.known[slot].get(anchor)
        backend.known = {anchor: found} if found else {}
        backend.draft(anchor, 1, 1)

    def alone(self, slot: int, anchor: int) -> GraphBackend:
        """The slot's backend for a round of its own (one sequence in the batch): the slot's passes as a batch of one,
        seeing the anchor's embedding where this class keeps it. `keep_anchor` after its commit."""
        backend = self.slots[slot]
        found = self.known[slot].get(anchor)  # a sampled anchor may lie outside the last projection's top-k
        backend.known = {anchor: found} if found else {}
        return backend

    def keep_anchor(self, slot: int, token: int) -> None:
        """The slot's next anchor embedding, copied where no other slot's pass overwrites it."""
        backend = self.slots[slot]
        found = backend.known.get(token) or self.known[slot].get(token)
        if found is None:
            backend.embed_rows(np.array([token], np.int64), self.anchor_rows, slot)
        elif found != (self.anchor_rows, slot):
            self.device.copy(self.anchor_rows.rows(1, slot), found[0].rows(1, found[1]))
        self.known[slot] = {token: (self.anchor_rows, slot)}

    # -- embeddings -----------------------------------------------------------------------------------

    def _embed(self, rows: list[tuple[int, np.ndarray]], dst: Buffer, stride: int) -> None:
        """Rows b * stride.. of dst: the embeddings of the tokens of (slot, tokens) b, copied from the slot's last
        projections (or kept embeddings), one gather per buffer they lie in; a sequence with a token from elsewhere
        gets its rows from one vocab run."""
        kept = self.base._kept
        moves: dict[int, tuple[Buffer, list[int], list[int]]] = {}
        for b, (slot, tokens) in enumerate(rows):
            known = self.known[slot]
            found = [known.get(int(t)) or kept.get(int(t)) for t in tokens]
            if not all(found):
                self.base.embed_fresh(np.asarray(tokens, np.int64), dst, b * stride)
                continue
            for i, (buf, row) in enumerate(found):
                move = moves.setdefault(id(buf), (buf, [], []))
                move[1].append(b * stride + i)
                move[2].append(row)
        for buf, to, of in moves.values():
            self.device.copy_rows(dst, np.array(to), buf, np.array(of), dst.row_bytes)

    def _project(self, hidden: Tensor, rows: int, into: str, graph: str,
                 draws: list[tuple[Draw | None, np.ndarray]] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, dict[int, LogProbs]]]:
        """Top-k of `rows` hidden rows, in runs of at most the rows a lone pass projects: a vocabulary-wide
        projection's activations grow with its rows (at 3B width 2.4 MB of logits a row, and as much again for
        their log-softmax), so a batch projecting all its trees at once held hundreds of MB more than a lone
        sequence; and a TensorRT vocab engine's profile stops at that many rows. Also each row's token and its
        log-prob: the argmax, or where `draws` (per sequence, in packing order: its Draw and its rows' depths)
        samples, the token sampled from that run's logits as the sequence alone would; and the report of each
        sequence whose Draw asks for one, by its index in `draws`."""
        k, cands = self.base.manifest.branch_k, self.cands[into]
        width, step = cands.shape[1], self.projection_rows
        item = cands.dtype.itemsize
        owner = np.concatenate([np.full(len(d), i) for i, (_, d) in enumerate(draws)]) if draws else None
        depth = np.concatenate([d for _, d in draws]) if draws else None
        chosen, confidence = np.zeros(rows, np.int64), np.zeros(rows, np.float64)
        reports = {i: LogProbs.blank(len(d), draw.top_n or 0) for i, (draw, d) in enumerate(draws or ())
                   if draw is not None and draw.reports}
        for first in range(0, rows, step):
            n = min(step, rows - first)
            sampled = draws is not None and any(draws[i][0] for i in set(owner[first:first + n].tolist()))
            outputs = {"embeds": self.scratch_row.rows(1), "topk_ids": self.top_ids.rows(n, first),
                       "topk_logprobs": self.top_logp.rows(n, first), "entropy": self.entropy.rows(1),
                       "topk_embeds": cands.tensor((n, k, width), first * k * width * item),
                       **self.base.logits_out(n, graph, sampled)}
            part = Tensor(hidden.buffer, hidden.offset + first * width * item, (n, width))
            self.base.graphs[graph].run({"ids": self.base.no_id.rows(1), "hidden": part}, outputs)
            if sampled:
                self._sample_run(first, n, draws, owner, depth, chosen, confidence, reports)
        ids, logp = self.device.download(self.top_ids.rows(rows)), self.device.download(self.top_logp.rows(rows))
        greedy = np.ones(rows, bool) if owner is None else np.array(
            [draws[i][0] is None or not draws[i][0].samples for i in owner.tolist()])
        chosen[greedy], confidence[greedy] = ids[greedy, 0], logp[greedy, 0]
        return ids, logp, (chosen, confidence, reports)

    def _sample_run(self, first: int, n: int, draws: list[tuple[Draw | None, np.ndarray]], owner: np.ndarray,
                    depth: np.ndarray, chosen: np.ndarray, confidence: np.ndarray, reports: dict[int, LogProbs]
                    ) -> None:
        """The sampled rows of one projection run (rows first..first+n of the pack) into `chosen` and `confidence`,
        from the logits it left (`Draw.choose_with_logprob`), and the reported rows' reports into `reports`."""
        base = self.base
        top = self.device.download(self.top_ids.rows(n, first))[:, 0]
        top_logp = self.device.download(self.top_logp.rows(n, first))[:, 0].astype(np.float64)
        span = slice(first, first + n)
        starts = np.cumsum([0] + [len(d) for _, d in draws])
        for i in sorted(set(owner[span].tolist())):
            draw = draws[i][0]
            if draw is None:
                continue
            local = np.flatnonzero(owner[span] == i)
            chosen[first + local], confidence[first + local], part = base.draws.drawn(
                base.logits, base.manifest.vocab_size, draw, local, depth[span][local], top[local], top_logp[local])
            if part is not None:
                reports[i].put(first + local - starts[i], part)

    def _pack(self, src: Buffer, stride: int, counts: list[int]) -> Tensor:
        """The first counts[b] of each sequence's `stride` rows of src, consecutive in `packed`; src itself
        where every sequence uses all its rows."""
        total = sum(counts)
        if all(c == stride for c in counts):
            return src.rows(total)
        at = 0
        for b, count in enumerate(counts):
            self.device.copy(self.packed.rows(count, at), src.rows(count, b * stride))
            at += count
        return self.packed.rows(total)

    def _remember(self, slots: list[int], ids: np.ndarray, counts: list[int], into: str) -> None:
        k = ids.shape[1]
        at = 0
        for slot, count in zip(slots, counts):
            flat = ids[at:at + count].reshape(-1)
            self.known[slot] = {int(t): (self.cands[into], at * k + i) for i, t in enumerate(flat)}
            at += count

    # -- the round ------------------------------------------------------------------------------------

    def draft(self, asks: list[tuple[int, int, int, int | None]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """One head pass for every (slot, anchor, k, depth): each slot's new context rows join its head cache
        and its block [anchor, MASK x (B-1)] is drafted; returns per ask the top-k ids and log-probs of offsets
        1..depth, as `Backend.draft` does for one."""
        if not asks:
            return []
        base, dev, bs = self.base, self.device, self.block_size
        for _, _, k, _ in asks:
            check_branch_k(base.info.limits, k)
        slots = [a[0] for a in asks]
        backends = [self.slots[s] for s in slots]
        for slot, anchor, _, _ in asks:
            if self.slots[slot].pending_rows > bs:
                self._absorb(slot, anchor)
        n = max(1, max(b.pending_rows for b in backends))
        count = len(asks)
        positions = np.zeros((count, n), np.int64)
        for i, ((slot, anchor, _, _), backend) in enumerate(zip(asks, backends)):
            rows = backend.pending_rows
            if rows:
                dev.copy(self.ctx_taps.rows(rows, i * n), backend.pending.rows(rows))
            positions[i, :rows] = np.arange(backend.pending_from, backend.pending_from + rows)
        depths = [draft_rows(bs, a[3]) for a in asks]
        length = max(block_rows(bs, a[3], self.short_blocks) for a in asks)
        block = self._block(length)
        self._embed([(slot, np.array([anchor], np.int64)) for slot, anchor, _, _ in asks], block, length)
        past = [b.head_kv.length for b in backends]
        dev.upload(self.ctx_positions.rows(count * n), positions.reshape(-1))
        dev.upload(self.ctx_lengths.rows(count), np.array([b.pending_rows for b in backends], np.int64))
        dev.upload(self.starts.rows(count), np.array([b.start for b in backends], np.int64))
        dev.upload(self.slot_ids.rows(count), np.array(slots, np.int64))
        dev.upload(self.lengths.rows(count), np.array(past, np.int64))
        width, hidden = self.ctx_taps.shape[1], block.shape[1]
        inputs = {"context_taps": self.ctx_taps.tensor((count, n, width)),
                  "context_positions": self.ctx_positions.tensor((count, n)),
                  "context_lengths": self.ctx_lengths.rows(count),
                  "block_embeds": block.tensor((count, length, hidden)), "start": self.starts.rows(count),
                  "slots": self.slot_ids.rows(count), "past_lengths": self.lengths.rows(count),
                  "past_rows": self.rows.rows(max(past)), **dict(zip(self.head_pool_in, self.head_pool.tensors()))}
        layer = self.ctx_out.row_bytes
        kv_shape = self.ctx_out.shape[2:]
        outputs = {"hidden": self.draft_hidden.tensor((count, length - 1, hidden)),
                   **{name: self.ctx_out.tensor((count, n, *kv_shape), i * layer)
                      for i, name in enumerate(self.head_out)}}
        base.graphs["draft"].run(inputs, outputs)
        row = self.head_pool.row_bytes
        for i, backend in enumerate(backends):
            rows = backend.pending_rows
            self.head_pool.write(slots[i], backend.head_kv.length, self.ctx_out, i * n * row, layer, rows)
            backend.head_kv.length += rows
            backend.pending_rows, backend.pending_from = 0, backend.start
        ids, logp, _ = self._project(self._pack(self.draft_hidden, length - 1, depths), sum(depths), "draft",
                                     base.draft_projection)
        self._remember(slots, ids, depths, "draft")
        out, at = [], 0
        for i, ((slot, anchor, k, _), depth) in enumerate(zip(asks, depths)):
            self.known[slot][anchor] = (block, i * length)
            out.append((ids[at:at + depth, :k].astype(np.int64), logp[at:at + depth, :k].astype(np.float64)))
            at += depth
        return out

    def verify(self, trees: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
               draws: Sequence[Draw | None] = ()) -> list[Verified]:
        """One target pass over every (slot, tokens, depths, visible): each slot's packed tree, as
        `Backend.verify` takes one, seeing its own slot's committed rows; `draws[i]`: tree i's tokens are sampled
        as alone (None or absent: its argmax)."""
        base, dev = self.base, self.device
        for _, tokens, _, _ in trees:
            check_tree(base.info.limits, len(tokens))
        slots = [tree[0] for tree in trees]
        backends = [self.slots[s] for s in slots]
        sizes = [len(tree[1]) for tree in trees]
        count, t = len(trees), max(sizes)
        for backend, size in zip(backends, sizes):
            backend.kv.check_room(size)
        mask = np.zeros((count, t, t), bool)
        mask[:] = np.eye(t, dtype=bool)  # a padded row sees itself only and is never read
        positions = np.zeros((count, t), np.int64)
        ids = np.zeros((count, t), np.int64)
        self._embed([(slot, np.asarray(tokens, np.int64)) for slot, tokens, _, _ in trees], self.embeds, t)
        for i, (backend, (slot, tokens, depths, visible)) in enumerate(zip(backends, trees)):
            size = sizes[i]
            mask[i, :size, :size] = visible
            ids[i, :size] = tokens
            positions[i] = backend.start + backend.delta
            positions[i, :size] += np.asarray(depths, np.int64)
        past = [b.kv.length for b in backends]
        vl = base.manifest.is_vl
        pos_shape = (3, count, t) if vl else (count, t)
        dev.upload(self.positions.tensor(pos_shape), np.broadcast_to(positions, pos_shape))
        dev.upload(self.mask.tensor((count, t, t)), mask)
        dev.upload(self.ids.tensor((count, t)), ids)
        dev.upload(self.slot_ids.rows(count), np.array(slots, np.int64))
        dev.upload(self.lengths.rows(count), np.array(past, np.int64))
        hidden_size = self.embeds.shape[1]
        layer = self.present.row_bytes
        kv_shape = self.present.shape[2:]
        inputs = {"inputs_embeds": self.embeds.tensor((count, t, hidden_size)),
                  "position_ids": self.positions.tensor(pos_shape), "tree_mask": self.mask.tensor((count, t, t)),
                  "slots": self.slot_ids.rows(count), "past_lengths": self.lengths.rows(count),
                  "past_rows": self.rows.rows(max(past)), **dict(zip(self.target_pool_in, self.pool.tensors())),
                  "input_ids": self.ids.tensor((count, t)), "image_embeds": base.no_image,
                  "deepstack_embeds": base.no_deep}
        target = base.graphs["target"]
        outputs = {"hidden": self.hidden.tensor((count, t, hidden_size)),
                   "taps": self.taps.tensor((count, t, self.taps.shape[1])),
                   **{name: self.present.tensor((count, t, *kv_shape), i * layer)
                      for i, name in enumerate(self.target_out)}}
        target.run({n: v for n, v in inputs.items() if n in target.input_names}, outputs)
        rows = [(draw, np.asarray(tree[2], np.int64)) for draw, tree in zip(draws, trees)] if any(draws) else None
        ids, logp, chosen = self._project(self._pack(self.hidden, t, sizes), sum(sizes), "verify", "vocab", rows)
        self._remember(slots, ids, sizes, "verify")
        self._width = t
        out, at = [], 0
        for i, size in enumerate(sizes):
            out.append(Verified(chosen[0][at:at + size], float("nan"), chosen[1][at:at + size], chosen[2].get(i)))
            at += size
        return out

    def commit(self, kept: list[tuple[int, np.ndarray]]) -> None:
        """Per (slot, rows) of the last verify, in its order: the K/V of rows `rows` ([0] + accepted path) join the
        slot's committed rows (one gather for every slot, row and layer) and their taps wait for the head."""
        dev, t, pool = self.device, self._width, self.pool
        slot_rows, pass_rows = [], []
        for i, (slot, rows) in enumerate(kept):
            backend = self.slots[slot]
            rows = np.asarray(rows, np.int64)
            source = i * t + rows
            at = backend.kv.length + np.arange(len(rows))
            if len(rows) and at[-1] >= pool.max_context:
                raise GlanceError(f"context full: {backend.kv.length} committed rows + {len(rows)} new exceed "
                                  f"--max-context {pool.max_context}; raise --max-context or lower --max-new-tokens")
            slot_rows.append(slot * pool.max_context + at)
            pass_rows.append(source)
            dev.copy_rows(backend.pending, backend.pending_rows + np.arange(len(rows)), self.taps, source,
                          self.taps.row_bytes)
            backend.kv.length += len(rows)
            backend.pending_rows += len(rows)
            backend.start += len(rows)
        layers = np.arange(2 * self.base.manifest.target.num_layers)[:, None]
        slots_per_layer = pool.slots * pool.max_context
        dst = (layers * slots_per_layer + np.concatenate(slot_rows)[None]).reshape(-1)
        src = (layers * self.present.shape[1] + np.concatenate(pass_rows)[None]).reshape(-1)
        dev.copy_rows(pool.buffer, dst, self.present, src, pool.row_bytes)

def open_batch(session: "Session") -> BatchLoop:
    """The batched loop over a session opened with max_batch > 1 (`registry.Source.max_batch`); with auto, the
    batch's policy starts from the session's single-sequence costs and calibration, and a sequence alone in the
    batch decides on those costs without learning or storing any (`batch_loop`: its rounds are not what they
    stand for)."""
    auto = session.config.auto
    policy = alone = None
    if auto is not None:
        verify_ms = auto.cost.verify_cost(np.arange(1, auto.max_nodes + 2))
        policy = BatchBudget(BatchCost(start_from_profile(verify_ms, auto.cost.draft_ms)), auto.calibration,
                             auto.max_nodes)
        alone = AutoBudget(auto.cost, auto.calibration, auto.max_nodes, auto.block_size, steps=auto.steps)
    return BatchLoop(BatchRounds(session.backend), policy, alone)
