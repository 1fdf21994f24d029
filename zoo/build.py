"""Building a model from a registry name (or a ModelConfig)."""
from zoo.config import ModelConfig
from zoo.model import DecoderLM
from zoo.registry import make_config


def build(arch: "str | ModelConfig", preset: str = "small", **overrides) -> DecoderLM:
    """zoo.build("gqa", preset="small", n_kv_heads=2) or zoo.build(ModelConfig(...))."""
    if isinstance(arch, ModelConfig):
        if overrides:
            raise ValueError("overrides apply to a registry name; edit the ModelConfig instead")
        return DecoderLM(arch)
    return DecoderLM(make_config(arch, preset, **overrides))
