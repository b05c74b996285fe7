"""EAGLE-3 draft heads in the layout they are published in, loaded, run and written.

An EAGLE-3 head drafts one token per pass, autoregressively, with a KV cache of its own. Its input at stream
row i is the embedding of token i + 1 beside a hidden state for row i: at committed rows that is `fc` over three
of the target's layer outputs (the "aux" taps), at drafted rows it is the head's own pre-norm output of the row's
parent. The first layer normalises both halves, concatenates them (2 x hidden into q/k/v) and keeps the hidden
half as its residual; further layers are plain Llama layers. The final norm gives the logits over the draft
vocabulary (`lm_head`), whose ids map to the target's through `d2t` (target = draft + d2t[draft]).

The layout (config `architectures: ["LlamaForCausalLMEagle3"]`, keys `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`, optionally `embed_tokens`) follows SGLang's `llama_eagle3.py` and vLLM's `llama_eagle3.py` loaders: the
aux ids name layer outputs (SGLang captures the input of the layer after each), the default taps are the outputs
of layers 1, L/2 - 1 and L - 4, `midlayer.` is layer 0 and vLLM's `layers.{i}` the layers after it,
`norm_before_residual` makes the first layer's residual the normed hidden half, and `mrope_section` in the rope
settings makes the head rotate with the target's three M-RoPE axes (SGLang, for Qwen-VL targets).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from glance_runtime.errors import GlanceError
from glance_runtime.store.atomic import atomic_directory, check_output
from glance_runtime.store.input_files import present

from .head_checks import check_attention, check_numbers, check_rope, check_sizes
from .head_files import check_tensors, read_head_config, read_pickle, read_safetensors
from .meta_init import parameters_on_meta

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"
HEAD_FORMAT = "glance-head"
RESTORE = "restore the head's files (or retrain it with `glance-export train-head --arch eagle3`)"


def default_aux_layers(num_target_layers: int) -> list[int]:
    """Outputs of an early, a middle and a late layer (SGLang's and vLLM's default capture), clamped for
    targets of a few layers."""
    top = num_target_layers - 1
    return [min(max(layer, 0), top) for layer in (1, num_target_layers // 2 - 1, num_target_layers - 4)]


def is_eagle3_config(cfg: Any) -> bool:
    """An EAGLE-3 head's config.json (any other head directory is a GLANCE/DFlash head)."""
    return isinstance(cfg, dict) and any(a in ARCHITECTURES for a in cfg.get("architectures") or ())


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int = 1
    draft_vocab_size: int | None = None  # None: the whole vocabulary (then no d2t/t2d)
    target_hidden_size: int | None = None  # the target's width where it differs from the head's
    aux_layer_ids: list[int] | None = None  # None: the default taps of whatever target it is matched with
    rms_norm_eps: float = 1e-6
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    norm_before_residual: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # published fields kept as they were (token ids, dtype)

    @property
    def drafted_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def tap_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def mrope_section(self) -> list[int] | None:
        section = self.rope.get("mrope_section")
        return list(section) if section else None

    def mrope_axes(self) -> list[int] | None:
        """The M-RoPE axis (0 time, 1 height, 2 width) each rotary column takes its angle from: contiguous
        sections (Qwen2-VL, Qwen2.5-VL) or, with `mrope_interleaved`, every third column (Qwen3-VL); None without
        M-RoPE."""
        section = self.mrope_section
        if section is None:
            return None
        half = self.head_dim // 2
        if self.rope.get("mrope_interleaved"):
            axes = [next((a for a in (1, 2) if j % 3 == a and j < 3 * section[a]), 0) for j in range(half)]
        else:
            axes = [a for a, width in enumerate(section) for _ in range(width)]
        return axes + axes

    def taps(self, num_target_layers: int) -> list[int]:
        return list(self.aux_layer_ids) if self.aux_layer_ids is not None else default_aux_layers(num_target_layers)

    def llama(self) -> LlamaConfig:
        rope = {k: v for k, v in self.rope.items() if k not in ("mrope_section", "mrope_interleaved", "type")}
        if rope.get("rope_type") in (None, "mrope"):
            rope["rope_type"] = "default"
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size,
                           max_position_embeddings=self.max_position_embeddings, hidden_act="silu",
                           rope_parameters=rope)

    def to_json(self) -> dict[str, Any]:
        """The published config: a Llama config with the EAGLE-3 fields."""
        out = {**self.extra, "architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_act": "silu",
               "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
               "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
               "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
               "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope.get("rope_theta", 10000.0),
               "max_position_embeddings": self.max_position_embeddings,
               "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias}
        rope = {k: v for k, v in self.rope.items() if k != "rope_theta"}
        if rope.get("rope_type", "default") != "default" or len(rope) > 1:
            out["rope_scaling"] = rope
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        if self.target_hidden_size is not None:
            out["target_hidden_size"] = self.target_hidden_size
        if self.norm_before_residual:
            out["norm_before_residual"] = True
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {**out.get("eagle_config", {}), "use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": self.aux_layer_ids}
        return out

    @classmethod
    def from_json(cls, cfg: Any, where: str) -> "Eagle3Config":
        """The published config, checked field by field; `where` names the file in errors."""
        if not isinstance(cfg, dict):
            raise GlanceError(f"{where} is not a JSON object; {RESTORE}")

        def size(key: str, default: Any = None, minimum: int = 1) -> Any:
            value = cfg.get(key, default)
            if value is None and default is None and key in ("draft_vocab_size", "target_hidden_size", "head_dim"):
                return None
            if type(value) is not int or value < minimum:
                raise GlanceError(f"{where}: {key} is {value!r}, not an integer >= {minimum}; {RESTORE}")
            return value

        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise GlanceError(f"{where} lacks {key!r}; expected an EAGLE-3 head config ({ARCHITECTURES[0]})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise GlanceError(f"{where}: hidden_act is {cfg['hidden_act']!r}; EAGLE-3 heads here are SiLU Llama layers")
        heads = size("num_attention_heads")
        hidden = size("hidden_size")
        head_dim = size("head_dim") or (hidden // heads if hidden % heads == 0 else 0)
        if not head_dim:
            raise GlanceError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                              f"head_dim is not given; {RESTORE}")
        kv_heads = size("num_key_value_heads", heads)
        check_attention(hidden, heads, kv_heads, where, RESTORE)
        vocab = size("vocab_size")
        drafted = size("draft_vocab_size")
        if drafted is not None and drafted > vocab:
            raise GlanceError(f"{where}: draft_vocab_size {drafted} exceeds vocab_size {vocab}; {RESTORE}")
        if drafted == vocab:
            drafted = None if cfg.get("draft_vocab_size") is None else drafted
        eagle = cfg.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise GlanceError(f"{where}: eagle_config is not an object; {RESTORE}")
        if eagle.get("use_aux_hidden_state") is False:
            raise GlanceError(f"{where}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 head); only EAGLE-3 "
                              "heads, which read three target layers through fc, are supported")
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and (not isinstance(aux, list) or len(aux) != 3
                                or not all(type(a) is int and a >= 0 for a in aux)):
            raise GlanceError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is {aux!r}, not three "
                              f"non-negative layer ids; {RESTORE}")
        rope_key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
        rope = cfg.get(rope_key)
        if rope is not None and not isinstance(rope, dict):
            raise GlanceError(f"{where}: {rope_key} is {rope!r}, not an object (such as {{\"rope_type\": "
                              f"\"linear\", \"factor\": 2.0}}) or null; {RESTORE}")
        rope = dict(rope or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        eps = cfg.get("rms_norm_eps", 1e-6)
        check_numbers(rope["rope_theta"], eps, where, RESTORE)
        check_rope(rope, rope_key, head_dim, where, RESTORE)
        for flag in ("tie_word_embeddings", "attention_bias", "norm_before_residual"):
            if type(cfg.get(flag, False)) is not bool:
                raise GlanceError(f"{where}: {flag} is {cfg[flag]!r}, not true or false; {RESTORE}")
        known = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "vocab_size", "num_hidden_layers", "draft_vocab_size", "target_hidden_size", "rms_norm_eps",
                 "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
                 "attention_bias", "norm_before_residual", "architectures", "model_type", "hidden_act"}
        return cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   intermediate_size=size("intermediate_size"), vocab_size=vocab,
                   num_hidden_layers=size("num_hidden_layers", 1), draft_vocab_size=drafted,
                   target_hidden_size=size("target_hidden_size"), aux_layer_ids=aux, rms_norm_eps=float(eps),
                   rope=rope, max_position_embeddings=size("max_position_embeddings", 32768),
                   tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                   attention_bias=cfg.get("attention_bias", False),
                   norm_before_residual=cfg.get("norm_before_residual", False),
                   extra={k: v for k, v in cfg.items() if k not in known})


