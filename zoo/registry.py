"""The architecture registry: a name -> a function that lays out a model's layers from size settings."""
from dataclasses import dataclass, fields
from typing import Callable

from zoo import checks
from zoo.config import MixerSpec, ModelConfig
from zoo.model import DecoderLM
from zoo.presets import Preset, preset_settings

# ModelConfig fields a user may override besides the preset's sizes.
CONFIG_OVERRIDES = ("mlp", "norm", "norm_eps", "rope_base", "tie_embeddings", "max_seq_len", "vocab_size", "d_model", "mlp_hidden")
# Per-layer settings every architecture understands.
ATTENTION_OVERRIDES = ("n_layers", "n_heads", "n_kv_heads", "head_dim")
MLA_SETTINGS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class Architecture:
    description: str
    layers: Callable[[dict], list[MixerSpec]]  # size settings -> one MixerSpec per layer
    settings: tuple[str, ...] = ()  # settings beyond the common ones that this architecture reads
    in_patterns: bool = True  # may be a layer of a hybrid pattern (a per-layer mixer, not a cross-layer scheme)
    causal: bool = True  # False: a masked diffusion LM (bidirectional, one extra vocabulary id for its mask token)


def attention_params(s: dict, kv_heads: int) -> dict:
    params = {"n_heads": s["n_heads"], "n_kv_heads": kv_heads}
    if s.get("head_dim") is not None:
        params["head_dim"] = s["head_dim"]
    return params


def gqa_kv_heads(s: dict) -> int:
    return s["n_kv_heads"] if s.get("n_kv_heads") is not None else s["gqa_kv_heads"]


def grouped_attention(kv_heads: Callable[[dict], int]) -> Callable[[dict], list[MixerSpec]]:
    def layers(s: dict) -> list[MixerSpec]:
        return [MixerSpec("attention", attention_params(s, kv_heads(s))) for _ in range(s["n_layers"])]

    return layers


def fixed_kv_heads(name: str, value: Callable[[dict], int]) -> Callable[[dict], int]:
    """KV heads fixed by the architecture; an explicit n_kv_heads that disagrees is an error, not ignored."""

    def kv_heads(s: dict) -> int:
        wanted = value(s)
        if s.get("n_kv_heads") not in (None, wanted):
            raise ValueError(f"{name} uses n_kv_heads={wanted} (n_heads={s['n_heads']}); got n_kv_heads={s['n_kv_heads']}; use 'gqa' to choose")
        return wanted

    return kv_heads


def sliding_window_layers(s: dict) -> list[MixerSpec]:
    return [MixerSpec("attention", {**attention_params(s, gqa_kv_heads(s)), "window": s["window"]})
            for _ in range(s["n_layers"])]


def latent_attention_layers(s: dict) -> list[MixerSpec]:
    """MLA sized from the preset unless set: latent d_model/4, rope key half a head, nope and value a whole head."""
    head_dim = s.get("head_dim") or s["d_model"] // s["n_heads"]
    params = {
        "n_heads": s["n_heads"],
        "kv_lora_rank": s.get("kv_lora_rank") or s["d_model"] // 4,
        "q_lora_rank": s.get("q_lora_rank"),
        "qk_nope_head_dim": s.get("qk_nope_head_dim") or head_dim,
        "qk_rope_head_dim": s.get("qk_rope_head_dim") or head_dim // 2,
        "v_head_dim": s.get("v_head_dim") or head_dim,
    }
    return [MixerSpec("mla", dict(params)) for _ in range(s["n_layers"])]


def cross_layer_layers(s: dict) -> list[MixerSpec]:
    """Groups of `share` consecutive layers: the first computes and caches K/V, the rest read it (Brandon et al.)."""
    share, n_layers = s["share"], s["n_layers"]
    if not checks.is_integer(share) or share < 1 or n_layers % share:
        divisors = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
        raise ValueError(f"share factor {share!r} must divide n_layers={n_layers}; allowed: {divisors}")
    params = attention_params(s, gqa_kv_heads(s))
    return [MixerSpec("attention", dict(params) if i % share == 0 else {**params, "kv_source": i - i % share})
            for i in range(n_layers)]


def optional(s: dict, names: tuple[str, ...]) -> dict:
    """The settings among `names` a user gave; the mixer's own defaults fill the rest."""
    return {name: s[name] for name in names if s.get(name) is not None}


