"""The architecture registry: one entry per name says everything about it — how its layers are laid out, the
settings it reads (with types and ranges: validation, `zoo describe`), its mixer class, its feed-forward kind, causal
or not, its MQAR (recall) defaults, whether `zoo compare` runs it by default, its HF class. Nothing elsewhere lists
architectures. The feed-forward kinds are declared here too (FFNS), one line each."""
from dataclasses import dataclass, fields
from typing import Callable

from torch import nn

from attention import Attention, LinearAttention, MLAttention
from attention.attention import QK_NORMS
from ssm import Mamba, Mamba2
from ssm.gated_deltanet import EIGENVALUES, GatedDeltaNet
from ssm.retnet import MultiScaleRetention
from ssm.rwkv7 import RWKV7
from zoo import checks
from zoo.config import (FFN_PARAM_BOUNDS, MAX_D_MODEL, MAX_HEADS, MAX_LAYERS, MAX_MLP_HIDDEN, MAX_SEQ_LEN, MAX_VOCAB,
                         MIXER_PARAM_BOUNDS, FFNSpec, MixerSpec, ModelConfig, at_most)
from zoo.ffn import GeluMLP, MoE, SwiGLU
from zoo.ffn.moe import ROUTERS
from zoo.presets import Preset, preset_settings

# ModelConfig fields a user may override besides the preset's sizes.
CONFIG_OVERRIDES = ("mlp", "norm", "norm_eps", "rope_base", "tie_embeddings", "max_seq_len", "vocab_size", "d_model", "mlp_hidden")
# Per-layer settings every architecture understands.
ATTENTION_OVERRIDES = ("n_layers", "n_heads", "n_kv_heads", "head_dim")


# Each size's upper bound (zoo/config.py says why each); an integer setting not named is bounded by MAX_SEQ_LEN.
BOUNDS = {"vocab_size": MAX_VOCAB, "d_model": MAX_D_MODEL, "n_layers": MAX_LAYERS, "share": MAX_LAYERS,
          "gqa_kv_heads": MAX_HEADS, "mlp_hidden": MAX_MLP_HIDDEN, **MIXER_PARAM_BOUNDS, **FFN_PARAM_BOUNDS}

PRESET, ENTRY = "preset", "entry"  # markers for defaults that are not values (see Setting)


@dataclass(frozen=True)
class Setting:
    """A setting some architectures read: what it means, its type and range. default None: the mixer's own default;
    PRESET: the preset's window; ENTRY: the entry's own (a hybrid's pattern)."""

    kind: type
    help: str
    minimum: int = 1
    choices: Callable[[], tuple[str, ...]] | None = None  # allowed strings, asked when checked
    default: object = None
    owner: str = "mixer"  # whose constructor default applies when the default is None: a mixer's or an FFN's

    def check(self, name: str, value):
        if value is None and self.default in (None, ENTRY):
            return None
        if self.kind is int:
            return at_most(name, checks.integer(name, value, minimum=self.minimum), BOUNDS.get(name, MAX_SEQ_LEN))
        if self.choices is not None:
            return checks.choice(name, value, self.choices())
        return value

    def describe(self, name: str) -> str:
        if self.kind is int:
            kind = f"integer in [{self.minimum}, {BOUNDS.get(name, MAX_SEQ_LEN):,}]"
        else:
            kind = "one of " + ", ".join(self.choices()) if self.choices else self.kind.__name__
        default = {None: f"the {self.owner}'s", PRESET: "the preset's window",
                   ENTRY: "the entry's"}.get(self.default, repr(self.default))
        return f"{kind}; default {default}: {self.help}"


@dataclass(frozen=True)
class Mixer:
    """The mixer class a kind name (MixerSpec.kind) builds."""

    kind: str
    cls: type[nn.Module]


