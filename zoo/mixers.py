"""Sequence-mixer kinds a MixerSpec may name, and how a layer's mixer is constructed."""
import inspect

from torch import nn

from attention import Attention, LinearAttention, MLAttention
from ssm import Mamba, Mamba2
from zoo.config import MixerSpec, ModelConfig

MIXERS: dict[str, type[nn.Module]] = {
    "attention": Attention, "mla": MLAttention, "linear": LinearAttention, "mamba": Mamba, "mamba2": Mamba2,
}

# Model-wide settings a mixer receives when its constructor asks for them by name.
SHARED_SETTINGS = ("rope_base",)


def make_mixer(spec: MixerSpec, config: ModelConfig, layer_idx: int) -> nn.Module:
    if spec.kind not in MIXERS:
        raise ValueError(f"unknown mixer kind {spec.kind!r} in layer {layer_idx}; allowed: {', '.join(MIXERS)}")
    cls = MIXERS[spec.kind]
    accepted = inspect.signature(cls).parameters
    shared = {name: getattr(config, name) for name in SHARED_SETTINGS if name in accepted and name not in spec.params}
    unknown = sorted(set(spec.params) - set(accepted))
    if unknown:
        raise ValueError(f"mixer {spec.kind!r} (layer {layer_idx}) got unknown parameters {unknown}; allowed: {sorted(accepted)}")
    return cls(d_model=config.d_model, layer_idx=layer_idx, **shared, **spec.params)
