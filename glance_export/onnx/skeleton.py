"""The target model without its weights: traced at full depth, every parameter a one-element placeholder.

Why this and not a reduced-depth trace with the layer subgraph replicated: the tracer then records the
model's own code at its real depth (taps, deepstack rows, per-layer rotary and cache wiring) and nothing
needs to be renamed or stitched by hand. A placeholder is a single value broadcast to the parameter's
shape, so a full-depth model costs a few kilobytes; tracing still runs every op on real-sized (zero-cost
to store, briefly materialised per op) weights, which is fast at trace-feed sizes. Each placeholder holds
a distinct value, because the TorchScript exporter merges initializers that compare equal.

Placeholders map back to checkpoint keys through transformers' own key renaming (the layout its
`from_pretrained` would load), so the exporter streams each one from the safetensors when it writes the
graph, and `materialized` swaps real weights into a submodule only while validation needs them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from glance_export.adapters import Snapshot
from glance_runtime.errors import GlanceError

from .checkpoint import Checkpoint


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside allocate no parameter storage; buffers (rotary tables) are computed for real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # a meta one is being shared (tied weights): keep it
            param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _placeholder(shape: torch.Size, dtype: torch.dtype, index: int) -> nn.Parameter:
    """A broadcast scalar whose bit pattern is `index + 1`: distinct from every other placeholder, and finite."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]
    value = torch.tensor(index + 1, dtype=bits).view(dtype)
    return nn.Parameter(value.expand(shape), requires_grad=False)


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
    """The placeholder model and where each placeholder's real values live."""

    model: nn.Module
    checkpoint: Checkpoint
    keys: dict[int, str] = field(default_factory=dict)  # id(placeholder) -> checkpoint key

    def key(self, tensor: torch.Tensor) -> str | None:
        return self.keys.get(id(tensor))

    def real(self, tensor: torch.Tensor) -> torch.Tensor:
        """The values behind a placeholder (read now, in its dtype), or the tensor itself if it is real."""
        key = self.key(tensor)
        return tensor if key is None else self.checkpoint.read(key, tensor.dtype)

    @contextlib.contextmanager
    def materialized(self, module: nn.Module) -> Iterator[nn.Module]:
        """Real weights in `module` for the duration (tied parameters stay one tensor), placeholders after."""
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        loaded: dict[int, nn.Parameter] = {}
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is None or self.key(param) is None:
                    continue
                if id(param) not in loaded:
                    loaded[id(param)] = nn.Parameter(self.real(param), requires_grad=False)
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
    placeholders: dict[int, nn.Parameter] = {}
    by_id = {id(p): n for n, p in model.named_parameters()}
    for owner in model.modules():
        for name, param in list(owner._parameters.items()):
            if param is None:
                continue
            if id(param) not in placeholders:
                full = by_id[id(param)]
                if full not in names:
                    raise GlanceError(f"{snapshot.path} has no weight for {full}; restore the snapshot's "
                                      "*.safetensors files from the model's source")
                entry = checkpoint.entries[names[full]]
                if tuple(entry.shape) != tuple(param.shape):
                    raise GlanceError(f"{snapshot.path}: {names[full]} has shape {list(entry.shape)}, config.json "
                                      f"implies {list(param.shape)}; the weights do not match the config")
                placeholders[id(param)] = _placeholder(param.shape, param.dtype, len(placeholders))
                skeleton.keys[id(placeholders[id(param)])] = names[full]
            owner._parameters[name] = placeholders[id(param)]
    return skeleton
