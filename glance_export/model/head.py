"""The GLANCE draft head: a DFlash-style block-diffusion drafter over the target's own hidden states.

Context rows (committed tokens) enter as the concatenated taps of a few target layers, are fused by
`fc` + `hidden_norm`, and are projected to keys/values by every head layer; block rows (anchor and
masks) give the queries. Attention is non-causal. The checkpoint layout is the one DFlash/GLANCE heads
are published in (a Qwen3-style config.json with `block_size`, `num_target_layers` and
`dflash_config.{target_layer_ids, mask_token_id}`, plus `fc`, `hidden_norm`, `norm` and per-layer weights
in safetensors), so heads trained elsewhere load unchanged.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from glance_export.model.head_checks import check_config, check_draft_ids, check_sizes
from glance_export.model.head_files import check_tensors, read_head_config, read_safetensors
from glance_export.model.meta_init import parameters_on_meta
from glance_runtime.store.atomic import atomic_directory, check_output
from glance_runtime.errors import GlanceError

WEIGHTS_FILE = "model.safetensors"
RESTORE = "restore the head's files or retrain it"


def tap_layers(num_target_layers: int, num_head_layers: int) -> list[int]:
    """Which target layers the head reads: the middle one for one layer, else spread over the depth."""
    if num_head_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 4) / (num_head_layers - 1)
    return [int(round(1 + i * span)) for i in range(num_head_layers)]


@dataclass
class HeadConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    draft_vocab_size: int | None = None  # logits over this many target tokens (draft_vocab_ids), else all

    def to_json(self) -> dict[str, Any]:
        """Qwen3-style config plus the DFlash fields, as published heads have it."""
        raw = asdict(self)
        dflash = {"target_layer_ids": raw.pop("target_layer_ids"), "mask_token_id": raw.pop("mask_token_id")}
        if raw["draft_vocab_size"] is None:
            raw.pop("draft_vocab_size")
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
                "tie_word_embeddings": False, **raw, "rope_parameters": {"rope_type": "default",
                                                                          "rope_theta": raw["rope_theta"]},
                "dflash_config": dflash}

    @classmethod
    def from_json(cls, cfg: dict[str, Any], where: str = "head config.json") -> "HeadConfig":
        """The config as published heads have it, checked (head_checks.py); `where` names it in errors."""
        if not isinstance(cfg, dict):
            raise GlanceError(f"{where} is not a JSON object; restore the head's config.json (or retrain the head)")
        try:
            dflash = cfg["dflash_config"]
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            heads = cfg["num_attention_heads"]
            config = cls(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
                         num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
                         head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                         intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                         block_size=cfg["block_size"], num_target_layers=cfg["num_target_layers"],
                         target_layer_ids=list(dflash["target_layer_ids"]), mask_token_id=dflash["mask_token_id"],
                         rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                         rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
                         max_position_embeddings=cfg.get("max_position_embeddings", 32768),
                         draft_vocab_size=cfg.get("draft_vocab_size"))
        except KeyError as exc:
            raise GlanceError(f"{where} lacks {exc.args[0]!r}; expected a DFlash/GLANCE head config") from None
        except (TypeError, AttributeError, ZeroDivisionError):
            raise GlanceError(f"{where} holds a field of the wrong type (dflash_config and rope_parameters are "
                              "objects, sizes positive integers); restore the head's config.json (or retrain the "
                              "head)") from None
        check_config(config, where)
        return config

    def qwen3(self) -> Qwen3Config:
        return Qwen3Config(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size,
                           max_position_embeddings=self.max_position_embeddings, hidden_act="silu",
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})


class HeadAttention(nn.Module):
    """Block queries against [context ; block] keys, no causal mask."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)

    def key_value(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [batch, kv_heads, rows, head_dim] of context or block rows."""
        k = self.k_norm(self._split(self.k_proj(x), self.kv_heads))
        v = self._split(self.v_proj(x), self.kv_heads)
        cos, sin = rope
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor | None = None,
                block_mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        cos, sin = rope
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k_blk, v_blk = self.key_value(x, rope)
        k = torch.cat([ctx_k, k_blk], dim=2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = torch.cat([ctx_v, v_blk], dim=2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        mask = None
        if ctx_mask is not None:
            block_cols = block_mask if block_mask is not None else ctx_mask.new_zeros(*ctx_mask.shape[:-1], x.shape[1])
            mask = torch.cat([ctx_mask, block_cols.to(ctx_mask.dtype)], dim=-1).to(q.dtype)  # autocast: bf16 q
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class HeadLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.self_attn = HeadAttention(cfg)
        self.mlp = Qwen3MLP(cfg.qwen3())
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, rope, ctx_k, ctx_v, ctx_mask=None, block_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx_k, ctx_v, ctx_mask, block_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftHead(nn.Module):
    """The head without the target's embedding and LM head, which it borrows at run time."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.config = cfg
        n_taps = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(HeadLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg.qwen3())
        if cfg.draft_vocab_size:
            # ascending target ids the head drafts over; saved with the weights
            self.register_buffer("draft_vocab_ids", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits through the target's LM head: over the draft vocabulary (in draft_vocab_ids order) when the head
        has one, else over the target's whole vocabulary."""
        if self.config.draft_vocab_size:
            return F.linear(hidden, lm_head.weight[self.draft_vocab_ids])
        return lm_head(hidden)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of indices into the head's logits."""
        return self.draft_vocab_ids[draft_ids] if self.config.draft_vocab_size else draft_ids

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(x, positions)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V of context rows: taps [batch, rows, n_taps*H], positions [batch, rows].

        Context K/V depend only on their own row, so a cache of them grows by appending."""
        ctx = self.hidden_norm(self.fc(taps))
        rope = self.rope(ctx, positions)
        return [layer.self_attn.key_value(ctx, rope) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_mask: torch.Tensor | None = None,
                block_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states of the block rows [batch, rows, H]. Additive masks (optional): ctx_mask
        [batch, 1, rows, context] hides context; block_mask [batch, 1, rows, rows] (with ctx_mask) splits the rows
        into several blocks that do not see each other, as training packs the anchors of one sequence."""
        rope = self.rope(block_embeds, positions)
        x = block_embeds
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, rope, k, v, ctx_mask, block_mask)
        return self.norm(x)


def init_head(cfg: HeadConfig, seed: int) -> DraftHead:
    """Untrained weights: normal(0, 0.02) matrices and unit norms, from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    head = DraftHead(cfg)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return head.eval()


HEAD_FORMAT = "glance-head"


def check_head_out(out_dir: str | Path, inputs: Iterable[str | Path | None] = ()) -> None:
    """A head directory is replaced whole when saved: refuse, before any work, one that a head writer did
    not make (a model snapshot holds a config and weights too) or that is one of `inputs`."""
    check_output(out_dir, HEAD_FORMAT, inputs)


def save_head(head: DraftHead, out_dir: str | Path, also: Callable[[Path], None] | None = None,
              made_by: str = "glance-export init-head") -> Path:
    """Write config.json + model.safetensors (and whatever `also` writes into the same directory, such
    as a trainer's state) to a temporary sibling, then rename into place."""
    from safetensors.torch import save_file

    with atomic_directory(out_dir, HEAD_FORMAT, made_by) as tmp:
        (tmp / "config.json").write_text(json.dumps(head.config.to_json(), indent=2))
        state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if also is not None:
            also(tmp)
    return Path(out_dir)


def load_head(head_dir: str | Path, dtype: torch.dtype = torch.float32) -> DraftHead:
    """A head directory, its config and weights checked: what is wrong is one line naming the file and the field
    or tensor (a config.json or weights file that is a FIFO or a directory is named as such, never read)."""
    head_dir = Path(head_dir)
    cfg_path, weights = head_dir / "config.json", head_dir / WEIGHTS_FILE
    if not head_dir.is_dir() or not any(os.path.lexists(p) for p in (cfg_path, weights)):
        raise GlanceError(f"{head_dir} is not a head directory (needs config.json and {WEIGHTS_FILE}); "
                          "create one with `glance-export init-head`")
    cfg = HeadConfig.from_json(read_head_config(cfg_path, RESTORE), str(cfg_path))
    state = read_safetensors(weights, RESTORE)
    check_tensors(state, weights, RESTORE, index_keys=("draft_vocab_ids",))
    h, n_taps = cfg.hidden_size, len(cfg.target_layer_ids)
    check_sizes(state, {"fc.weight": (h, n_taps * h), "layers.0.mlp.up_proj.weight": (cfg.intermediate_size, h),
                        "layers.0.self_attn.q_proj.weight": (cfg.num_attention_heads * cfg.head_dim, h),
                        "layers.0.self_attn.k_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, h)},
                cfg.num_hidden_layers, weights, cfg_path, RESTORE)
    check_draft_ids(state.get("draft_vocab_ids"), cfg, weights, cfg_path)
    with parameters_on_meta():  # the checkpoint's tensors become the parameters: no random init, no second copy
        head = DraftHead(cfg)
    missing, unexpected = head.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise GlanceError(f"{weights} does not match its config (missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]})")
    return head.to(dtype).eval()


def with_draft_vocab(head: DraftHead, ids: torch.Tensor) -> DraftHead:
    """The same head drafting over the target tokens `ids` (ascending) only: its layers are shared, not copied."""
    cfg = replace(head.config, draft_vocab_size=len(ids))
    state = {k: v for k, v in head.state_dict().items() if k != "draft_vocab_ids"}
    state["draft_vocab_ids"] = ids.to(torch.long)
    with parameters_on_meta():
        restricted = DraftHead(cfg)
    restricted.load_state_dict(state, strict=True, assign=True)
    return restricted.eval()


def head_config_for(snapshot, num_layers: int, block_size: int, mask_token_id: int) -> HeadConfig:
    """Size a head for a target: same hidden size and attention shape, taps spread over its depth."""
    tc = snapshot.text_config
    heads = tc["num_attention_heads"]
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    n_target = tc["num_hidden_layers"]
    return HeadConfig(hidden_size=tc["hidden_size"], num_hidden_layers=num_layers, num_attention_heads=heads,
                      num_key_value_heads=tc.get("num_key_value_heads") or heads,
                      head_dim=tc.get("head_dim") or tc["hidden_size"] // heads,
                      intermediate_size=tc["intermediate_size"], vocab_size=tc["vocab_size"],
                      block_size=block_size, num_target_layers=n_target,
                      target_layer_ids=tap_layers(n_target, num_layers), mask_token_id=mask_token_id,
                      rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
                      rope_theta=rope.get("rope_theta", tc.get("rope_theta", 1_000_000.0)),
                      max_position_embeddings=tc.get("max_position_embeddings", 32768))


def pick_mask_token(snapshot) -> int:
    """`<|MASK|>` if the tokenizer has it, else the first embedding row the tokenizer never emits."""
    tok = snapshot.tokenizer
    vocab = tok.get_vocab()
    if "<|MASK|>" in vocab:
        return int(vocab["<|MASK|>"])
    first_unused = len(tok)
    if first_unused < snapshot.text_config["vocab_size"]:
        return first_unused
    raise GlanceError(f"{snapshot.path}: the tokenizer has no <|MASK|> token and uses every embedding row; "
                      "pass --mask-token-id")


def check_head_matches(head: DraftHead, snapshot) -> None:
    """A head reads specific layers of a specific hidden size; refuse a head made for another target."""
    tc, cfg = snapshot.text_config, head.config
    if cfg.hidden_size != tc["hidden_size"] or cfg.num_target_layers != tc["num_hidden_layers"]:
        raise GlanceError(f"head was made for a target with hidden size {cfg.hidden_size} and "
                          f"{cfg.num_target_layers} layers, but {snapshot.path} has {tc['hidden_size']} and "
                          f"{tc['num_hidden_layers']}; use a head trained for this target")
    if cfg.vocab_size != tc["vocab_size"]:
        raise GlanceError(f"head was made for a target with vocab_size {cfg.vocab_size}, but {snapshot.path} has "
                          f"{tc['vocab_size']}; use a head trained for this target")
    if max(cfg.target_layer_ids) >= tc["num_hidden_layers"] or cfg.mask_token_id >= tc["vocab_size"]:
        raise GlanceError("head config taps a layer or uses a mask token outside the target; check its config.json")
