"""The target model without its weights: built at full depth with every parameter on the `meta` device.

Why this and not a reduced-depth trace with the layer subgraph replicated: the tracer records the
model's own code at its real depth (taps, deepstack rows, per-layer rotary and cache wiring) and nothing
needs to be renamed or stitched by hand. A meta parameter has a shape and a dtype and no storage, so a
full-depth model costs nothing to hold, and the trace (see `weightless.py`) runs no arithmetic at all.

Parameters map back to checkpoint keys through transformers' own key renaming (the layout its
`from_pretrained` would load), so the exporter streams each one from the safetensors when it writes the
graph, and `materialized` swaps real weights into a submodule only while validation needs them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Collection, Iterator

import torch
from torch import nn

from glance_export.model.adapters import Snapshot
from glance_export.model.meta_init import parameters_on_meta
from glance_runtime.errors import GlanceError

from .checkpoint import Checkpoint


def _checkpoint_names(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """Model parameter name -> checkpoint key, by transformers' loading-time renaming of each key."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = dict(model.state_dict())
    names = {}
    for key in checkpoint.entries:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if converted is not None:
            raise GlanceError(f"checkpoint tensor {key} must be converted (fused) on load, which streaming export "
                              "does not do; save the model with transformers first")
        names[name] = key
    return names


@dataclass
class Skeleton:
    """The weightless model and where each meta parameter's real values live."""

    model: nn.Module
    checkpoint: Checkpoint
    keys: dict[int, str] = field(default_factory=dict)  # id(meta parameter) -> checkpoint key

    def key(self, tensor: torch.Tensor) -> str | None:
        return self.keys.get(id(tensor))

    def real(self, tensor: torch.Tensor, buffer: bytearray | None = None) -> torch.Tensor:
        """The values behind a meta parameter (read now, as stored: the writer casts them slice by slice; into
        `buffer` when it is given and large enough), or the tensor itself if it is real."""
        key = self.key(tensor)
        return tensor if key is None else self.checkpoint.read(key, buffer=buffer)

    def real_rows(self, tensor: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a 2-D parameter in its dtype, only those read from the snapshot."""
        key = self.key(tensor)
        return tensor[ids].clone() if key is None else self.checkpoint.rows(key, ids, tensor.dtype)

    @contextlib.contextmanager
    def materialized(self, module: nn.Module, names: Collection[str] | None = None) -> Iterator[nn.Module]:
        """Real weights in `module` for the duration (tied parameters stay one tensor), meta ones after;
        `names`: only the parameters of these dotted names (those its graph reads: a depth cut's module holds
        the embedding too, which its graph never reads)."""
        wanted = None if names is None else {id(p) for n, p in module.named_parameters(remove_duplicate=False)
                                             if n in names}
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        loaded: dict[int, nn.Parameter] = {}
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is None or self.key(param) is None or wanted is not None and id(param) not in wanted:
                    continue
                if id(param) not in loaded:
                    loaded[id(param)] = nn.Parameter(self.checkpoint.read(self.key(param), param.dtype),
                                                     requires_grad=False)
                swapped.append((owner, name, param))
                owner._parameters[name] = loaded[id(param)]
        try:
            yield module
        finally:
            for owner, name, param in swapped:
                owner._parameters[name] = param


def _config(snapshot: Snapshot, layers: int | None):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(snapshot.path, trust_remote_code=False)
    if layers is not None:
        text = config.get_text_config()
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:layers]
    return config


def build_skeleton(snapshot: Snapshot, dtype: str, checkpoint: Checkpoint, layers: int | None = None) -> Skeleton:
    """The target at `dtype` ("float32"/"float16"), its first `layers` decoder layers only when given."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if snapshot.is_vl else AutoModelForCausalLM
    with parameters_on_meta():
        model = auto.from_config(_config(snapshot, layers), dtype=getattr(torch, dtype), trust_remote_code=False)
    names = _checkpoint_names(model, checkpoint)
    skeleton = Skeleton(model.eval(), checkpoint)
    for full, param in model.named_parameters():  # tied parameters are one object, listed once
        if full not in names:
            raise GlanceError(f"{snapshot.path} has no weight for {full}; restore the snapshot's "
                              "*.safetensors files from the model's source")
        entry = checkpoint.entries[names[full]]
        if tuple(entry.shape) != tuple(param.shape):
            raise GlanceError(f"{snapshot.path}: {names[full]} has shape {list(entry.shape)}, config.json "
                              f"implies {list(param.shape)}; the weights do not match the config")
        skeleton.keys[id(param)] = names[full]
    return skeleton
