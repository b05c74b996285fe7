"""The PyTorch reference backend, and beside it the greedy oracle every other path is checked against.

The backend drives the unmodified transformers target with explicit positions and a 4D additive
tree mask over a DynamicCache; the oracle drives the same model the ordinary way (the model's own
positions, causal mask and cache growth), so the two share no position or mask code. Both need
torch, so they live on the exporter side, which registers `open_reference` for the runtime (the
`glance_runtime.extensions` entry points in pyproject.toml).

The backend takes either kind of head: a GLANCE/DFlash head drafts a whole block per pass (`draft`), an
EAGLE-3 head one tree depth per pass (`draft_root`/`draft_step`, the loop's step drafter), with its own KV
cache over the committed rows kept across rounds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from glance_runtime.decode.backend import BackendInfo, Prefilled, ServeLimits, Verified, block_rows, draft_rows
from glance_runtime.decode.sampling import Draw, LogProbs
from glance_runtime.backends.hardware import host_cpu
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime.decode.loop import DecodeConfig
from glance_runtime.decode.session import Session, Settings
from glance_runtime.prompt.codec import PromptCodec
from glance_runtime.prompt.prefix_reuse import images_after

from .adapters import Prompt, Snapshot
from .eagle3 import Eagle3Head, check_eagle3_matches, head_kind, load_eagle3, log_softmax_top, rows_mask
from .head import DraftHead, check_head_matches, load_head


def vision_inputs(snapshot: Snapshot, prompt: Prompt, ids: torch.Tensor, device: torch.device,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a transformers forward takes beside `ids` for the prompt's images and videos (none: {}): pixels,
    grids, Qwen2.5-VL's seconds per temporal patch, and the token types (1 image, 2 video) of `ids`."""
    def t(array) -> torch.Tensor:
        return torch.tensor(np.asarray(array), device=device)

    extra: dict[str, torch.Tensor] = {}
    if prompt.pixel_values is not None:
        extra.update(pixel_values=t(prompt.pixel_values).to(dtype), image_grid_thw=t(prompt.image_grid_thw))
    if prompt.pixel_values_videos is not None:
        extra.update(pixel_values_videos=t(prompt.pixel_values_videos).to(dtype), video_grid_thw=t(prompt.video_grid_thw))
        if snapshot.family == "qwen2_5_vl":
            extra["second_per_grid_ts"] = t(prompt.second_per_grid_ts)
    if extra:
        types = (ids == snapshot.image_token_id).int()
        if prompt.video_token_id is not None:
            types = types + 2 * (ids == prompt.video_token_id).int()
        extra["mm_token_type_ids"] = types
    return extra


def _chosen(logits: torch.Tensor, depths: np.ndarray, draw: Draw | None) -> tuple[np.ndarray, LogProbs | None]:
    """The token after each row of logits [N, V]: the argmax, or sampled by `draw` (on the host, in numpy, as
    the graph backends sample on a CPU); and every row's report where `draw` asks for one."""
    if draw is None or not draw.samples:
        chosen = logits.argmax(-1).cpu().numpy().astype(np.int64)
    else:
        chosen = draw.choose(logits.float().cpu().numpy(), depths)
    if draw is None or not draw.reports:
        return chosen, None
    return chosen, draw.report(logits.float().cpu().numpy(), chosen)


def _prefilled(logits: torch.Tensor, draw: Draw | None) -> Prefilled:
    """The first token after the prompt's last row of logits [V], its entropy and its report."""
    chosen, report = _chosen(logits[None], np.zeros(1, np.int64), draw)
    return Prefilled(int(chosen[0]), _entropy(logits), report)