def linear_attention_layers(s: dict) -> list[MixerSpec]:
    params = {"n_heads": s["n_heads"], **optional(s, ("head_dim", "feature_map", "feature_dim"))}
    return [MixerSpec("linear", dict(params)) for _ in range(s["n_layers"])]


def mamba_layers(s: dict) -> list[MixerSpec]:
    return [MixerSpec("mamba", optional(s, ("d_state", "d_conv", "expand"))) for _ in range(s["n_layers"])]


def mamba2_layers(s: dict) -> list[MixerSpec]:
    params = optional(s, ("d_state", "d_conv", "expand", "head_dim", "n_groups"))
    return [MixerSpec("mamba2", dict(params)) for _ in range(s["n_layers"])]


def pattern_layers(default: str) -> Callable[[dict], list[MixerSpec]]:
    """A hybrid: registry names per layer, repeated to fill n_layers so the model ends on the pattern's last layer."""

    def layers(s: dict) -> list[MixerSpec]:
        pattern = default if s.get("layers") is None else s["layers"]
        names = pattern_names(pattern)
        allowed = [n for n, a in ARCHITECTURES.items() if a.in_patterns]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise ValueError(f"hybrid pattern {pattern!r} names unknown layer kind(s) {bad}; allowed: {', '.join(allowed)}")
        n = s["n_layers"]
        return [ARCHITECTURES[names[(i - n) % len(names)]].layers({**s, "n_layers": 1})[0] for i in range(n)]

    return layers


def pattern_names(pattern) -> list[str]:
    """'swa,gqa' or ['swa', 'gqa'] -> the layer names; an empty pattern is an error, not the default."""
    if isinstance(pattern, str):
        names = [n.strip() for n in pattern.split(",")]
    elif isinstance(pattern, (list, tuple)):
        names = list(pattern)
    else:
        raise ValueError(f"hybrid pattern (layers) must be comma-separated layer names such as 'swa,gqa' or a list "
                         f"of them, got {pattern!r} ({type(pattern).__name__})")
    if names in ([], [""]):
        raise ValueError(f"empty hybrid pattern (layers={pattern!r}): name at least one layer kind, e.g. 'swa,gqa'")
    return names


# Architectures whose layers can attend both ways: what a masked diffusion LM may be built from.
NON_CAUSAL_BACKBONES = ("mha", "gqa", "mqa", "mla")


def diffusion_layers(s: dict) -> list[MixerSpec]:
    """The layers of the `mixer` architecture (default gqa); the model is made non-causal by make_config."""
    mixer = s["mixer"]
    if mixer not in NON_CAUSAL_BACKBONES:
        raise ValueError(f"diffusion mixer {mixer!r} is not an architecture that can attend both ways; allowed: {', '.join(NON_CAUSAL_BACKBONES)}")
    return ARCHITECTURES[mixer].layers(s)


SSM_SETTINGS = ("d_state", "d_conv", "expand")
HYBRID_SETTINGS = ("layers", "window", *MLA_SETTINGS, "feature_map", "feature_dim", *SSM_SETTINGS, "n_groups")

