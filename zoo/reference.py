"""A naive float64 forward of a whole DecoderLM: the oracle its uncached forward is held against
(tests/test_reference_oracle.py).

    x = embed[tokens]
    per block:  x = x + mixer_reference(norm(x))          (the mixer's own `reference` method when it has one)
                x = x + mlp(norm(x))                       (when the model has MLPs)
    logits = head(norm(x))

Everything in float64 from the model's weights; norms and MLPs are written here from their definitions and chosen
by the model's config (norm: rmsnorm | layernorm, mlp: swiglu | gelu | none), not by calling the modules.
"""
import torch

from attention.reference import attention_reference, linear_attention_reference, mla_reference
from ssm.reference import mamba2_reference, mamba_reference

F64 = torch.float64


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(F64)


def rms_norm(x: torch.Tensor, module, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * f64(module.weight)


def layer_norm(x: torch.Tensor, module, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * g + b, biased variance (Ba et al. 2016)."""
    centred = x - x.mean(-1, keepdim=True)
    out = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)
    if module.weight is not None:
        out = out * f64(module.weight)
    if module.bias is not None:
        out = out + f64(module.bias)
    return out


def norm(config, module, x: torch.Tensor) -> torch.Tensor:
    fn = rms_norm if config.norm == "rmsnorm" else layer_norm
    return fn(x, module, config.norm_eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU, x * Phi(x) (Hendrycks & Gimpel 2016), not the tanh approximation."""
    return 0.5 * x * (1 + torch.erf(x / 2**0.5))


def linear(module, x: torch.Tensor) -> torch.Tensor:
    y = x @ f64(module.weight).T
    if getattr(module, "bias", None) is not None:
        y = y + f64(module.bias)
    return y


def mlp(config, module, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): down(SiLU(gate x) * up x); GELU MLP: down(GELU(up x))."""
    if config.mlp == "swiglu":
        return linear(module.down_proj, silu(linear(module.gate_proj, x)) * linear(module.up_proj, x))
    if config.mlp == "gelu":
        return linear(module.down_proj, gelu(linear(module.up_proj, x)))
    raise ValueError(f"no reference for mlp kind {config.mlp!r}")


# Mixer class name -> its reference; a mixer with its own `reference` method is asked first.
MIXER_REFERENCES = {
    "Attention": attention_reference,
    "MLAttention": mla_reference,
    "LinearAttention": linear_attention_reference,
    "Mamba": mamba_reference,
    "Mamba2": mamba2_reference,
}


def mixer_reference(mixer, x: torch.Tensor, kv_from=None, rope_base: float | None = None) -> torch.Tensor:
    """One mixer's float64 output for its (normed) input x [B, T, d_model].

    First rule: the mixer's own `reference(x)` (kv_from passed only to a layer that shares another's keys); else the
    reference registered for its class name. rope_base (the model's) goes to the attention references, which
    otherwise read it from the mixer."""
    own = getattr(mixer, "reference", None)
    if callable(own):
        out = own(x, kv_from=kv_from) if kv_from is not None else own(x)
        return out.to(F64)
    name = type(mixer).__name__
    if name not in MIXER_REFERENCES:
        raise NotImplementedError(f"no float64 reference for mixer {name} (layer {getattr(mixer, 'layer_idx', '?')}): "
                                  f"give the class a reference(self, x) method or add it to MIXER_REFERENCES")
    fn = MIXER_REFERENCES[name]
    if fn is attention_reference:
        return fn(mixer, x, kv_from=kv_from, rope_base=rope_base)
    if fn is mla_reference:
        return fn(mixer, x, rope_base=rope_base)
    if kv_from is not None:
        raise ValueError(f"mixer {name} cannot read another layer's keys")
    return fn(mixer, x)


@torch.no_grad()
def reference_forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> float64 logits [B, T, vocab] of the uncached forward at positions 0 .. T-1."""
    config = model.config
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}")
    x = f64(model.embed.weight)[tokens]  # [B, T, d_model]
    mixer_inputs = []  # each layer's normed input: a layer sharing keys reads its source's
    for block in model.blocks:
        mixer = block.mixer
        h = norm(config, block.mixer_norm, x)
        mixer_inputs.append(h)
        source = getattr(mixer, "kv_source", None)
        kv_from = None if source is None else (model.blocks[source].mixer, mixer_inputs[source])
        x = x + mixer_reference(mixer, h, kv_from=kv_from, rope_base=config.rope_base)
        if block.mlp is not None:
            x = x + mlp(config, block.mlp, norm(config, block.mlp_norm, x))
    x = norm(config, model.norm, x)
    return linear(model.head, x)
