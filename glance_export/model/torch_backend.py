"""The PyTorch reference backend, and beside it the greedy oracle every other path is checked against.

The backend drives the unmodified transformers target with explicit positions and a 4D additive
tree mask over a DynamicCache; the oracle drives the same model the ordinary way (the model's own
positions, causal mask and cache growth), so the two share no position or mask code. Both need
torch, so they live on the exporter side, which registers `open_reference` for the runtime (the
`glance_runtime.extensions` entry points in pyproject.toml).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from glance_runtime.decode.backend import BackendInfo, ServeLimits, Verified, draft_rows
from glance_runtime.backends.hardware import host_cpu
from glance_runtime.decode.loop import DecodeConfig
from glance_runtime.decode.session import Session, Settings
from glance_runtime.prompt.codec import PromptCodec
from glance_runtime.prompt.prefix_reuse import images_after

from .adapters import Prompt, Snapshot
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


def _entropy(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


_PRECISION = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class TorchBackend:
    name = "torch"

    def __init__(self, snapshot: Snapshot, head: DraftHead | None = None, dtype: str = "float32",
                 model: torch.nn.Module | None = None, device: str = "cpu"):
        self.snapshot = snapshot
        self.device = torch.device(device)
        self.model = (model if model is not None else snapshot.load_model(dtype)).to(self.device)
        self.head = head
        if head is not None:
            check_head_matches(head, snapshot)
            self.head = head.to(self.device, self.model.dtype)
        self.block_size = head.config.block_size if head is not None else 1
        # any top-k of the head's vocabulary, any tree size: the reference has no export-time bounds
        drafted = head.config.draft_vocab_size if head is not None else None
        limits = ServeLimits(self.block_size, drafted or snapshot.text_config["vocab_size"])
        self.info = BackendInfo(limits=limits, precision=_PRECISION.get(self.model.dtype, str(self.model.dtype)),
                                hardware=f"torch {self.device}" if self.device.type == "cuda" else host_cpu())
        self.embed = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()
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

    def _taps(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor | None:
        if self.head is None:
            return None
        return torch.cat([hidden_states[i + 1] for i in self.head.config.target_layer_ids], dim=-1)

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
    def prefill(self, prompt: Prompt, keep: int = 0) -> tuple[int, float]:
        """`keep`: committed rows (target and head) the prompt starts with, kept instead of recomputed."""
        if keep:
            return self._prefill_after(prompt, keep)
        self._reset()
        ids = self._t(prompt.input_ids)[None]
        positions, self.delta = self.prompt_positions(prompt)
        extra = vision_inputs(self.snapshot, prompt, ids, self.device, self.model.dtype)
        out = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True,
                         output_hidden_states=self.head is not None, **extra)
        self.start = ids.shape[1]
        if self.head is not None:
            self.pending_taps = [self._taps(out.hidden_states)[0]]
        logits = out.logits[0, -1]
        return int(logits.argmax()), _entropy(logits)

    def _truncate(self, keep: int) -> None:
        """Cut the target and head caches back to their first `keep` committed rows."""
        if not 0 < keep <= self.start:
            raise ValueError(f"cannot keep {keep} rows of {self.start} committed")
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        if self.head is None:
            return
        if keep <= self.pending_from:
            self.head_kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self.head_kv] if self.head_kv else None
            self.pending_taps, self.pending_from = [], keep
        else:
            self.pending_taps = [torch.cat(self.pending_taps)[:keep - self.pending_from]]

    def _prefill_after(self, prompt: Prompt, keep: int) -> tuple[int, float]:
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
            self.pending_taps.append(self._taps(out.hidden_states)[0])
        logits = out.logits[0, -1]
        return int(logits.argmax()), _entropy(logits)

    @torch.no_grad()
    def draft(self, anchor: int, k: int, depth: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.head is None:
            raise RuntimeError("draft() needs a head; decode with speculative=False instead")
        if self.pending_taps:
            taps = torch.cat(self.pending_taps)[None]
            pos = torch.arange(self.pending_from, self.pending_from + taps.shape[1], device=self.device)[None]
            new = self.head.context_kv(taps, pos)
            self.head_kv = new if self.head_kv is None else [
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.head_kv, new)]
            self.pending_taps, self.pending_from = [], self.start
        cfg = self.head.config
        block = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor
        pos = torch.arange(self.start, self.start + cfg.block_size, device=self.device)[None]
        hidden = self.head(self.embed(block), pos, self.head_kv)
        rows = draft_rows(cfg.block_size, depth)
        logp = torch.log_softmax(self.head.logits(hidden[0, 1:1 + rows], self.lm_head).float(), dim=-1)
        top = torch.topk(logp, k, dim=-1)
        return self.head.target_ids(top.indices).cpu().numpy().astype(np.int64), top.values.double().cpu().numpy()

    @torch.no_grad()
    def verify(self, tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray) -> Verified:
        past, size = self.cache.get_seq_length(), len(tokens)
        mask = torch.zeros(1, 1, size, past + size, dtype=self.model.dtype, device=self.device)
        mask[0, 0, :, past:].masked_fill_(~self._t(visible), torch.finfo(self.model.dtype).min)
        out = self.model(input_ids=self._t(tokens)[None], attention_mask=mask,
                         position_ids=self._positions(self.start + self._t(depths)),
                         cache=self.cache, use_cache=True, output_hidden_states=self.head is not None)
        if self.head is not None:
            self.verify_taps = self._taps(out.hidden_states)[0]
        logits = out.logits[0].float()
        confidence = torch.log_softmax(logits, dim=-1).max(-1).values
        return Verified(logits.argmax(-1).cpu().numpy().astype(np.int64), _entropy(logits[0]),
                        confidence.double().cpu().numpy())

    def commit(self, rows: np.ndarray) -> None:
        """Compact the pack's KV in place: kept rows move down to follow the prefix, the rest is cut."""
        keep = self._t(self.start + rows)
        dst = slice(self.start, self.start + len(rows))
        for layer in self.cache.layers:
            layer.keys[:, :, dst] = layer.keys[:, :, keep]
            layer.values[:, :, dst] = layer.values[:, :, keep]
            layer.keys, layer.values = layer.keys[:, :, :dst.stop], layer.values[:, :, :dst.stop]
        if self.head is not None:
            self.pending_taps.append(self.verify_taps[self._t(rows)])
        self.start += len(rows)

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


def open_reference(model: Path, head: Path | None, dtype: str = "float32", device: str = "cpu", *,
                   settings: Settings | DecodeConfig = Settings(),
                   progress: Callable[[str], None] = lambda _: None) -> Session:
    """The torch backend on a snapshot (on `device`: "cpu", "cuda"), with its codec and the greedy oracle."""
    snapshot = Snapshot(model)
    backend = TorchBackend(snapshot, load_head(head) if head is not None else None, dtype=dtype, device=device)
    stops = snapshot.stop_token_ids
    return Session(backend, snapshot_codec(snapshot), settings, progress,
                   oracle=lambda prompt, n: greedy_reference(backend.model, snapshot, prompt, n, stops),
                   identity=f"torch {Path(model).resolve()} {Path(head).resolve() if head else ''} {dtype}",
                   calibration_dirs=(Path(head),) if head is not None else ())
