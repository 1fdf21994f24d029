"""The architecture registry: a name -> a function that lays out a model's layers from size settings."""
from dataclasses import dataclass, fields
from typing import Callable

from zoo.config import MixerSpec, ModelConfig
from zoo.model import DecoderLM
from zoo.presets import Preset, preset_settings

# ModelConfig fields a user may override besides the preset's sizes.
CONFIG_OVERRIDES = ("mlp", "norm", "norm_eps", "rope_base", "tie_embeddings", "max_seq_len", "vocab_size", "d_model", "mlp_hidden")
# Per-layer settings every attention architecture understands.
ATTENTION_OVERRIDES = ("n_layers", "n_heads", "n_kv_heads", "head_dim")


@dataclass(frozen=True)
class Architecture:
    description: str
    layers: Callable[[dict], list[MixerSpec]]  # size settings -> one MixerSpec per layer


def grouped_attention(kv_heads: Callable[[dict], int]) -> Callable[[dict], list[MixerSpec]]:
    def layers(s: dict) -> list[MixerSpec]:
        params = {"n_heads": s["n_heads"], "n_kv_heads": kv_heads(s)}
        if s.get("head_dim") is not None:
            params["head_dim"] = s["head_dim"]
        return [MixerSpec("attention", dict(params)) for _ in range(s["n_layers"])]

    return layers


def fixed_kv_heads(name: str, value: Callable[[dict], int]) -> Callable[[dict], int]:
    """KV heads fixed by the architecture; an explicit n_kv_heads that disagrees is an error, not ignored."""

    def kv_heads(s: dict) -> int:
        wanted = value(s)
        if s.get("n_kv_heads") not in (None, wanted):
            raise ValueError(f"{name} uses n_kv_heads={wanted} (n_heads={s['n_heads']}); got n_kv_heads={s['n_kv_heads']}; use 'gqa' to choose")
        return wanted

    return kv_heads


ARCHITECTURES: dict[str, Architecture] = {
    "mha": Architecture(
        "multi-head attention: one KV head per query head (the full KV cache)",
        grouped_attention(fixed_kv_heads("mha", lambda s: s["n_heads"])),
    ),
    "gqa": Architecture(
        "grouped-query attention: query heads share fewer KV heads (cache shrinks by n_heads/n_kv_heads)",
        grouped_attention(lambda s: s["n_kv_heads"] if s.get("n_kv_heads") is not None else s["gqa_kv_heads"]),
    ),
    "mqa": Architecture(
        "multi-query attention: all query heads share one KV head (smallest attention KV cache)",
        grouped_attention(fixed_kv_heads("mqa", lambda s: 1)),
    ),
}


def architectures() -> list[str]:
    return list(ARCHITECTURES)


def describe(name: str) -> str:
    return ARCHITECTURES[check_architecture(name)].description


def check_architecture(name: str) -> str:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; allowed: {', '.join(ARCHITECTURES)}")
    return name


def make_config(name: str, preset: str = "small", **overrides) -> ModelConfig:
    arch = ARCHITECTURES[check_architecture(name)]
    settings = preset_settings(preset)
    allowed = set(CONFIG_OVERRIDES) | set(ATTENTION_OVERRIDES) | {f.name for f in fields(Preset)}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for {name!r}; allowed: {sorted(allowed)}")
    settings.update(overrides)
    return ModelConfig(
        vocab_size=settings["vocab_size"],
        d_model=settings["d_model"],
        layers=arch.layers(settings),
        mlp=settings.get("mlp", "swiglu"),
        mlp_hidden=settings["mlp_hidden"],
        norm=settings.get("norm", "rmsnorm"),
        norm_eps=settings.get("norm_eps", 1e-5),
        rope_base=settings.get("rope_base", 10000.0),
        tie_embeddings=settings["tie_embeddings"],
        max_seq_len=settings["max_seq_len"],
        name=name,
    )


def build(arch: "str | ModelConfig", preset: str = "small", **overrides) -> DecoderLM:
    """zoo.build("gqa", preset="small", n_kv_heads=2) or zoo.build(ModelConfig(...))."""
    if isinstance(arch, ModelConfig):
        if overrides:
            raise ValueError("overrides apply to a registry name; edit the ModelConfig instead")
        return DecoderLM(arch)
    return DecoderLM(make_config(arch, preset, **overrides))