ARCHITECTURES: dict[str, Architecture] = {
    "mha": Architecture(
        "multi-head attention: one KV head per query head (the full KV cache)",
        grouped_attention(fixed_kv_heads("mha", lambda s: s["n_heads"])),
    ),
    "gqa": Architecture(
        "grouped-query attention: query heads share fewer KV heads (cache shrinks by n_heads/n_kv_heads)",
        grouped_attention(gqa_kv_heads),
    ),
    "mqa": Architecture(
        "multi-query attention: all query heads share one KV head (smallest attention KV cache)",
        grouped_attention(fixed_kv_heads("mqa", lambda s: 1)),
    ),
    "mla": Architecture(
        "multi-head latent attention (DeepSeek-V2/V3): caches one latent + shared rope key per token; decode by weight absorption",
        latent_attention_layers, MLA_SETTINGS,
    ),
    "cla": Architecture(
        "cross-layer attention: each group of `share` layers (default 2) caches one set of GQA keys/values",
        cross_layer_layers, ("share",), in_patterns=False,
    ),
    "swa": Architecture(
        "sliding-window GQA: each query sees the newest `window` keys; the cache stops growing at the window",
        sliding_window_layers, ("window",),
    ),
    "linear": Architecture(
        "linear attention (Katharopoulos et al.): feature map elu+1 (or Based's taylor), a constant n_heads*(dk*dv + dk) state",
        linear_attention_layers, ("feature_map", "feature_dim"),
    ),
    "mamba": Architecture(
        "Mamba (selective state space): depthwise conv + selective scan, a constant conv + SSM state per layer",
        mamba_layers, SSM_SETTINGS,
    ),
    "mamba2": Architecture(
        "Mamba-2 (SSD): multi-head scalar-decay state space model, chunked scan; a constant state per layer",
        mamba2_layers, (*SSM_SETTINGS, "n_groups"),
    ),
    "hybrid": Architecture(
        "any per-layer mix of registered mixers, layers='swa,swa,swa,gqa' (default 'swa,gqa'), repeated to n_layers",
        pattern_layers("swa,gqa"), HYBRID_SETTINGS, in_patterns=False,
    ),
    "hybrid-1in6": Architecture(
        "character.ai style: five sliding-window layers per global GQA layer",
        pattern_layers("swa,swa,swa,swa,swa,gqa"), HYBRID_SETTINGS, in_patterns=False,
    ),
    "hybrid-3to1": Architecture(
        "sliding-window heavy: three sliding-window layers per global GQA layer",
        pattern_layers("swa,swa,swa,gqa"), HYBRID_SETTINGS, in_patterns=False,
    ),
    "diffusion": Architecture(
        "masked diffusion LM (LLaDA): a bidirectional decoder (mixer=gqa|mha|mqa|mla) that predicts masked tokens; "
        "vocab_size+1 ids, the last one the mask token",
        diffusion_layers, ("mixer", *MLA_SETTINGS), in_patterns=False, causal=False,
    ),
}
DEFAULT_SETTINGS = {"share": 2, "mixer": "gqa"}  # settings no preset sizes
# Integer settings, each a size or count >= 1, checked before any layer is laid out; the optional ones may be None
# (the default). share is checked with its divisors by cross_layer_layers.
REQUIRED_INTEGERS = ("vocab_size", "d_model", "n_layers", "n_heads", "gqa_kv_heads", "max_seq_len", "window")
OPTIONAL_INTEGERS = ("n_kv_heads", "head_dim", "mlp_hidden", *MLA_SETTINGS, "feature_dim", *SSM_SETTINGS, "n_groups")


def architectures() -> list[str]:
    return list(ARCHITECTURES)


def is_causal(name: str) -> bool:
    """Whether the architecture decodes left to right (the engine's models); False for a masked diffusion LM."""
    return ARCHITECTURES[check_architecture(name)].causal


def describe(name: str) -> str:
    return ARCHITECTURES[check_architecture(name)].description


def check_architecture(name: str) -> str:
    return checks.choice("architecture", name, ARCHITECTURES)


def check_integer_settings(settings: dict) -> None:
    """Integers as given (numpy ints become ints); a float, bool, string or size below 1 is an error here."""
    for name in REQUIRED_INTEGERS:
        settings[name] = checks.integer(name, settings[name], minimum=1)
    for name in [n for n in OPTIONAL_INTEGERS if n in settings]:
        settings[name] = checks.optional_integer(name, settings[name], minimum=1)


def make_config(name: str, preset: str = "small", **overrides) -> ModelConfig:
    arch = ARCHITECTURES[check_architecture(name)]
    settings = {**DEFAULT_SETTINGS, **preset_settings(preset)}
    sizes = {f.name for f in fields(Preset)} - {"window"}  # a window means something only where an architecture reads it
    allowed = set(CONFIG_OVERRIDES) | set(ATTENTION_OVERRIDES) | sizes | set(arch.settings)
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for {name!r}; allowed: {sorted(allowed)}")
    settings.update(overrides)
    check_integer_settings(settings)
    # a diffusion LM reserves the id after the data's vocabulary for its mask token, so every data id stays valid
    vocab_size = settings["vocab_size"] + (0 if arch.causal else 1)
    return ModelConfig(
        vocab_size=vocab_size,
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
        causal=arch.causal,
        mask_token_id=None if arch.causal else vocab_size - 1,
    )


def build(arch: "str | ModelConfig", preset: str = "small", **overrides) -> DecoderLM:
    """zoo.build("gqa", preset="small", n_kv_heads=2) or zoo.build(ModelConfig(...))."""
    if isinstance(arch, ModelConfig):
        if overrides:
            raise ValueError("overrides apply to a registry name; edit the ModelConfig instead")
        return DecoderLM(arch)
    return DecoderLM(make_config(arch, preset, **overrides))
