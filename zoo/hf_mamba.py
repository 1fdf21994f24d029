"""HF MambaForCausalLM <-> zoo: the config and the weight names (registered in zoo.hf's CONVERTERS as "mamba").

HF Mamba is embedding -> (RMSNorm, MambaMixer) residual blocks -> RMSNorm -> head: a DecoderLM with mlp="none".
Its mixer's weight names are mamba-ssm's, which ssm.Mamba keeps. residual_in_fp32 only changes the residual
stream's dtype below fp32, and rescale_prenorm_residual only the init: neither matters for fp32 weights in.
"""
import math

from zoo.config import MixerSpec, ModelConfig

# HF Mamba has no position limit; a zoo config needs one (it bounds token checks, not memory: the state is constant).
MAX_SEQ_LEN = 1 << 16


def mamba_config(c) -> ModelConfig:
    if c.hidden_act != "silu":
        raise ValueError(f"only Mamba with hidden_act='silu' (the conv activation) is supported, got {c.hidden_act!r}")
    if c.intermediate_size != int(c.expand * c.hidden_size):
        raise ValueError(f"Mamba intermediate_size={c.intermediate_size} must be expand * hidden_size = "
                         f"{c.expand} * {c.hidden_size}")
    mamba = {
        "d_state": c.state_size,
        "d_conv": c.conv_kernel,
        "expand": c.expand,
        "conv_bias": bool(c.use_conv_bias),
        "bias": bool(c.use_bias),
        "dt_min": c.time_step_min,
        "dt_max": c.time_step_max,
        "dt_init_floor": c.time_step_floor,
    }
    if int(c.time_step_rank) != math.ceil(c.hidden_size / 16):  # else left to Mamba's default, as zoo.build leaves it
        mamba["dt_rank"] = int(c.time_step_rank)
    return ModelConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=[MixerSpec("mamba", dict(mamba)) for _ in range(c.num_hidden_layers)],
        mlp="none",
        norm="rmsnorm",
        norm_eps=c.layer_norm_epsilon,
        tie_embeddings=bool(c.tie_word_embeddings),
        max_seq_len=MAX_SEQ_LEN,
        name="mamba",
    )


def mamba_names(config: ModelConfig):
    """(HF name, zoo name) for every weight of a zoo model whose layers are all "mamba" and whose blocks have no MLP."""
    if config.mlp != "none":
        raise ValueError(f"HF Mamba blocks have no MLP; this model has mlp={config.mlp!r} (build it with mlp='none')")
    yield from backbone_names(config, "mamba", mamba_weight_names)


def backbone_names(config: ModelConfig, kind: str, weight_names):
    """HF's Mamba/Mamba-2 layout: backbone.{embeddings, layers.i.{norm, mixer.*}, norm_f} and lm_head."""
    yield "backbone.embeddings.weight", "embed.weight"
    yield "backbone.norm_f.weight", "norm.weight"
    if not config.tie_embeddings:
        yield "lm_head.weight", "head.weight"
    for i, spec in enumerate(config.layers):
        if spec.kind != kind:
            raise ValueError(f"layer {i} is a {spec.kind!r} mixer; the HF model has only {kind!r} layers")
        hf, ours = f"backbone.layers.{i}.", f"blocks.{i}."
        yield hf + "norm.weight", ours + "mixer_norm.weight"
        for name in weight_names(spec):
            yield hf + f"mixer.{name}", ours + f"mixer.{name}"


def mamba_weight_names(spec: MixerSpec) -> list[str]:
    names = ["in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
             "out_proj.weight"]
    if spec.params.get("bias", False):
        names += ["in_proj.bias", "out_proj.bias"]
    if spec.params.get("conv_bias", True):
        names.append("conv1d.bias")
    return names