@dataclass(frozen=True)
class FFN:
    """The feed-forward class a kind name (FFNSpec.kind) builds, and the SETTINGS it reads: each, when set, is passed
    to its constructor under the same name."""

    kind: str
    cls: type[nn.Module]
    settings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Architecture:
    description: str
    layers: Callable[[dict], list[MixerSpec]]  # settings -> one MixerSpec per layer
    settings: tuple[str, ...] = ()  # names in SETTINGS this architecture reads, beyond the common ones
    mixer: Mixer | None = None  # the mixer its layers are made of; None: composed of other entries' layers
    ffn: str | None = None  # the FFN kind (FFNS) in every layer; None: the model-wide `mlp` (swiglu unless set)
    in_patterns: bool = True  # may be a layer of a hybrid pattern (a per-layer mixer, not a cross-layer scheme)
    hybrid: bool = False  # its layers are a pattern of other entries', so it reads their settings too
    causal: bool = True  # False: a masked diffusion LM (bidirectional, one extra vocabulary id for its mask token)
    bidirectional: bool = False  # its layers can attend both ways: a backbone a masked diffusion LM may use
    compare_default: bool = True  # `zoo compare` runs it when no --archs is given
    recall_default: bool = True  # `zoo recall` trains it when no --archs is given (its CPU default has a 15-min budget)
    recall: Callable[[int, int, int], dict] = lambda d_model, n_heads, seq_len: {}  # MQAR settings at this size
    # MQAR depths: the recipe's 2 layers, and more where the mechanism cannot express recall at 2 (recall_note says why)
    recall_layers: tuple[int, ...] = (2,)
    recall_note: str = ""
    recall_lr: float = 2e-3  # the MQAR learning rate `zoo recall` uses unless --lrs is given (BENCHMARKS.md: the search)
    hf_class: str | None = None  # the transformers class zoo.from_hf converts to it


def attention_params(settings: dict, kv_heads: int, *retention: str) -> dict:
    """An attention layer's parameters, with the named retention settings (window, sinks, chunk, dilation) as given."""
    params = {"n_heads": settings["n_heads"], "n_kv_heads": kv_heads, **{name: settings[name] for name in retention}}
    if settings.get("head_dim") is not None:
        params["head_dim"] = settings["head_dim"]
    if settings.get("qk_norm") is not None:  # its eps the model's norm_eps, as the block norms'
        params.update(qk_norm=settings["qk_norm"], norm_eps=settings.get("norm_eps", 1e-5))
    return params


def gqa_kv_heads(settings: dict) -> int:
    return settings["n_kv_heads"] if settings.get("n_kv_heads") is not None else settings["gqa_kv_heads"]


def attention_layers(kv_heads: Callable[[dict], int], *retention: str) -> Callable[[dict], list[MixerSpec]]:
    """Every layer softmax attention with these KV heads, keeping what the named retention settings say."""

    def layers(settings: dict) -> list[MixerSpec]:
        return [MixerSpec("attention", attention_params(settings, kv_heads(settings), *retention))
                for _ in range(settings["n_layers"])]

    return layers


def fixed_kv_heads(name: str, value: Callable[[dict], int]) -> Callable[[dict], int]:
    """KV heads fixed by the architecture; an explicit n_kv_heads that disagrees is an error, not ignored."""

    def kv_heads(settings: dict) -> int:
        wanted = value(settings)
        if settings.get("n_kv_heads") not in (None, wanted):
            raise ValueError(f"{name} uses n_kv_heads={wanted} (n_heads={settings['n_heads']}); got "
                             f"n_kv_heads={settings['n_kv_heads']}; use 'gqa' to choose")
        return wanted

    return kv_heads


def latent_attention_layers(settings: dict) -> list[MixerSpec]:
    """MLA sized from the preset unless set: latent d_model/4, rope key half a head, nope and value a whole head."""
    head_dim = settings.get("head_dim") or settings["d_model"] // settings["n_heads"]
    params = {
        "n_heads": settings["n_heads"],
        "kv_lora_rank": settings.get("kv_lora_rank") or settings["d_model"] // 4,
        "q_lora_rank": settings.get("q_lora_rank"),
        "qk_nope_head_dim": settings.get("qk_nope_head_dim") or head_dim,
        "qk_rope_head_dim": settings.get("qk_rope_head_dim") or head_dim // 2,
        "v_head_dim": settings.get("v_head_dim") or head_dim,
    }
    return [MixerSpec("mla", dict(params)) for _ in range(settings["n_layers"])]


