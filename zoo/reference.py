"""A naive float64 forward of a whole DecoderLM: the oracle its uncached forward is held against
(tests/test_reference_oracle.py).

    x = embed[tokens]
    per block:  x = x + mixer.reference(norm(x))          (every mixer's float64 oracle)
                x = x + ffn.reference(norm(x))             (every feed-forward's, in a layer that has one)
    logits = head(norm(x))

Everything in float64 from the model's weights; norms are written here from their definitions and chosen by the
model's config (norm: rmsnorm | layernorm), not by calling the modules.
"""
import torch

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


def linear(module, x: torch.Tensor) -> torch.Tensor:
    y = x @ f64(module.weight).T
    if getattr(module, "bias", None) is not None:
        y = y + f64(module.bias)
    return y


def mixer_reference(mixer, x: torch.Tensor, kv_from=None) -> torch.Tensor:
    """One mixer's float64 output for its (normed) input x [B, T, d_model]: its `reference` method, the mixer
    contract's oracle hook (kv_from only for a layer that shares another's keys)."""
    if not callable(getattr(mixer, "reference", None)):
        raise NotImplementedError(f"layer {getattr(mixer, 'layer_idx', '?')}: mixer {type(mixer).__name__} has no "
                                  f"reference(x) method, the float64 oracle every mixer ships")
    return (mixer.reference(x) if kv_from is None else mixer.reference(x, kv_from=kv_from)).to(F64)


def ffn_reference(ffn, x: torch.Tensor) -> torch.Tensor:
    """One feed-forward's float64 output for its (normed) input x: its `reference` method, the FFN contract's
    oracle hook."""
    if not callable(getattr(ffn, "reference", None)):
        raise NotImplementedError(f"FFN {type(ffn).__name__} has no reference(x) method, the float64 oracle every "
                                  f"FFN ships")
    return ffn.reference(x).to(F64)


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
        x = x + mixer_reference(mixer, h, kv_from=kv_from)
        if block.mlp is not None:
            x = x + ffn_reference(block.mlp, norm(config, block.mlp_norm, x))
    x = norm(config, model.norm, x)
    return linear(model.head, x)
