"""Model configuration: one dataclass, with a mixer spec per layer so hybrids are just lists."""
from dataclasses import dataclass, field

from zoo import checks

MLP_KINDS = ("swiglu", "gelu", "none")
NORM_KINDS = ("rmsnorm", "layernorm")


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

    def __post_init__(self):
        """Every field's type and range, so a bad value fails here by name rather than inside torch."""
        for name in ("vocab_size", "d_model", "max_seq_len"):
            setattr(self, name, checks.integer(name, getattr(self, name), minimum=1))
        check_layers(self.layers)
        checks.choice("mlp", self.mlp, MLP_KINDS)
        checks.choice("norm", self.norm, NORM_KINDS)
        self.mlp_hidden = checks.optional_integer("mlp_hidden", self.mlp_hidden, minimum=1)
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


def check_layers(layers) -> None:
    if not isinstance(layers, (list, tuple)) or not all(isinstance(spec, MixerSpec) for spec in layers):
        raise ValueError(f"layers must be a list of MixerSpec, one per layer, got {layers!r}")
    if not layers:
        raise ValueError("a model needs at least one layer (layers is empty)")
