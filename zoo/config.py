"""Model configuration: one dataclass, with a mixer spec per layer so hybrids are just lists, and optionally a
feed-forward spec per layer (an MoE FFN in some layers, a dense one in others)."""
from dataclasses import dataclass, field

from zoo import checks

MLP_KINDS = ("swiglu", "gelu", "none")
NORM_KINDS = ("rmsnorm", "layernorm")

# Upper bounds on the sizes a config may ask for, each far above any released model's (in brackets), so a typo or a
# hostile config.json fails by name even where memory would allow it (the bytes it asks for are checked at build).
MAX_VOCAB = 2**24  # 16.8M ids (Gemma 3: 262k)
MAX_D_MODEL = 2**17  # 131,072 (Llama 3.1 405B: 16,384)
MAX_MLP_HIDDEN = 2**20  # 1,048,576 (Llama 3.1 405B: 53,248)
MAX_LAYERS = 4096  # (Llama 3.1 405B: 126; DeepNet, Wang et al. 2022: 1,000)
MAX_SEQ_LEN = 2**24  # 16.8M positions (Llama 4 Scout: 10M)
MAX_HEADS = 2**12  # query or KV heads, or B/C groups, per layer (DeepSeek-V3: 128)
MAX_WIDTH = 2**14  # a head's width, a latent or low rank, a state size (DeepSeek-V3's latent: 512)
MAX_FACTOR = 2**10  # an expansion factor or a conv width (Mamba: expand 2, d_conv 4)
MAX_EXPERTS = 2**12  # routed or shared experts per layer (DeepSeek-V3: 256 routed, top 8, 1 shared)
# A mixer parameter's bound by name; any other integer parameter of a mixer is bounded by MAX_SEQ_LEN.
MIXER_PARAM_BOUNDS = {
    **dict.fromkeys(("n_heads", "n_kv_heads", "n_groups"), MAX_HEADS),
    **dict.fromkeys(("head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "feature_dim", "d_state", "dt_rank", "decay_low_rank", "a_low_rank", "gate_low_rank"), MAX_WIDTH),
    **dict.fromkeys(("expand", "expand_v", "d_conv"), MAX_FACTOR),
    "kv_source": MAX_LAYERS,
}
# An FFN parameter's bound by name; any other integer parameter of an FFN is bounded by MAX_SEQ_LEN.
FFN_PARAM_BOUNDS = {
    **dict.fromkeys(("hidden", "expert_hidden"), MAX_MLP_HIDDEN),
    **dict.fromkeys(("n_experts", "top_k", "n_shared_experts"), MAX_EXPERTS),
}


@dataclass
class MixerSpec:
    """Which sequence mixer a layer uses (`kind`, a key of zoo.mixers.MIXERS) and its constructor arguments."""

    kind: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.kind, str):
            raise ValueError(f"a MixerSpec's kind must be a mixer name (str), got {self.kind!r}")
        if not isinstance(self.params, dict) or not all(isinstance(name, str) for name in self.params):
            raise ValueError(f"a MixerSpec's params must be a dict of parameter names to values, got {self.params!r}")


@dataclass
class FFNSpec:
    """Which feed-forward a layer uses (`kind`, a key of zoo.registry.FFNS, or "none") and its constructor
    arguments; `hidden` not given is the model's mlp_hidden."""

    kind: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.kind, str):
            raise ValueError(f"an FFNSpec's kind must be an FFN name (str), got {self.kind!r}")
        if not isinstance(self.params, dict) or not all(isinstance(name, str) for name in self.params):
            raise ValueError(f"an FFNSpec's params must be a dict of parameter names to values, got {self.params!r}")


@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int
    layers: list[MixerSpec]
    mlp: str = "swiglu"
    mlp_hidden: int | None = None  # default: 8/3 · d_model rounded up to a multiple of 64
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    max_seq_len: int = 2048
    name: str = "custom"
    causal: bool = True  # False: every position sees the whole sequence (a masked diffusion LM)
    mask_token_id: int | None = None  # the id a masked diffusion LM reads as "to be predicted"
    # one FFNSpec per layer; None: every layer the model-wide `mlp` of width mlp_hidden (what configs saved before
    # per-layer FFNs hold, so they load unchanged)
    ffns: list[FFNSpec] | None = None

    def __post_init__(self):
        """Every field's type and range, so a bad value fails here by name rather than inside torch."""
        for name, maximum in (("vocab_size", MAX_VOCAB), ("d_model", MAX_D_MODEL), ("max_seq_len", MAX_SEQ_LEN)):
            setattr(self, name, at_most(name, checks.integer(name, getattr(self, name), minimum=1), maximum))
        check_layers(self.layers)
        check_ffns(self.ffns, len(self.layers))
        checks.choice("mlp", self.mlp, MLP_KINDS)
        checks.choice("norm", self.norm, NORM_KINDS)
        self.mlp_hidden = checks.optional_integer("mlp_hidden", self.mlp_hidden, minimum=1)
        if self.mlp_hidden is not None:
            at_most("mlp_hidden", self.mlp_hidden, MAX_MLP_HIDDEN)
        self.norm_eps = checks.real("norm_eps", self.norm_eps, minimum=0, open_min=True)
        self.rope_base = checks.real("rope_base", self.rope_base, minimum=0, open_min=True)
        checks.boolean("tie_embeddings", self.tie_embeddings)
        checks.boolean("causal", self.causal)
        mask = self.mask_token_id
        if mask is not None and not (checks.is_integer(mask) and 0 <= mask < self.vocab_size):
            raise ValueError(f"mask_token_id must lie in [0, {self.vocab_size}) (an integer id of the vocabulary), "
                             f"got {mask!r}")
        if self.mlp_hidden is None:
            self.mlp_hidden = -(-8 * self.d_model // 3 // 64) * 64

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def ffn(self, layer_idx: int) -> FFNSpec:
        """Layer layer_idx's feed-forward: its own FFNSpec, or the model-wide mlp when no layer has one."""
        return FFNSpec(self.mlp) if self.ffns is None else self.ffns[layer_idx]


def check_layers(layers) -> None:
    if isinstance(layers, (list, tuple)):  # counted before its items are looked at
        at_most("n_layers (the length of layers)", len(layers), MAX_LAYERS)
    if not isinstance(layers, (list, tuple)) or not all(isinstance(spec, MixerSpec) for spec in layers):
        raise ValueError(f"layers must be a list of MixerSpec, one per layer, got {layers!r}")
    if not layers:
        raise ValueError("a model needs at least one layer (layers is empty)")


def check_ffns(ffns, n_layers: int) -> None:
    if ffns is None:
        return
    if not isinstance(ffns, (list, tuple)) or not all(isinstance(spec, FFNSpec) for spec in ffns):
        raise ValueError(f"ffns must be None (every layer the model-wide mlp) or a list of FFNSpec, one per layer, "
                         f"got {checks.short(ffns)}")
    if len(ffns) != n_layers:
        raise ValueError(f"ffns must give one FFNSpec per layer: {n_layers} layers, got {len(ffns)} FFNSpecs")


def at_most(name: str, value: int, maximum: int) -> int:
    """value (an integer already checked) unless it exceeds maximum, a bound far above any real model's."""
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum:,} (a bound far above any real model's), got {value:,}")
    return value