def cross_layer_layers(settings: dict) -> list[MixerSpec]:
    """Groups of `share` consecutive layers: the first computes and caches K/V, the rest read it (Brandon et al.)."""
    share, n_layers = settings["share"], settings["n_layers"]
    if n_layers % share:  # share itself is an integer >= 1 by its declaration
        divisors = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
        raise ValueError(f"share factor {share!r} must divide n_layers={n_layers}; allowed: {divisors}")
    params = attention_params(settings, gqa_kv_heads(settings))
    return [MixerSpec("attention", dict(params) if i % share == 0 else {**params, "kv_source": i - i % share})
            for i in range(n_layers)]


def mixer_layers(kind: str, names: tuple[str, ...], n_heads: bool = False) -> Callable[[dict], list[MixerSpec]]:
    """Every layer one mixer kind, given the settings among `names` a user set (the mixer's defaults fill the rest)."""

    def layers(settings: dict) -> list[MixerSpec]:
        params = {name: settings[name] for name in names if settings.get(name) is not None}
        if n_heads:
            params["n_heads"] = settings["n_heads"]
        return [MixerSpec(kind, dict(params)) for _ in range(settings["n_layers"])]

    return layers


@dataclass(frozen=True)
class Pattern:
    """A hybrid's layers: registry names per layer (default: `default`, else the `layers` setting), repeated to fill
    n_layers so the model ends on the pattern's last layer."""

    default: str

    def __call__(self, settings: dict) -> list[MixerSpec]:
        return [ARCHITECTURES[name].layers({**settings, "n_layers": 1})[0]
                for name, _ in pattern_entries(self.default, settings)]

    def ffn_kinds(self, settings: dict) -> list[str | None]:
        """Each layer's FFN kind: the one after its slash, else its entry's (None: the model-wide mlp)."""
        return [ffn or ARCHITECTURES[name].ffn for name, ffn in pattern_entries(self.default, settings)]


def pattern_entries(default: str, settings: dict) -> list[tuple[str, str | None]]:
    """Each layer's (registry name, FFN kind or None) of a hybrid pattern ('gqa/moe,swa': an entry's layer, and
    after a slash the FFN it takes instead of its own), repeated to n_layers."""
    pattern = default if settings.get("layers") is None else settings["layers"]
    entries = [tuple(name.split("/", 1)) if "/" in name else (name, None) for name in pattern_names(pattern)]
    allowed = [n for n, a in ARCHITECTURES.items() if a.in_patterns]
    bad = [name for name, _ in entries if name not in allowed]
    if bad:
        raise ValueError(f"hybrid pattern {pattern!r} names unknown layer kind(s) {bad}; allowed: {', '.join(allowed)}")
    kinds = [*FFNS, "none"]
    bad = [ffn for _, ffn in entries if ffn is not None and ffn not in kinds]
    if bad:
        raise ValueError(f"hybrid pattern {pattern!r} names unknown FFN kind(s) {bad} after a slash; allowed: "
                         f"{', '.join(kinds)}")
    n = settings["n_layers"]
    return [entries[(i - n) % len(entries)] for i in range(n)]


def ffn_spec(kind: str, settings: dict) -> FFNSpec:
    """An FFN of this kind with the settings it reads that are set."""
    names = FFNS[kind].settings if kind in FFNS else ()
    return FFNSpec(kind, {name: settings[name] for name in names if settings.get(name) is not None})


def layer_ffns(arch: Architecture, settings: dict) -> list[FFNSpec] | None:
    """Each layer's FFN, or None when every layer takes the model-wide mlp (the config then reads as before
    per-layer FFNs: config.json unchanged)."""
    if isinstance(arch.layers, Pattern):
        kinds = arch.layers.ffn_kinds(settings)
    else:
        kinds = [arch.ffn] * settings["n_layers"]
    if all(kind is None for kind in kinds):
        return None
    mlp = settings.get("mlp", "swiglu")
    return [ffn_spec(kind or mlp, settings) for kind in kinds]


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


def diffusion_layers(settings: dict) -> list[MixerSpec]:
    """The layers of the `mixer` architecture (default gqa); the model is made non-causal by make_config."""
    return ARCHITECTURES[settings["mixer"]].layers(settings)


