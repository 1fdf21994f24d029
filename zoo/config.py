"""Model configuration: one dataclass, with a mixer spec per layer so hybrids are just lists."""
from dataclasses import dataclass, field

MLP_KINDS = ("swiglu", "gelu", "none")
NORM_KINDS = ("rmsnorm", "layernorm")


@dataclass
class MixerSpec:
    """Which sequence mixer a layer uses (`kind`, a key of zoo.mixers.MIXERS) and its constructor arguments."""

    kind: str
    params: dict = field(default_factory=dict)


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
        if self.vocab_size < 1 or self.d_model < 1 or self.max_seq_len < 1:
            raise ValueError(
                f"vocab_size, d_model and max_seq_len must be >= 1, got {self.vocab_size}, {self.d_model}, {self.max_seq_len}"
            )
        if not self.layers:
            raise ValueError("a model needs at least one layer (layers is empty)")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}; allowed: {', '.join(MLP_KINDS)}")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"unknown norm {self.norm!r}; allowed: {', '.join(NORM_KINDS)}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must lie in [0, {self.vocab_size}) (the vocabulary), got {self.mask_token_id}")
        if self.mlp_hidden is None:
            self.mlp_hidden = -(-8 * self.d_model // 3 // 64) * 64

    @property
    def n_layers(self) -> int:
        return len(self.layers)