class Eagle3Attention(nn.Module):
    """Llama attention (grouped KV, no q/k norm) whose q/k/v read `width` features: 2 x hidden in layer 0."""

    def __init__(self, cfg: Eagle3Config, width: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output rows and the rows' own rotated K/V [batch, kv_heads, rows, head_dim] (for the caller's cache)."""
        cos, sin = rope
        q = self._split(self.q_proj(x), self.heads)
        k = self._split(self.k_proj(x), self.kv_heads)
        v = self._split(self.v_proj(x), self.kv_heads)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        groups = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if mask is None else mask.to(q.dtype))
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)), k, v


class Eagle3Layer(nn.Module):
    """Layer 0 reads [norm(embeds) ; norm(hidden)]; later layers are plain pre-norm Llama layers."""

    def __init__(self, cfg: Eagle3Config, first: bool):
        super().__init__()
        self.first, self.norm_before_residual = first, cfg.norm_before_residual
        eps = cfg.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        if first:
            self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        self.self_attn = Eagle3Attention(cfg, 2 * cfg.hidden_size if first else cfg.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        self.mlp = LlamaMLP(cfg.llama())

    def forward(self, embeds, hidden, residual, rope, past_k, past_v, mask):
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual = hidden + residual
            x = self.input_layernorm(residual)
        attn, k, v = self.self_attn(x, rope, past_k, past_v, mask)
        residual = attn + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual, k, v


class Eagle3Head(nn.Module):
    """The head's weights in the published layout; the caller keeps the KV cache and chooses each row's hidden
    input (fused taps or the parent's pre-norm output)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.tap_width, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(cfg, first=i == 0) for i in range(cfg.num_hidden_layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.drafted_vocab, bias=False)
        self.embed_tokens: nn.Embedding | None = None
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama())
        axes = cfg.mrope_axes()
        if axes is not None:  # a buffer, not a constant made in forward: an export's meta-device trace has no values
            self.register_buffer("mrope_pick", F.one_hot(torch.tensor(axes), 3).T[:, None, None].float(),
                                 persistent=False)
        if cfg.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def own_embeddings(self, weight: torch.Tensor | None = None) -> None:
        """Give the head an input embedding of its own (published heads may carry `embed_tokens`)."""
        cfg = self.config
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if weight is not None:
            self.embed_tokens.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Three concatenated target taps [..., 3 x target width] -> the head's hidden input [..., H]."""
        return self.fc(taps)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [batch, 1, rows, head_dim] for positions [3, batch, rows] (the three M-RoPE axes; a head
        without `mrope_section` rotates by the first axis alone)."""
        section = self.config.mrope_section
        if section is None:
            cos, sin = self.rotary_emb(x, positions[0])
            return cos[:, None], sin[:, None]
        axes, batch, rows = positions.shape
        cos, sin = self.rotary_emb(x, positions.reshape(axes * batch, rows))
        cos, sin = cos.view(axes, batch, rows, -1), sin.view(axes, batch, rows, -1)
        # one-hot [3, head_dim] of each column's axis: a product and a sum, which every exporter takes as it is
        pick = self.mrope_pick.to(cos.dtype)
        return (cos * pick).sum(0)[:, None], (sin * pick).sum(0)[:, None]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Rows [batch, rows, H] of token embeddings and hidden inputs -> (normed rows for the logits, pre-norm rows
        a child row takes as its hidden input, each layer's K/V of these rows). `mask` is additive
        [batch, 1, rows, past + rows] (None: causal over past + rows)."""
        rope = self.rope(embeds, positions)
        if mask is None:
            rows = embeds.shape[1]
            seen = 0 if past is None else past[0][0].shape[2]
            mask = torch.ones(rows, seen + rows, dtype=torch.bool, device=embeds.device).tril(seen)
            mask = torch.zeros(mask.shape, dtype=embeds.dtype, device=embeds.device).masked_fill(
                ~mask, torch.finfo(embeds.dtype).min)[None, None]
        x, residual, new = hidden, None, []
        for i, layer in enumerate(self.layers):
            pk, pv = past[i] if past is not None else (None, None)
            x, residual, k, v = layer(embeds, x, residual, rope, pk, pv, mask)
            new.append((k, v))
        prenorm = x + residual
        return self.norm(prenorm), prenorm, new

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (draft ids; `target_ids` maps them)."""
        return self.lm_head(normed)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.config.draft_vocab_size is not None else draft_ids


def init_eagle3(cfg: Eagle3Config, seed: int, draft_ids: torch.Tensor | None = None,
                own_embeddings: bool = False, std: float = 0.02) -> Eagle3Head:
    """Untrained weights from a fixed seed: normal(0, std) matrices, unit norms; `draft_ids` (ascending target
    ids, draft_vocab_size of them) become d2t/t2d (default: the first draft_vocab_size ids)."""
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    if own_embeddings:
        head.own_embeddings()
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        if cfg.draft_vocab_size is not None:
            set_draft_vocab(head, draft_ids if draft_ids is not None else torch.arange(cfg.draft_vocab_size))
    return head.eval()


def set_draft_vocab(head: Eagle3Head, draft_ids: torch.Tensor) -> None:
    """d2t and t2d of a draft vocabulary given as its ascending target ids."""
    ids = torch.as_tensor(draft_ids, dtype=torch.long)
    head.d2t.copy_(ids - torch.arange(len(ids)))
    head.t2d.zero_()
    head.t2d[ids] = True


def check_eagle3_out(out_dir: str | Path, inputs=()) -> None:
    """A head directory is replaced whole: refuse one a head writer did not make, before any work."""
    check_output(out_dir, HEAD_FORMAT, inputs)


def save_eagle3(head: Eagle3Head, out_dir: str | Path, made_by: str = "glance-export init-head --arch eagle3",
                also=None) -> Path:
    """config.json + model.safetensors in the published layout (layer 0 as `midlayer.`), written whole."""
    from safetensors.torch import save_file

    state = {}
    for key, value in head.state_dict().items():
        if key.startswith("rotary_emb."):
            continue
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        state[key] = value.detach().cpu().contiguous()
    if head.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with atomic_directory(out_dir, HEAD_FORMAT, made_by) as tmp:
        (tmp / "config.json").write_text(json.dumps(head.config.to_json(), indent=2))
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if also is not None:
            also(tmp)
    return Path(out_dir)


def _read_weights(head_dir: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """model.safetensors, else the legacy pytorch_model.bin; either typed first (a directory or FIFO of that
    name is named, not passed over), its entries named tensors and its weights floating-point and finite."""
    weights, legacy = head_dir / WEIGHTS_FILE, head_dir / LEGACY_WEIGHTS_FILE
    if present(weights, "head weights", RESTORE):
        state = read_safetensors(weights, RESTORE)
    elif present(legacy, "head weights", RESTORE):
        state, weights = read_pickle(legacy, RESTORE), legacy
    else:
        raise GlanceError(f"{head_dir} holds no {WEIGHTS_FILE} (or {LEGACY_WEIGHTS_FILE}); {RESTORE}")
    check_tensors(state, weights, RESTORE, index_keys=("d2t", "t2d"))
    return state, weights


def _published_key(key: str) -> str:
    """A checkpoint key in this module's naming: SGLang/vLLM prefixes dropped, `midlayer.` as layer 0."""
    for prefix in ("model.",):
        if key.startswith(prefix) and not key.startswith("model.lm_head"):
            key = key[len(prefix):]
    if key.startswith("midlayer."):
        key = "layers.0." + key[len("midlayer."):]
    return key