def bidirectional_names() -> tuple[str, ...]:
    return tuple(name for name, arch in ARCHITECTURES.items() if arch.bidirectional)


# ---- MQAR (recall) defaults: what an architecture needs to be meaningful at (d_model, n_heads, seq_len) ----------

def half_kv_heads(d_model: int, n_heads: int, seq_len: int) -> dict:
    return {"n_kv_heads": max(1, n_heads // 2)}  # the tiny preset's ratio (4 query heads : 2 KV heads)


def windowed(d_model: int, n_heads: int, seq_len: int) -> dict:
    return {**half_kv_heads(d_model, n_heads, seq_len), "window": max(1, seq_len // 4)}  # smaller than L: it matters


def one_head_latent(d_model: int, n_heads: int, seq_len: int) -> dict:
    # a latent narrower than a head (the default d_model / 4) plateaued at 0.91 (16 wide) and 0.98 (32) at one head
    return {"kv_lora_rank": max(d_model // 4, d_model // n_heads)}


def mamba2_recall(d_model: int, n_heads: int, seq_len: int) -> dict:
    d_inner = 2 * d_model  # expand 2 (the default); the mixer's default head_dim 64 must divide it
    return {} if d_inner % 64 == 0 else {"head_dim": max(h for h in range(1, 65) if d_inner % h == 0)}


# ---- the settings architectures read, and the architectures -------------------------------------------------------

MLA_SETTINGS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SSM_SETTINGS = ("d_state", "d_conv", "expand")

SETTINGS: dict[str, Setting] = {
    "window": Setting(int, "keys each query sees, itself included", default=PRESET),
    "sinks": Setting(int, "first positions every query keeps seeing (StreamingLLM's attention sinks)", default=4),
    "chunk": Setting(int, "tokens per local-attention chunk; a query sees only its own chunk", default=PRESET),
    "dilation": Setting(int, "a dilated window's stride: a query sees itself and every dilation-th key before it, "
                        "window keys over (window - 1) * dilation + 1 positions, all of which the cache holds",
                        default=2),
    "share": Setting(int, "consecutive layers that share one KV cache (must divide n_layers)", default=2),
    "layers": Setting(str, "hybrid pattern: comma-separated layer names, repeated to n_layers", default=ENTRY),
    "mixer": Setting(str, "the bidirectional architecture the diffusion LM is made of", choices=bidirectional_names,
                     default="gqa"),
    "qk_norm": Setting(str, "attention q/k RMSNorm before RoPE: head (Qwen3) or all (OLMoE)", choices=lambda: QK_NORMS),
    "kv_lora_rank": Setting(int, "MLA latent width (default d_model / 4)"),
    "q_lora_rank": Setting(int, "MLA query low-rank width (default: none)"),
    "qk_nope_head_dim": Setting(int, "MLA per-head key/query width without RoPE (default head_dim)"),
    "qk_rope_head_dim": Setting(int, "MLA shared RoPE key width (default head_dim / 2)"),
    "v_head_dim": Setting(int, "MLA value width per head (default head_dim)"),
    "feature_map": Setting(str, "linear attention feature map", choices=lambda: ("elu", "taylor")),
    "feature_dim": Setting(int, "linear attention q/k width before the feature map"),
    "d_state": Setting(int, "SSM state size per channel"),
    "d_conv": Setting(int, "causal convolution width"),
    "expand": Setting(int, "inner width / d_model"),
    "n_groups": Setting(int, "Mamba-2 B/C groups"),
    "expand_v": Setting(int, "value width / key width per head (Gated DeltaNet, RetNet)"),
    "eigenvalues": Setting(str, "Gated DeltaNet state-transition eigenvalues: positive (beta = sigmoid(b)) or signed "
                           "(beta = 2 sigmoid(b), Grazzi et al. 2024)", choices=lambda: EIGENVALUES),
    "decay_low_rank": Setting(int, "RWKV-7 width of the decay's low-rank projection (default fla's: "
                              "max(32, 2.5 sqrt(d_model) head_dim/64 rounded to 32))"),
    "a_low_rank": Setting(int, "RWKV-7 width of the in-context learning rate's low-rank projection (default as "
                          "decay_low_rank)"),
    "gate_low_rank": Setting(int, "RWKV-7 width of the output gate's low-rank projection (default fla's: "
                             "max(32, 5 sqrt(d_model) rounded to 32))"),
    "n_experts": Setting(int, "MoE routed experts per layer", owner="FFN"),
    "top_k": Setting(int, "MoE experts each token is routed to (at most n_experts)", owner="FFN"),
    "expert_hidden": Setting(int, "MoE hidden width of each expert (default mlp_hidden, as Mixtral's)", owner="FFN"),
    "n_shared_experts": Setting(int, "MoE experts every token runs besides its routed ones (Qwen2-MoE, DeepSeek-V3)",
                                minimum=0, owner="FFN"),
    "router": Setting(str, "MoE scores: softmax (Mixtral, Qwen2-MoE; a shared expert gated by a sigmoid) or sigmoid "
                      "with a bias-corrected top-k (DeepSeek-V3; shared experts ungated)", choices=lambda: ROUTERS,
                      owner="FFN"),
    "norm_topk_prob": Setting(bool, "MoE: renormalise a token's top_k weights to sum 1 (Mixtral, DeepSeek-V3; "
                              "Qwen2-MoE's flag)", owner="FFN"),
}
MOE_SETTINGS = ("n_experts", "top_k", "expert_hidden", "n_shared_experts", "router", "norm_topk_prob")
QK = ("qk_norm",)  # what the GQA-family attention entries read besides their retention
RWKV7_SETTINGS = ("decay_low_rank", "a_low_rank", "gate_low_rank")

# The feed-forward kinds (FFNSpec.kind; "none" is a layer without one), one declaration each.
FFNS: dict[str, FFN] = {ffn.kind: ffn for ffn in (
    FFN("swiglu", SwiGLU),
    FFN("gelu", GeluMLP),
    FFN("moe", MoE, MOE_SETTINGS),
)}

ATTENTION = Mixer("attention", Attention)
GATED_DELTA = Mixer("gdn", GatedDeltaNet)
gated_delta_layers = mixer_layers("gdn", ("head_dim", "expand_v", "d_conv", "eigenvalues"), n_heads=True)

ARCHITECTURES: dict[str, Architecture] = {
    "mha": Architecture(
        "multi-head attention: one KV head per query head (the full KV cache)",
        attention_layers(fixed_kv_heads("mha", lambda settings: settings["n_heads"])), QK, mixer=ATTENTION,
        bidirectional=True, hf_class="LlamaForCausalLM",
    ),
    "gqa": Architecture(
        "grouped-query attention: query heads share fewer KV heads (cache shrinks by n_heads/n_kv_heads)",
        attention_layers(gqa_kv_heads), QK, mixer=ATTENTION, bidirectional=True, recall=half_kv_heads,
        hf_class="LlamaForCausalLM",
    ),
    "mqa": Architecture(
        "multi-query attention: all query heads share one KV head (smallest attention KV cache)",
        attention_layers(fixed_kv_heads("mqa", lambda settings: 1)), QK, mixer=ATTENTION, bidirectional=True,
        hf_class="LlamaForCausalLM",
    ),
    "mla": Architecture(
        "multi-head latent attention (DeepSeek-V2/V3): caches one latent + shared rope key per token; decode by weight absorption",
        latent_attention_layers, MLA_SETTINGS, mixer=Mixer("mla", MLAttention), bidirectional=True,
        recall=one_head_latent, recall_lr=1e-3, hf_class="DeepseekV3ForCausalLM",
    ),
    "cla": Architecture(
        "cross-layer attention: each group of `share` layers (default 2) caches one set of GQA keys/values",
        cross_layer_layers, ("share", *QK), mixer=ATTENTION, in_patterns=False, recall=half_kv_heads,
        recall_layers=(2, 4),
        recall_note="at 2 layers with share 2 the second layer reads keys and values computed from the token "
                    "embeddings, so no layer can match a query against keys that carry their preceding token (the "
                    "induction circuit MQAR needs); at 4 layers the second group's keys come from layer 2's input",
    ),
    "swa": Architecture(
        "sliding-window GQA: each query sees the newest `window` keys; the cache stops growing at the window",
        attention_layers(gqa_kv_heads, "window"), ("window", *QK), mixer=ATTENTION, recall=windowed,
        hf_class="MistralForCausalLM",
    ),
    "sink": Architecture(
        "attention sinks (StreamingLLM, Xiao et al. 2023): GQA where each query sees the first `sinks` tokens and the "
        "newest `window`; the cache stops growing at sinks + window",
        attention_layers(gqa_kv_heads, "window", "sinks"), ("window", "sinks", *QK), mixer=ATTENTION,
        compare_default=False, recall_default=False, recall=windowed,
    ),
    "chunked": Architecture(
        "chunked local attention (Llama 4): GQA where each query sees only the keys of its own `chunk`-token chunk; the "
        "cache never holds more than one chunk",
        attention_layers(gqa_kv_heads, "chunk"), ("chunk", *QK), mixer=ATTENTION, compare_default=False,
        recall_default=False,
        recall=lambda d_model, n_heads, seq_len: {**half_kv_heads(d_model, n_heads, seq_len), "chunk": max(1, seq_len // 4)},
    ),
    "linear": Architecture(
        "linear attention (Katharopoulos et al.): feature map elu+1 (or Based's taylor), a constant n_heads*(dk*dv + dk) state",
        mixer_layers("linear", ("head_dim", "feature_map", "feature_dim"), n_heads=True), ("feature_map", "feature_dim"),
        mixer=Mixer("linear", LinearAttention),
    ),
    "mamba": Architecture(
        "Mamba (selective state space): depthwise conv + selective scan, a constant conv + SSM state per layer",
        mixer_layers("mamba", SSM_SETTINGS), SSM_SETTINGS, mixer=Mixer("mamba", Mamba), recall_lr=3e-3,
        hf_class="MambaForCausalLM",
    ),
    "mamba2": Architecture(
        "Mamba-2 (SSD): multi-head scalar-decay state space model, chunked scan; a constant state per layer",
        mixer_layers("mamba2", (*SSM_SETTINGS, "head_dim", "n_groups")), (*SSM_SETTINGS, "n_groups"),
        mixer=Mixer("mamba2", Mamba2), recall=mamba2_recall, recall_lr=3e-3, hf_class="Mamba2ForCausalLM",
    ),
    "gdn": Architecture(
        "Gated DeltaNet (Yang et al. 2024): delta-rule linear attention with a Mamba-2 decay gate; a constant conv + "
        "n_heads*dk*dv state per layer",
        gated_delta_layers, ("expand_v", "d_conv", "eigenvalues"), mixer=GATED_DELTA, compare_default=False,
        recall_default=False,
    ),
    "hybrid": Architecture(
        "any per-layer mix of registered mixers, layers='swa,swa,swa,gqa' (default 'swa,gqa'), repeated to n_layers; "
        "'gqa/moe' gives a layer another FFN kind after a slash",
        Pattern("swa,gqa"), ("layers",), in_patterns=False, hybrid=True, compare_default=False, recall=windowed,
    ),
    "hybrid-1in6": Architecture(
        "character.ai style: five sliding-window layers per global GQA layer",
        Pattern("swa,swa,swa,swa,swa,gqa"), ("layers",), in_patterns=False, hybrid=True, recall=windowed,
    ),
    "hybrid-3to1": Architecture(
        "sliding-window heavy: three sliding-window layers per global GQA layer",
        Pattern("swa,swa,swa,gqa"), ("layers",), in_patterns=False, hybrid=True, compare_default=False, recall=windowed,
    ),
    "hybrid-chunked": Architecture(
        "Llama 4 style: three chunked local-attention layers per global GQA layer",
        Pattern("chunked,chunked,chunked,gqa"), ("layers",), in_patterns=False, hybrid=True,
        compare_default=False, recall_default=False, recall=lambda d_model, n_heads, seq_len: {**windowed(d_model, n_heads, seq_len),
                                                                         "chunk": max(1, seq_len // 4)},
    ),
    "diffusion": Architecture(
        "masked diffusion LM (LLaDA): a bidirectional decoder (mixer=gqa|mha|mqa|mla) that predicts masked tokens; "
        "vocab_size+1 ids, the last one the mask token",
        diffusion_layers, ("mixer", *MLA_SETTINGS), in_patterns=False, causal=False, compare_default=False,
        recall=half_kv_heads,
    ),
    # last, so the tests that seed each architecture by its place in the registry keep the others' seeds
    "gdn-neg": Architecture(
        "Gated DeltaNet with negative eigenvalues (Grazzi et al. 2024): beta = 2 sigmoid(b) in (0, 2), so the state "
        "transition's eigenvalues span (-1, 1) and the recurrence can track parity; gdn's layers and state",
        lambda settings: gated_delta_layers({**settings, "eigenvalues": "signed"}), ("expand_v", "d_conv"),
        mixer=GATED_DELTA, compare_default=False, recall_default=False,
    ),
    # after gdn-neg for the same reason
    "moe": Architecture(
        "mixture of experts (Mixtral): GQA attention, and in every layer a router sends each token to top_k of "
        "n_experts SwiGLU experts (default 2 of 8); DeepSeek-V3's sigmoid router and shared experts as settings",
        attention_layers(gqa_kv_heads), (*MOE_SETTINGS, *QK), mixer=ATTENTION, ffn="moe", compare_default=False,
        recall_default=False, recall=half_kv_heads,
    ),
    # after moe for the same reason
    "hybrid-moe": Architecture(
        "MoE under other mixers (in the spirit of Jamba, Lieber et al. 2024): MLA with an MoE feed-forward, GQA with a "
        "dense SwiGLU, then Mamba-2 and Gated DeltaNet layers with MoE (a 2-layer preset keeps the last two)",
        Pattern("mla/moe,gqa/swiglu,mamba2/moe,gdn/moe"), ("layers",), in_patterns=False, hybrid=True,
        compare_default=False, recall_default=False,
    ),
    # after hybrid-moe for the same reason
    "dilated": Architecture(
        "dilated sliding-window GQA: each query sees itself and every `dilation`-th earlier key, `window` keys over "
        "(window - 1) * dilation + 1 positions (Longformer's dilated windows, Beltagy et al. 2020); the cache holds "
        "that whole span, the attention reads the window",
        attention_layers(gqa_kv_heads, "window", "dilation"), ("window", "dilation", *QK), mixer=ATTENTION,
        compare_default=False, recall_default=False, recall=windowed,
    ),
    # after hybrid-moe for the same reason
    "retnet": Architecture(
        "RetNet multi-scale retention (Sun et al. 2023): linear attention with RoPE and a fixed decay per head, "
        "gamma_h = 1 - 2^(-5-h); RMSNorm-swish-gated output (fla's layer); a constant n_heads*dk*dv state per layer",
        mixer_layers("retnet", ("head_dim", "expand_v"), n_heads=True), ("expand_v",),
        mixer=Mixer("retnet", MultiScaleRetention), compare_default=False, recall_default=False,
    ),
    # after hybrid-moe for the same reason
    "rwkv7": Architecture(
        "RWKV-7 Goose (Peng et al. 2025): token shift, per-channel decay and a delta-rule-like rank-one state edit "
        "with a vector in-context learning rate (fla's layer, without the cross-layer value residual); a constant "
        "d_model + n_heads*dk*dv state per layer",
        mixer_layers("rwkv7", ("head_dim", *RWKV7_SETTINGS), n_heads=True), RWKV7_SETTINGS,
        mixer=Mixer("rwkv7", RWKV7), compare_default=False, recall_default=False,
    ),
}


def mixers() -> dict[str, type[nn.Module]]:
    """Mixer kind (MixerSpec.kind) -> its class, from the entries."""
    found: dict[str, type[nn.Module]] = {}
    for arch in ARCHITECTURES.values():
        if arch.mixer is not None and found.setdefault(arch.mixer.kind, arch.mixer.cls) is not arch.mixer.cls:
            raise ValueError(f"mixer kind {arch.mixer.kind!r} is registered with two classes")
    return found


def ffns() -> dict[str, type[nn.Module]]:
    """FFN kind (FFNSpec.kind) -> its class, from the declarations."""
    return {kind: ffn.cls for kind, ffn in FFNS.items()}


def settings_of(arch: Architecture) -> tuple[str, ...]:
    """The settings an architecture reads: its own, and for a hybrid those of every layer and FFN kind it may hold."""
    if arch.hybrid:
        layer_settings = (name for a in ARCHITECTURES.values() if a.in_patterns for name in a.settings)
        ffn_settings = (name for ffn in FFNS.values() for name in ffn.settings)
        return tuple(dict.fromkeys([*layer_settings, *ffn_settings])) + arch.settings
    return arch.settings


def architectures() -> list[str]:
    return list(ARCHITECTURES)


def compare_defaults() -> list[str]:
    return [name for name, arch in ARCHITECTURES.items() if arch.compare_default]


def recall_defaults() -> list[str]:
    return [name for name, arch in ARCHITECTURES.items() if arch.recall_default]


def is_causal(name: str) -> bool:
    """Whether the architecture decodes left to right (the engine's models); False for a masked diffusion LM."""
    return ARCHITECTURES[check_architecture(name)].causal


def recall_layers(name: str) -> tuple[int, ...]:
    """The depths `zoo recall` trains an architecture at (its entry's recall_layers)."""
    return ARCHITECTURES[check_architecture(name)].recall_layers


def recall_note(name: str) -> str:
    """Why an architecture is also trained deeper than the recipe's 2 layers ("" when it is not)."""
    return ARCHITECTURES[check_architecture(name)].recall_note


def recall_lr(name: str) -> float:
    """The learning rate `zoo recall` trains an architecture at when no --lrs is given (its entry's recall_lr)."""
    return ARCHITECTURES[check_architecture(name)].recall_lr


def recall_settings(name: str, d_model: int, n_heads: int, seq_len: int) -> dict:
    """The settings an architecture needs to be meaningful on MQAR at this size (its entry's recall defaults)."""
    return ARCHITECTURES[check_architecture(name)].recall(d_model, n_heads, seq_len)


def describe(name: str) -> str:
    return ARCHITECTURES[check_architecture(name)].description


def check_architecture(name: str) -> str:
    return checks.choice("architecture", name, ARCHITECTURES)


def check_settings(settings: dict, reads: tuple[str, ...]) -> None:
    """Sizes as integers >= 1 (numpy ints become ints), then each architecture setting by its declaration."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "gqa_kv_heads", "max_seq_len"):
        settings[name] = at_most(name, checks.integer(name, settings[name], minimum=1), BOUNDS.get(name, MAX_SEQ_LEN))
    for name in ("n_kv_heads", "head_dim", "mlp_hidden"):
        if settings.get(name) is not None:
            settings[name] = at_most(name, checks.integer(name, settings[name], minimum=1), BOUNDS[name])
    for name in reads:
        if name in settings:
            settings[name] = SETTINGS[name].check(name, settings[name])


def make_config(name: str, preset: str = "small", **overrides) -> ModelConfig:
    arch = ARCHITECTURES[check_architecture(name)]
    reads = settings_of(arch)
    sizes = preset_settings(preset)
    settings = {**sizes, **{n: SETTINGS[n].default for n in reads if SETTINGS[n].default not in (None, PRESET, ENTRY)}}
    settings.update({n: sizes["window"] for n in reads if SETTINGS[n].default == PRESET})
    allowed = set(CONFIG_OVERRIDES) | set(ATTENTION_OVERRIDES) | ({f.name for f in fields(Preset)} - {"window"}) | set(reads)
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for {name!r}; allowed: {sorted(allowed)}")
    settings.update(overrides)
    check_settings(settings, reads)
    # a diffusion LM reserves the id after the data's vocabulary for its mask token, so every data id stays valid
    vocab_size = settings["vocab_size"] + (0 if arch.causal else 1)
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=settings["d_model"],
        layers=arch.layers(settings),
        ffns=layer_ffns(arch, settings),
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