def _entropy(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


_PRECISION = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class StepHead:
    """An EAGLE-3 head's state beside the target: the committed stream (tokens, fused-tap inputs, head positions),
    the head's K/V of the committed rows, and the current round's rows.

    Row i takes (embed(x_{i+1}), fc(taps_i)) and predicts x_{i+2}. Row i is cached for later rounds only once
    x_{i+1} is committed, so the last committed row, whose token is the anchor, is run again each round, beside the
    round's node rows: a re-drafted round or a conversation that keeps fewer rows never reuses a row computed with
    a token that is not the stream's."""

    def __init__(self, head: Eagle3Head, embed: torch.nn.Module, place: Callable[[torch.Tensor], torch.Tensor]):
        self.head, self.embed, self.place = head, embed, place  # place: stream positions [r] -> head's [3, r]
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []  # committed x_0..x_{s-1}
        self.inputs: torch.Tensor | None = None  # fc(taps) of each committed row [s, H]
        self.positions: torch.Tensor | None = None  # each committed row's head positions [3, s]
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # head K/V of rows 0..cached-1
        self.cached = 0
        self.round_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # the anchor row, then the round's nodes
        self.round_out: list[torch.Tensor] = []  # pre-norm output [H] per round row (a child's hidden input)
        self.round_seen: list[list[int]] = []  # per round row: the round rows it attends to (itself included)
        self.round_depth: list[int] = []

    def commit(self, tokens: Sequence[int], taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed rows: their tokens, target taps [r, 3W] and head positions [3, r]."""
        inputs = self.head.fuse(taps)
        self.tokens += [int(t) for t in tokens]
        self.inputs = inputs if self.inputs is None else torch.cat([self.inputs, inputs])
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)

    def truncate(self, keep: int) -> None:
        """Keep the first `keep` committed rows; the head's cache keeps rows whose next token is among them."""
        self.tokens, self.inputs, self.positions = self.tokens[:keep], self.inputs[:keep], self.positions[:, :keep]
        self.cached = min(self.cached, keep - 1)
        self.kv = [(k[:, :, :self.cached], v[:, :, :self.cached]) for k, v in self.kv] if self.kv else None
        self.round_kv, self.round_out, self.round_seen, self.round_depth = [], [], [], []

    def _top(self, normed: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids, logp = log_softmax_top(self.head.logits(normed), k)
        return self.head.target_ids(ids).cpu().numpy().astype(np.int64), logp.double().cpu().numpy()

    def root(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Run the committed rows the cache lacks (the last with the anchor as its token); top-k after the anchor."""
        start, end = self.cached, len(self.tokens)
        ids = torch.tensor(self.tokens[start + 1:] + [int(anchor)], device=self.inputs.device)
        normed, prenorm, new = self.head(self.embed(ids)[None], self.inputs[None, start:],
                                         self.positions[:, None, start:], self.kv)
        self.kv = [(k0[:, :, :0], v0[:, :, :0]) for k0, v0 in new] if self.kv is None else self.kv
        self.kv = [(torch.cat([k0, k1[:, :, :-1]], 2), torch.cat([v0, v1[:, :, :-1]], 2))
                   for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.cached = end - 1
        self.round_kv = [(k1[:, :, -1:], v1[:, :, -1:]) for k1, v1 in new]
        self.round_out, self.round_seen, self.round_depth = [prenorm[0, -1]], [[0]], [0]
        return tuple(a[0] for a in self._top(normed[0, -1:], k))

    def step(self, tokens: np.ndarray, parents: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One pass over new nodes; node j of the round is round row j + 1 (row 0: the anchor's)."""
        known = len(self.round_out) - 1
        if not self.round_out:
            raise RuntimeError("draft_step() before draft_root(): a round starts at its root")
        rows = [int(p) + 1 for p in np.asarray(parents).reshape(-1)]
        if len(rows) != len(tokens) or not all(0 <= r <= known for r in rows):
            raise ValueError(f"draft_step parents must name nodes drafted before this step (0..{known - 1}) or -1")
        n, before = len(rows), len(self.round_out)
        device = self.inputs.device
        depths = [self.round_depth[r] + 1 for r in rows]
        visible = torch.zeros(n, self.cached + before + n, dtype=torch.bool, device=device)
        visible[:, :self.cached] = True
        for j, r in enumerate(rows):
            visible[j, [self.cached + c for c in self.round_seen[r]]] = True
            visible[j, self.cached + before + j] = True
        stream = len(self.tokens) - 1 + torch.tensor(depths, device=device)
        past = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.kv, self.round_kv)]
        ids = torch.as_tensor(np.asarray(tokens, np.int64), device=device)
        hidden = torch.stack([self.round_out[r] for r in rows])[None]
        normed, prenorm, new = self.head(self.embed(ids)[None], hidden, self.place(stream)[:, None], past,
                                         rows_mask(visible, hidden.dtype))
        self.round_kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                         for (k0, v0), (k1, v1) in zip(self.round_kv, new)]
        for j, r in enumerate(rows):
            self.round_out.append(prenorm[0, j])
            self.round_seen.append(self.round_seen[r] + [before + j])
            self.round_depth.append(depths[j])
        return self._top(normed[0], k)


class TorchBackend:
    name = "torch"

    def __init__(self, snapshot: Snapshot, head: DraftHead | Eagle3Head | None = None, dtype: str = "float32",
                 model: torch.nn.Module | None = None, device: str = "cpu"):
        self.snapshot = snapshot
        self.device = torch.device(device)
        self.model = (model if model is not None else snapshot.load_model(dtype)).to(self.device)
        self.embed = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()
        self.head = head
        self.steps: StepHead | None = None
        drafter = "block"
        if isinstance(head, Eagle3Head):
            check_eagle3_matches(head, snapshot)
            self.head = head.to(self.device, self.model.dtype)
            self.tap_layers = head.config.taps(snapshot.text_config["num_hidden_layers"])
            self.block_size, drafter = EAGLE3_DEPTH + 1, "steps"
            drafted = head.config.drafted_vocab
            own = self.head.embed_tokens
            self.steps = StepHead(self.head, own if own is not None else self.embed, self._head_positions)
        elif head is not None:
            check_head_matches(head, snapshot)
            self.head = head.to(self.device, self.model.dtype)
            self.tap_layers = head.config.target_layer_ids
            self.block_size, drafted = head.config.block_size, head.config.draft_vocab_size
        else:
            self.block_size, drafted = 1, None
        # any top-k of the head's vocabulary, any tree size: the reference has no export-time bounds
        limits = ServeLimits(self.block_size, drafted or snapshot.text_config["vocab_size"], drafter=drafter)
        self.info = BackendInfo(limits=limits, precision=_PRECISION.get(self.model.dtype, str(self.model.dtype)),
                                hardware=f"torch {self.device}" if self.device.type == "cuda" else host_cpu())
        self._reset()

    def _reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.start = 0  # stream position of the current anchor == committed target KV rows
        self.delta = 0  # M-RoPE offset: text position = stream position + delta
        self.head_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.pending_taps: list[torch.Tensor] = []  # committed rows not yet projected into head_kv
        self.pending_from = 0  # stream position of the first pending row
        self.verify_taps: torch.Tensor | None = None
        self.verify_tokens: np.ndarray | None = None
        if self.steps is not None:
            self.steps.reset()

    def _taps(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor | None:
        if self.head is None:
            return None
        return torch.cat([hidden_states[i + 1] for i in self.tap_layers], dim=-1)

    def _head_positions(self, stream: torch.Tensor, prompt: torch.Tensor | None = None) -> torch.Tensor:
        """An EAGLE-3 head's positions [3, r] for stream positions [r]: a head rotating with M-RoPE takes the
        target's three axes (`prompt`: the prompt rows' own, from the rope index; later rows stream + delta), any
        other head the plain stream position."""
        if self.head.config.mrope_section is None:
            return stream[None].expand(3, -1)
        if prompt is not None:
            return prompt.reshape(-1, prompt.shape[-1]).expand(3, -1)
        return (stream + self.delta)[None].expand(3, -1)

    def _keep_rows(self, tokens: Sequence[int], taps: torch.Tensor, first: int,
                   prompt_positions: torch.Tensor | None = None) -> None:
        """Hand newly committed rows (stream positions first..) to the head's state."""
        if self.steps is None:
            self.pending_taps.append(taps)
            return
        stream = torch.arange(first, first + len(taps), device=self.device)
        self.steps.commit(tokens, taps, self._head_positions(stream, prompt_positions))

    def _t(self, array) -> torch.Tensor:
        """A numpy array (or list) copied into a tensor on the model's device (tree arrays are read-only)."""
        return torch.tensor(np.asarray(array), device=self.device)

    def _positions(self, stream: torch.Tensor) -> torch.Tensor:
        pos = (stream + self.delta)[None]
        return pos[None].expand(3, 1, -1) if self.snapshot.is_vl else pos

    def prompt_positions(self, prompt: Prompt) -> tuple[torch.Tensor, int]:
        """Prefill positions from the model's own rope-index function, and the M-RoPE delta `generate` continues
        with (one past the prompt's last position, which a video's temporal positions can exceed)."""
        ids = self._t(prompt.input_ids)[None]
        if prompt.image_grid_thw is None and prompt.video_grid_thw is None:
            pos = torch.arange(ids.shape[1], device=self.device)[None]
            return (pos[None].expand(3, 1, -1) if self.snapshot.is_vl else pos), 0
        extra = vision_inputs(self.snapshot, prompt, ids, self.device, self.model.dtype)
        pos, delta = self.model.model.get_rope_index(
            input_ids=ids, mm_token_type_ids=extra["mm_token_type_ids"], image_grid_thw=extra.get("image_grid_thw"),
            video_grid_thw=extra.get("video_grid_thw"), second_per_grid_ts=extra.get("second_per_grid_ts"),
            attention_mask=torch.ones_like(ids))
        return pos, int(pos[0, 0, -1]) + 1 - ids.shape[1]

    @torch.no_grad()
    def prefill(self, prompt: Prompt, keep: int = 0, draw: Draw | None = None) -> Prefilled:
        """`keep`: committed rows (target and head) the prompt starts with, kept instead of recomputed; `draw`:
        the first token sampled, not the argmax."""
        if keep:
            return self._prefill_after(prompt, keep, draw)
        self._reset()
        ids = self._t(prompt.input_ids)[None]
        positions, self.delta = self.prompt_positions(prompt)
        extra = vision_inputs(self.snapshot, prompt, ids, self.device, self.model.dtype)
        out = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True,
                         output_hidden_states=self.head is not None, **extra)
        self.start = ids.shape[1]
        if self.head is not None:
            self._keep_rows(prompt.input_ids.tolist(), self._taps(out.hidden_states)[0], 0, positions)
        return _prefilled(out.logits[0, -1], draw)

    def _truncate(self, keep: int) -> None:
        """Cut the target and head caches back to their first `keep` committed rows."""
        if not 0 < keep <= self.start:
            raise ValueError(f"cannot keep {keep} rows of {self.start} committed")
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        if self.head is None:
            return
        if self.steps is not None:
            self.steps.truncate(keep)
        elif keep <= self.pending_from:
            self.head_kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self.head_kv] if self.head_kv else None
            self.pending_taps, self.pending_from = [], keep
        else:
            self.pending_taps = [torch.cat(self.pending_taps)[:keep - self.pending_from]]

    def _prefill_after(self, prompt: Prompt, keep: int, draw: Draw | None) -> Prefilled:
        """Run only rows keep.. of the prompt, at the full prompt's positions, with the images they hold."""
        self._truncate(keep)
        ids = self._t(prompt.input_ids)[None]
        positions, self.delta = self.prompt_positions(prompt)
        new = ids[:, keep:]
        extra = {}
        merge = self.snapshot.config.get("vision_config", {}).get("spatial_merge_size", 1)
        tail = images_after(prompt, keep, self.snapshot.image_token_id if self.snapshot.is_vl else None, merge)
        if tail is not None:
            extra = vision_inputs(self.snapshot, tail, new, self.device, self.model.dtype)
        out = self.model(input_ids=new, position_ids=positions[..., keep:], cache=self.cache, use_cache=True,
                         output_hidden_states=self.head is not None, **extra)
        self.start = ids.shape[1]
        if self.head is not None:
            self._keep_rows(prompt.input_ids[keep:].tolist(), self._taps(out.hidden_states)[0], keep,
                            positions[..., keep:])
        return _prefilled(out.logits[0, -1], draw)

    @torch.no_grad()
    def draft(self, anchor: int, k: int, depth: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.head is None:
            raise RuntimeError("draft() needs a head; decode with speculative=False instead")
        if self.steps is not None:
            raise RuntimeError("draft() drafts a block, which an EAGLE-3 head does not: it drafts a depth per pass "
                               "through draft_root() and draft_step() (the loop does so for drafter 'steps')")
        if self.pending_taps:
            taps = torch.cat(self.pending_taps)[None]
            pos = torch.arange(self.pending_from, self.pending_from + taps.shape[1], device=self.device)[None]
            new = self.head.context_kv(taps, pos)
            self.head_kv = new if self.head_kv is None else [
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.head_kv, new)]
            self.pending_taps, self.pending_from = [], self.start
        cfg = self.head.config
        length = block_rows(cfg.block_size, depth)
        block = torch.full((1, length), cfg.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor
        pos = torch.arange(self.start, self.start + length, device=self.device)[None]
        hidden = self.head(self.embed(block), pos, self.head_kv)
        rows = draft_rows(cfg.block_size, depth)
        logp = torch.log_softmax(self.head.logits(hidden[0, 1:1 + rows], self.lm_head).float(), dim=-1)
        top = torch.topk(logp, k, dim=-1)
        return self.head.target_ids(top.indices).cpu().numpy().astype(np.int64), top.values.double().cpu().numpy()

    @torch.no_grad()
    def verify(self, tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray, draw: Draw | None = None
               ) -> Verified:
        past, size = self.cache.get_seq_length(), len(tokens)
        mask = torch.zeros(1, 1, size, past + size, dtype=self.model.dtype, device=self.device)
        mask[0, 0, :, past:].masked_fill_(~self._t(visible), torch.finfo(self.model.dtype).min)
        out = self.model(input_ids=self._t(tokens)[None], attention_mask=mask,
                         position_ids=self._positions(self.start + self._t(depths)),
                         cache=self.cache, use_cache=True, output_hidden_states=self.head is not None)
        if self.head is not None:
            self.verify_taps = self._taps(out.hidden_states)[0]
            self.verify_tokens = np.asarray(tokens, np.int64)
        logits = out.logits[0].float()
        chosen, report = _chosen(logits, np.asarray(depths, np.int64), draw)
        confidence = torch.log_softmax(logits, dim=-1)[torch.arange(size), torch.from_numpy(chosen)]
        return Verified(chosen, _entropy(logits[0]), confidence.double().cpu().numpy(), report)

    def commit(self, rows: np.ndarray) -> None:
        """Compact the pack's KV in place: kept rows move down to follow the prefix, the rest is cut."""
        keep = self._t(self.start + rows)
        dst = slice(self.start, self.start + len(rows))
        for layer in self.cache.layers:
            layer.keys[:, :, dst] = layer.keys[:, :, keep]
            layer.values[:, :, dst] = layer.values[:, :, keep]
            layer.keys, layer.values = layer.keys[:, :, :dst.stop], layer.values[:, :, :dst.stop]
        if self.head is not None:
            self._keep_rows(self.verify_tokens[np.asarray(rows)].tolist(), self.verify_taps[self._t(rows)],
                            self.start)
        self.start += len(rows)

    def _steps(self) -> StepHead:
        if self.steps is None:
            raise RuntimeError("draft_root() and draft_step() need an EAGLE-3 head; this backend drafts blocks "
                               "with draft()" if self.head is not None else "draft_root() needs a head")
        return self.steps

    @torch.no_grad()
    def draft_root(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The head's cache brought up to the committed rows, the last round's rows dropped; top-k after the
        anchor (see `decode.backend.StepDrafter`)."""
        return self._steps().root(anchor, k)

    @torch.no_grad()
    def draft_step(self, tokens: np.ndarray, parents: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One head pass over the round's new nodes (see `decode.backend.StepDrafter`)."""
        return self._steps().step(tokens, parents, k)

    def time_graphs(self) -> None:
        """None: one eager model, no separate graphs to time."""
        return None

    def close(self) -> None:
        """Drops the cache; the model's memory goes with the last reference to the backend."""
        self._reset()


def greedy_reference(model: torch.nn.Module, snapshot: Snapshot, prompt: Prompt, max_new_tokens: int,
                     stop_ids: Sequence[int]) -> list[int]:
    """Plain greedy decoding with the model's own cache and positions: the parity oracle."""
    return greedy_with_margins(model, snapshot, prompt, max_new_tokens, stop_ids)[0]


def _top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how far the greedy choice is from a tie."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@torch.no_grad()
def greedy_with_margins(model: torch.nn.Module, snapshot: Snapshot, prompt: Prompt, max_new_tokens: int,
                        stop_ids: Sequence[int]) -> tuple[list[int], list[float]]:
    """The oracle's tokens and, per token, the top-2 logit margin it was chosen with (recorded references
    use it to tell a reduced-precision flip at a near-tie from a real divergence)."""
    from transformers import DynamicCache

    device = model.device
    ids = torch.from_numpy(prompt.input_ids)[None].to(device)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if snapshot.is_vl:
        model.model.rope_deltas = None  # cached per prompt by the model; stale deltas shift positions
    if snapshot.is_vl:
        inputs.update(vision_inputs(snapshot, prompt, ids, device, model.dtype))
    after = None  # the answer's first position where the model's own would differ (see below)
    if prompt.video_grid_thw is not None:
        # generate continues one past the prompt's last position; the model's cached delta continues one past
        # its largest, which a video's temporal positions can exceed: decode as generate does
        pos, _ = model.model.get_rope_index(
            ids, mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs["video_grid_thw"], second_per_grid_ts=inputs.get("second_per_grid_ts"),
            attention_mask=inputs["attention_mask"])
        after = int(pos[0, 0, -1]) + 1
    cache = DynamicCache(config=model.config)
    logits = model(**inputs, cache=cache, use_cache=True).logits[0, -1]
    tokens: list[int] = []
    margins: list[float] = []
    while True:
        tokens.append(int(logits.argmax()))
        margins.append(_top2_margin(logits))
        if tokens[-1] in stop_ids or len(tokens) >= max_new_tokens:
            return tokens, margins
        step = {} if after is None else {"position_ids": torch.full((3, 1, 1), after + len(tokens) - 1, device=device)}
        logits = model(input_ids=torch.tensor([[tokens[-1]]], device=device), cache=cache, use_cache=True,
                       **step).logits[0, -1]


def snapshot_codec(snapshot: Snapshot) -> PromptCodec:
    """The snapshot's own text side: transformers' tokenizer, template and image processor (the reference's)."""
    positions = snapshot.text_config.get("max_position_embeddings")
    return PromptCodec(snapshot.build_messages, snapshot.tokenizer.backend_tokenizer, snapshot.stop_token_ids,
                       snapshot.image_token_id if snapshot.is_vl else None,
                       int(snapshot.config.get("vision_config", {}).get("spatial_merge_size", 1)),
                       positions if isinstance(positions, int) else None)


def load_any_head(head_dir: Path) -> DraftHead | Eagle3Head:
    """A head directory of either kind, told apart by its config.json (`eagle3.head_kind`)."""
    return load_eagle3(head_dir) if head_kind(head_dir) == "eagle3" else load_head(head_dir)


def open_reference(model: Path, head: Path | None, dtype: str = "float32", device: str = "cpu", *,
                   settings: Settings | DecodeConfig = Settings(),
                   progress: Callable[[str], None] = lambda _: None) -> Session:
    """The torch backend on a snapshot (on `device`: "cpu", "cuda"), with its codec and the greedy oracle."""
    snapshot = Snapshot(model)
    backend = TorchBackend(snapshot, load_any_head(head) if head is not None else None, dtype=dtype, device=device)
    stops = snapshot.stop_token_ids
    return Session(backend, snapshot_codec(snapshot), settings, progress,
                   oracle=lambda prompt, n: greedy_reference(backend.model, snapshot, prompt, n, stops),
                   identity=f"torch {Path(model).resolve()} {Path(head).resolve() if head else ''} {dtype}",
                   calibration_dirs=(Path(head),) if head is not None else ())
