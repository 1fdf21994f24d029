"""HF interop for Mamba2ForCausalLM: its config as a zoo ModelConfig, and the (HF name, zoo name) of every weight.

The zoo model is the same stack: embedding -> [RMSNorm -> Mamba-2 mixer, residual] per layer -> RMSNorm -> head,
with no MLP. The mixer's weight names are HF's (and mamba-ssm's), so they map one to one.
"""
import math

from zoo.config import MixerSpec, ModelConfig
from zoo.hf_mamba import backbone_names

# A Mamba has no positional limit; this is only the bound check_tokens and the engine apply.
MAX_SEQ_LEN = 1 << 20


def mamba2_config(c) -> ModelConfig:
    """HF Mamba2Config -> ModelConfig; raises ValueError for settings the zoo's Mamba2 would compute differently."""
    problems = []
    if c.hidden_act != "silu":
        problems.append(f"hidden_act={c.hidden_act!r} (only 'silu')")
    limit = tuple(float(v) for v in c.time_step_limit)
    if limit != (0.0, math.inf):
        problems.append(f"time_step_limit={limit} (only (0.0, inf): the zoo's Mamba2 does not clamp dt)")
    if c.expand * c.hidden_size != c.num_heads * c.head_dim:
        problems.append(f"num_heads*head_dim={c.num_heads * c.head_dim} != expand*hidden_size={c.expand * c.hidden_size}")
    if int(c.expand) != c.expand:
        problems.append(f"expand={c.expand} (only integers)")
    if problems:
        raise ValueError("Mamba2ForCausalLM settings not supported: " + "; ".join(problems))
    mixer = {
        "d_state": c.state_size,
        "d_conv": c.conv_kernel,
        "expand": int(c.expand),
        "head_dim": c.head_dim,
        "n_groups": c.n_groups,
        "chunk_size": c.chunk_size,
        "conv_bias": bool(c.use_conv_bias),
        "bias": bool(c.use_bias),
        "norm_eps": c.layer_norm_epsilon,
        "dt_min": c.time_step_min,
        "dt_max": c.time_step_max,
        "dt_init_floor": c.time_step_floor,
    }
    return ModelConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=[MixerSpec("mamba2", dict(mixer)) for _ in range(c.num_hidden_layers)],
        mlp="none",
        norm="rmsnorm",
        norm_eps=c.layer_norm_epsilon,
        tie_embeddings=bool(c.tie_word_embeddings),
        max_seq_len=MAX_SEQ_LEN,
        name="mamba2",
    )


def mamba2_names(config: ModelConfig):
    """(HF name, zoo name) for every weight of a Mamba2ForCausalLM-shaped zoo model."""
    yield from backbone_names(config, "mamba2", mamba2_weight_names)


def mamba2_weight_names(spec: MixerSpec) -> list[str]:
    bias = spec.params.get("bias", False)
    names = ["in_proj.weight", *(["in_proj.bias"] if bias else []), "conv1d.weight"]
    if spec.params.get("conv_bias", True):
        names.append("conv1d.bias")
    names += ["dt_bias", "A_log", "D", "norm.weight", "out_proj.weight", *(["out_proj.bias"] if bias else [])]
    return names