def _file_key(key: str) -> str:
    """A key in the published spelling (layer 0 as `midlayer.`), for errors about keys a file lacks."""
    return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key


def load_eagle3(head_dir: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """An EAGLE-3 head directory as published; a malformed one is refused in one line naming the key or field."""
    head_dir = Path(head_dir)
    cfg_path = head_dir / "config.json"
    cfg = Eagle3Config.from_json(read_head_config(cfg_path, RESTORE), str(cfg_path))
    state, weights = _read_weights(head_dir)
    spelled = {_published_key(k): k for k in state}  # errors name a key as the file spells it
    state = {_published_key(k): v for k, v in state.items()}
    _check_sizes(state, cfg, weights, cfg_path, lambda k: spelled.get(k, k))
    with parameters_on_meta():
        head = Eagle3Head(cfg)
        embed = state.get("embed_tokens.weight")
        if embed is not None:
            head.own_embeddings()
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        if embed is None:
            raise GlanceError(f"{weights}: tie_word_embeddings is set but the head has no embed_tokens.weight; "
                              f"{RESTORE}")
        state["lm_head.weight"] = embed if cfg.draft_vocab_size is None else embed[
            torch.arange(cfg.draft_vocab_size) + state.get("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))]
    if cfg.draft_vocab_size is None:
        state.pop("d2t", None)
        state.pop("t2d", None)
    expected = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary_emb.")}
    missing = sorted(_file_key(k) for k in set(expected) - set(state))
    if missing:
        raise GlanceError(f"{weights} lacks {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                          else "") + f" for the config in {cfg_path}; {RESTORE}")
    unexpected = sorted(spelled.get(k, k) for k in set(state) - set(expected))
    if unexpected:
        raise GlanceError(f"{weights} holds {unexpected[0]!r}, which the config in {cfg_path} has no place for "
                          f"(num_hidden_layers {cfg.num_hidden_layers}?); {RESTORE}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise GlanceError(f"{weights}: {spelled.get(key, key)} has shape {tuple(value.shape)}, expected "
                              f"{tuple(expected[key].shape)} from {cfg_path}; {RESTORE}")
    _check_vocab_maps(state, cfg, weights)
    state = {k: (v.to(torch.long) if k == "d2t" else v.to(torch.bool) if k == "t2d" else v) for k, v in state.items()}
    head.load_state_dict(state, strict=False, assign=True)
    return head.to(dtype).eval()


def _check_sizes(state: dict[str, torch.Tensor], cfg: Eagle3Config, weights: Path, cfg_path: Path,
                 spelled: Callable[[str], str]) -> None:
    """The config's sizes against a few tensors' shapes, before the module (whose layers allocate as they are
    built) exists; t2d is needed first, since its buffer is as long as the vocabulary."""
    if cfg.draft_vocab_size is not None and "t2d" not in state:
        raise GlanceError(f"{weights} lacks 't2d' for the config in {cfg_path}; {RESTORE}")
    h, attn = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    expected = {"fc.weight": (h, 3 * cfg.tap_width), "layers.0.self_attn.q_proj.weight": (attn, 2 * h),
                "layers.0.self_attn.k_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, 2 * h),
                "layers.0.mlp.up_proj.weight": (cfg.intermediate_size, h), "lm_head.weight": (cfg.drafted_vocab, h),
                "embed_tokens.weight": (cfg.vocab_size, h)}
    if cfg.draft_vocab_size is not None:  # else the maps are dropped unread
        expected.update({"t2d": (cfg.vocab_size,), "d2t": (cfg.draft_vocab_size,)})
    check_sizes(state, expected, cfg.num_hidden_layers, weights, cfg_path, RESTORE, spelled)


def _check_vocab_maps(state: dict[str, torch.Tensor], cfg: Eagle3Config, weights: Path) -> None:
    """d2t must map the draft ids to distinct ids of the target's vocabulary, and t2d mark exactly those: a wrong
    map drafts tokens the target never meant, or the ONNX gather reads past its table."""
    if cfg.draft_vocab_size is None:
        return
    d2t = state["d2t"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise GlanceError(f"{weights}: d2t holds {d2t.dtype} values, not integer offsets; {RESTORE}")
    targets = torch.arange(cfg.draft_vocab_size) + d2t.to(torch.long)
    if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size:
        raise GlanceError(f"{weights}: d2t maps a draft id outside the target's vocabulary (0..{cfg.vocab_size - 1}); "
                          f"{RESTORE}")
    if len(torch.unique(targets)) != len(targets):
        raise GlanceError(f"{weights}: d2t maps two draft ids to one target id; {RESTORE}")
    t2d = state["t2d"].to(torch.bool)
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[targets].all()):
        raise GlanceError(f"{weights}: t2d does not mark exactly the target ids d2t maps to; {RESTORE}")


def head_kind(head_dir: str | Path) -> str:
    """"eagle3" or "glance" from a head directory's config.json (a missing or unreadable one, a FIFO or a
    directory included, is "glance", whose loader names the problem)."""
    try:
        return "eagle3" if is_eagle3_config(read_head_config(Path(head_dir) / "config.json", RESTORE)) else "glance"
    except GlanceError:
        return "glance"


def eagle3_config_for(snapshot, draft_vocab_size: int | None = None, num_layers: int = 1) -> Eagle3Config:
    """A head sized for a target: its width and attention shape, the default taps written out."""
    tc = snapshot.text_config
    heads = tc["num_attention_heads"]
    rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    rope.setdefault("rope_theta", tc.get("rope_theta", 10000.0))
    rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    return Eagle3Config(hidden_size=tc["hidden_size"], num_attention_heads=heads,
                        num_key_value_heads=tc.get("num_key_value_heads") or heads,
                        head_dim=tc.get("head_dim") or tc["hidden_size"] // heads,
                        intermediate_size=tc["intermediate_size"], vocab_size=tc["vocab_size"],
                        num_hidden_layers=num_layers, draft_vocab_size=draft_vocab_size,
                        aux_layer_ids=default_aux_layers(tc["num_hidden_layers"]),
                        rms_norm_eps=tc.get("rms_norm_eps", 1e-6), rope=rope,
                        max_position_embeddings=tc.get("max_position_embeddings", 32768))


def check_eagle3_matches(head: Eagle3Head, snapshot) -> None:
    """The head's taps and widths must fit the target it drafts for."""
    tc, cfg = snapshot.text_config, head.config
    layers = tc["num_hidden_layers"]
    if cfg.tap_width != tc["hidden_size"]:
        raise GlanceError(f"the EAGLE-3 head reads taps {cfg.tap_width} wide, but {snapshot.path} has hidden size "
                          f"{tc['hidden_size']}; use a head trained for this target")
    if cfg.vocab_size != tc["vocab_size"]:
        raise GlanceError(f"the EAGLE-3 head's vocab_size is {cfg.vocab_size}, but {snapshot.path} has "
                          f"{tc['vocab_size']}; use a head trained for this target")
    if head.embed_tokens is None and cfg.hidden_size != tc["hidden_size"]:
        raise GlanceError(f"the EAGLE-3 head is {cfg.hidden_size} wide without embed_tokens of its own, so it cannot "
                          f"borrow the {tc['hidden_size']}-wide embeddings of {snapshot.path}")
    taps = cfg.taps(layers)
    if max(taps) >= layers:
        raise GlanceError(f"the EAGLE-3 head taps layer {max(taps)}, but {snapshot.path} has {layers} layers "
                          "(eagle_config.eagle_aux_hidden_state_layer_ids); use a head trained for this target")


def rows_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [rows, columns] visibility -> the additive [1, 1, rows, columns] mask attention takes."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[None, None]


def log_softmax_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft ids and their log-probs (fp32), best first."""
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.indices, top.values


__all__ = ["Eagle3Config", "Eagle3Head", "check_eagle3_matches", "check_eagle3_out", "default_aux_layers",
           "eagle3_config_for", "head_kind", "init_eagle3", "is_eagle3_config", "load_eagle3", "log_softmax_top",
           "rows_mask", "save_eagle3", "set_draft_vocab"]
