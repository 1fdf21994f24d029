"""Whole halves of a decoder block as one call each in an eager CPU decode step: the feed-forward half
(x + SwiGLU(RMSNorm(x))), an attention or MLA layer's half (x + o(attention) after RMSNorm, its keys and values or
latent row written into a contiguous cache on the way), and a linear attention, Mamba-2 or Mamba layer's (its
recurrent states updated in place in the engine's state slots).

Each op here is C++ (kernels/cpu/ops.cpp) over the C kernels. The attention and feed-forward halves compute each
output as the kernels and torch ops of the modules' path do, with the same roundings, so their results are
bit-identical to that path (they keep their threads in one or two parallel regions: kernels/cpu/attention_half.c,
kernels/cpu/ffn_half.c). MLA's half (kernels/cpu/mla_half.c, one region) folds its query through W_UK and its
output through W_UV in C, summing in another order than the module's einsums; the Mamba and Mamba-2 halves
(kernels/cpu/mamba_half.c, mamba2_half.c, one region each) keep the modules' roundings but take their exps from
glibc and vector_exp.h rather than SLEEF, Mamba's dt_proj sums in its own order and Mamba-2's gated RMSNorm's mean
in order: these three match their modules' path to rounding. The recurrent halves update their states in the
slots' rows rather than in copies written back. The linear attention half's state step is one pass in C
(kernels/cpu/linear_attention_step.c), where the module's path copied the state five times, and sums in another
order. The Python functions below compose the same steps, serving where the C++ glue does not build.

What the module path cost, `small` (8 layers, d_model 512) on a 2-core EPYC, fp32, batch 1: per layer ~20 module
calls and dispatch checks, two cache index_puts and the views between them, ~0.15-0.2 ms a step in all (2-3%). The
halves that write a cache are ops of their own schema, not torch.library.custom_op: a custom op that mutates an
input runs a Python ADInplaceOrView kernel on every call (its fill_defaults alone ~60 µs over 15 arguments), which
cost more than the attention half's kernels. With that, a `small` gqa step measured 6.20 -> 5.11 ms (alternating,
one process).

The modules decide when a half runs here (zoo/ffn/swiglu.py's SwiGLU.decode_half, attention/attention.py's
Attention.decode_half, and the same in attention/mla.py, attention/linear_attention.py, ssm/mamba2.py and
ssm/mamba.py: a Half, run by the module's decode_residual, or with every other block's by decode_blocks, one op for
a whole step, through an engine's decode plan, zoo/decode_plan.py):
decode-sized rows in fp32 or bf16, parameters in that dtype, no gradient recorded and no graph being compiled
(kernels/cpu_fused.py's fused_path), plain weights (the attention and feed-forward halves also int8 ones: an int8
projection comes with its per-channel scales, and the int8 GEMV reads it as its own forward does), no forward hook
on the modules a half stands in for (half_weights), and a one-token step over the engine's contiguous cache or
state slots.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks

from . import cpu_decode
from .cpu_fused import fused_path, rms_norm, rms_norm_eager, rotary_eager, swiglu_gemv_eager
from .linear import GEMV_ROWS, Linear
from .linear_attention import linear_attention_step_ref


def half_weights(owner: nn.Module, norm: nn.Module | None, names: tuple[str, ...], biased: tuple[str, ...] = ()
                 ) -> list[torch.Tensor] | None:
    """The weights of owner's projections `names`, where each is exactly a kernels.Linear, bias-free unless named in
    biased, and no forward hook is set on owner, norm (if any), a projection or every module (a fused call runs none
    of their forwards); None otherwise. Read from the modules' own dicts, as nn.Module.__getattr__ would find them:
    that costs ~1 µs an attribute, which was most of the ~47 µs a block took to decide on its two halves."""
    operands = half_operands(owner, norm, names, biased)
    return None if operands is None else operands[0]


def half_operands(owner: nn.Module, norm: nn.Module | None, names: tuple[str, ...], biased: tuple[str, ...] = (),
                  int8: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
    """half_weights' rule, and with int8 a projection may also be an int8 layer that offers its payload and
    per-channel scales (zoo/quantize.py's QuantizedLinear.int8_operands): (weights, scales), scales[i] None for a
    float layer."""
    if (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks or owner._forward_hooks
            or owner._forward_pre_hooks or norm is not None and (norm._forward_hooks or norm._forward_pre_hooks)):
        return None
    children, weights, scales = owner._modules, [], []
    for name in names:
        layer = children.get(name)
        if type(layer) is not Linear:
            operands = layer.int8_operands() if int8 and hasattr(type(layer), "int8_operands") else None
            if operands is None:
                return None
            weights.append(operands[0])
            scales.append(operands[1])
            continue
        if layer._forward_hooks or layer._forward_pre_hooks:
            return None
        params = layer._parameters
        weight = params.get("weight")
        if weight is None or (name not in biased and params.get("bias") is not None):
            return None
        weights.append(weight)
        scales.append(None)
    return weights, scales


def gemv_half_fits(x: torch.Tensor, weights: list[torch.Tensor], *others: torch.Tensor,
                   scales: list[torch.Tensor | None] | None = None) -> bool:
    """A one-token step x [B, 1, D] whose B rows the C GEMV serves in x's dtype, every weight contiguous [N, K] in
    x's dtype (as dense_gemv_fits) or int8 where its scales (from half_operands) are given, on the fused path
    (cpu_fused's fused_path) with the float weights, the scales and the others."""
    rows, dtype = x.shape[0], x.dtype
    if x.shape[1] != 1 or rows not in GEMV_ROWS.get(dtype, ()):
        return False
    scales = scales or [None] * len(weights)
    for w, scale in zip(weights, scales):
        if (w.dtype != (dtype if scale is None else torch.int8) or not w.is_cpu or w.stride() != (w.shape[1], 1)
                or scale is not None and scale.shape != (w.shape[0],)):
            return False
    floats = [w if scale is None else scale for w, scale in zip(weights, scales)]  # an int8 weight's scales
    return fused_path(x, rows, *floats, *others)


def project(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """x times a float weight on the dense GEMV, or an int8 one with per-channel scales on the int8 GEMV."""
    if scales is None:
        return cpu_decode.dense_gemv_eager(x, weight, None)
    return cpu_decode.quantized_gemv_eager(x, weight, scales, None, 0)


def ffn_block_eager(x: torch.Tensor, norm: torch.Tensor, eps: float, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor, gate_scales: torch.Tensor | None = None, up_scales: torch.Tensor | None = None,
                    down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """x + SwiGLU(RMSNorm(x)) on the C kernels (zoo/model.py's Block with an RMSNorm and a bias-free SwiGLU); a
    projection with scales is int8 (zoo/quantize.py's), read by the int8 GEMV as its own forward reads it."""
    h = rms_norm_eager(x, norm, eps)
    if gate_scales is None and up_scales is None and down_scales is None:
        return x + swiglu_gemv_eager(h, gate, up, down)
    hidden = F.silu(project(h, gate, gate_scales)) * project(h, up, up_scales)
    return x + project(hidden, down, down_scales)


ffn_block_op = torch.library.custom_op("archzoo::ffn_block", mutates_args=())(ffn_block_eager)


@ffn_block_op.register_fake
def _(x, norm, eps, gate, up, down, gate_scales=None, up_scales=None, down_scales=None):
    return torch.empty_like(x)


# The halves that write a cache are ops of their own schema, not torch.library.custom_op: a custom op that mutates an
# input runs a Python ADInplaceOrView kernel on every call (its fill_defaults alone ~60 µs over 15 arguments; the
# attention half cost 2.1x its C++ kernel's time that way, hot, one `small` layer).
_LIBRARY = torch.library.Library("archzoo", "FRAGMENT")


def cache_writing_op(name: str, arguments: str, eager, fake=lambda x, *args: torch.empty_like(x)):
    """archzoo::name(arguments) -> Tensor, whose kernel is the Python function `eager` until the C++ glue registers
    its CPU one; a graph being traced sees `fake`'s tensor (default: one like the first argument, x)."""
    _LIBRARY.define(f"{name}({arguments}) -> Tensor")
    _LIBRARY.impl(name, eager, "CompositeExplicitAutograd")
    torch.library.register_fake(f"archzoo::{name}", fake)
    return getattr(torch.ops.archzoo, name).default


def served(op, eager):
    """A call of `op` where the C++ glue serves it, else of its Python function (kernels/cpu_decode.py). Asked only
    on an eager step (the blocks never ask for a half while a graph is compiled), so not op_or_function's check."""
    def call(*args):
        return (op if cpu_decode.glue_available() else eager)(*args)
    return call


def attention_block_eager(x: torch.Tensor, norm: torch.Tensor, eps: float, wq: torch.Tensor, wk: torch.Tensor | None,
                          wv: torch.Tensor | None, wo: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                          lengths: torch.Tensor, scale: float, wq_scales: torch.Tensor | None = None,
                          wk_scales: torch.Tensor | None = None, wv_scales: torch.Tensor | None = None,
                          wo_scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, 1, D] + o(attention(q)) after RMSNorm, with q, k rotated at positions [B, 1] and this step's keys and
    values written at cache[slots[i], :, rows[i]] first (k_cache, v_cache [slots, kv_heads, rows, head_dim]; wk and
    wv None: a layer that reads another layer's cache writes nothing); each sequence's query sees its cache's first
    lengths[i] rows (attention/attention.py's decode step over cache/layouts.py's ContiguousKV). A projection with
    scales is int8 (zoo/quantize.py's), read by the int8 GEMV as its own forward reads it."""
    b = x.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    heads = wq.shape[0] // head_dim
    h = rms_norm_eager(x, norm, eps)
    q = rotary_eager(project(h, wq, wq_scales).view(b, 1, heads, head_dim).transpose(1, 2), positions, inv_freq)
    if wk is not None:
        k = rotary_eager(project(h, wk, wk_scales).view(b, 1, kv_heads, head_dim).transpose(1, 2), positions,
                         inv_freq)
        k_cache[slots, :, rows] = k[:, :, 0]
        v_cache[slots, :, rows] = project(h, wv, wv_scales).view(b, kv_heads, head_dim)
    out = cpu_decode.decode_attention_eager(q[:, :, 0], k_cache, v_cache, slots.to(torch.int32)[:, None], lengths,
                                            "rows", scale, head_dim)
    return x + project(out.reshape(b, 1, heads * head_dim), wo, wo_scales)


attention_block_op = cache_writing_op(
    "attention_block", "Tensor x, Tensor norm, float eps, Tensor wq, Tensor? wk, Tensor? wv, Tensor wo, "
    "Tensor positions, Tensor inv_freq, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor rows, "
    "Tensor lengths, float scale, Tensor? wq_scales=None, Tensor? wk_scales=None, Tensor? wv_scales=None, "
    "Tensor? wo_scales=None", attention_block_eager)


def linear_attention_block_eager(x: torch.Tensor, norm: torch.Tensor, eps: float, wq: torch.Tensor, wk: torch.Tensor,
                                 wv: torch.Tensor, wo: torch.Tensor, kv: torch.Tensor, normalizer: torch.Tensor,
                                 slots: torch.Tensor, attention_eps: float) -> torch.Tensor:
    """x [B, 1, D] + o(linear attention) after RMSNorm, with the elu + 1 feature map and one recurrent step on the
    fp32 states kv [slots, H, dk, dv] and normalizer [slots, H, dk] at rows `slots`, updated in place
    (attention/linear_attention.py's decode step over cache/state_slots.py's StateSlots)."""
    b, heads, dk, dv = x.shape[0], kv.shape[1], kv.shape[2], kv.shape[3]
    h = rms_norm_eager(x, norm, eps)
    q, k = (F.elu(cpu_decode.dense_gemv_eager(h, w, None)) + 1 for w in (wq, wk))
    v = cpu_decode.dense_gemv_eager(h, wv, None)
    state, total = kv[slots], normalizer[slots]
    out = linear_attention_step_ref(q.view(b, heads, dk), k.view(b, heads, dk), v.view(b, heads, dv), state, total,
                                    attention_eps)
    kv[slots], normalizer[slots] = state, total
    return x + cpu_decode.dense_gemv_eager(out.reshape(b, 1, heads * dv), wo, None)


linear_attention_block_op = cache_writing_op(
    "linear_attention_block", "Tensor x, Tensor norm, float eps, Tensor wq, Tensor wk, Tensor wv, Tensor wo, "
    "Tensor(a!) kv, Tensor(b!) normalizer, Tensor slots, float attention_eps", linear_attention_block_eager)


def mla_block_eager(x: torch.Tensor, norm: torch.Tensor, eps: float, wq: torch.Tensor, wkv_a: torch.Tensor,
                    kv_norm: torch.Tensor, kv_eps: float, wkv_b: torch.Tensor, wo: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                    rows: torch.Tensor, lengths: torch.Tensor, scale: float, heads: int, nope: int,
                    v_dim: int) -> torch.Tensor:
    """x [B, 1, D] + o(MLA's absorbed decode attention) after RMSNorm, this step's latent row written at
    cache[slots[i], 0, rows[i]] of a contiguous latent cache [slots, 1, rows, rank + rope] first; each sequence's
    query sees the cache's first lengths[i] rows (attention/mla.py's decode step over cache/layouts.py's
    ContiguousKV)."""
    b, width, rank = x.shape[0], cache.shape[3], kv_norm.shape[0]
    rope = width - rank
    h = rms_norm_eager(x, norm, eps)
    q = cpu_decode.dense_gemv_eager(h, wq, None).view(b, 1, heads, nope + rope).transpose(1, 2)
    kv_a = cpu_decode.dense_gemv_eager(h, wkv_a, None)
    latent = rms_norm_eager(kv_a[..., :rank], kv_norm, kv_eps).unsqueeze(1)
    q_rope = rotary_eager(q[..., nope:], positions, inv_freq)
    k_rope = rotary_eager(kv_a[..., rank:].unsqueeze(1), positions, inv_freq)
    cache[slots, :, rows] = torch.cat([latent, k_rope], dim=-1)[:, :, 0]
    w = wkv_b.view(heads, nope + v_dim, rank)
    query = torch.cat([torch.einsum("bhtn,hnr->bhtr", q[..., :nope], w[:, :nope]), q_rope], dim=-1)
    out = cpu_decode.decode_attention_eager(query[:, :, 0], cache, None, slots.to(torch.int32)[:, None], lengths,
                                            "rows", scale, rank)
    values = torch.einsum("bhtr,hvr->bhtv", out.unsqueeze(2), w[:, nope:])
    return x + cpu_decode.dense_gemv_eager(values.transpose(1, 2).reshape(b, 1, heads * v_dim), wo, None)


mla_block_op = cache_writing_op(
    "mla_block", "Tensor x, Tensor norm, float eps, Tensor wq, Tensor wkv_a, Tensor kv_norm, float kv_eps, "
    "Tensor wkv_b, Tensor wo, Tensor positions, Tensor inv_freq, Tensor(a!) cache, Tensor slots, Tensor rows, "
    "Tensor lengths, float scale, int heads, int nope, int v_dim", mla_block_eager)


def mamba2_block_eager(x: torch.Tensor, norm: torch.Tensor, eps: float, in_w: torch.Tensor, conv_w: torch.Tensor,
                       conv_b: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                       gate_norm: torch.Tensor, gate_eps: float, out_w: torch.Tensor, conv: torch.Tensor,
                       ssm: torch.Tensor, slots: torch.Tensor, groups: int) -> torch.Tensor:
    """x [B, 1, D] + out_proj(Mamba-2's decode step) after RMSNorm, the states at rows `slots` of conv [slots,
    conv_dim, d_conv] and ssm [slots, H, P, N] updated in place (ssm/mamba2.py's Mamba2.step over the engine's state
    slots); conv_w [conv_dim, d_conv], the depthwise conv's taps."""
    heads, head_dim, dstate = ssm.shape[1:]
    d_inner, conv_dim = heads * head_dim, conv.shape[1]
    z, xbc, dt = cpu_decode.dense_gemv_eager(rms_norm_eager(x, norm, eps), in_w, None)[:, 0].split(
        [d_inner, conv_dim, heads], dim=-1)
    window = torch.cat([conv[slots][..., 1:], xbc[..., None].to(conv.dtype)], dim=-1)
    conv[slots] = window
    mixed = (window * conv_w).sum(-1)
    if conv_b is not None:
        mixed = mixed + conv_b
    xs, B, C = F.silu(mixed).to(z.dtype).split([d_inner, groups * dstate, groups * dstate], dim=-1)
    A = (-torch.exp(A_log.float()))[:, None, None].expand(-1, head_dim, dstate)
    state = ssm[slots]
    y = cpu_decode.state_update_eager(state, xs.unflatten(-1, (heads, head_dim)).float(),
                                      dt[..., None].expand(-1, -1, head_dim).float(), A,
                                      B.unflatten(-1, (groups, dstate)).float(),
                                      C.unflatten(-1, (groups, dstate)).float(),
                                      D[:, None].expand(-1, head_dim).float(), None,
                                      dt_bias[:, None].expand(-1, head_dim).float(), True)
    ssm[slots] = state
    gated = y.to(x.dtype).flatten(-2).float() * F.silu(z.float())
    parts = gated.unflatten(-1, (-1, d_inner // groups))
    parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + gate_eps)
    normed = gate_norm * parts.flatten(-2).to(x.dtype)
    return x + cpu_decode.dense_gemv_eager(normed[:, None], out_w, None)


mamba2_block_op = cache_writing_op(
    "mamba2_block", "Tensor x, Tensor norm, float eps, Tensor in_w, Tensor conv_w, Tensor? conv_b, Tensor dt_bias, "
    "Tensor A_log, Tensor D, Tensor gate_norm, float gate_eps, Tensor out_w, Tensor(a!) conv, Tensor(b!) ssm, "
    "Tensor slots, int groups", mamba2_block_eager)


def mamba_block_eager(x: torch.Tensor, norm: torch.Tensor, eps: float, in_w: torch.Tensor, conv_w: torch.Tensor,
                      conv_b: torch.Tensor | None, x_w: torch.Tensor, dt_w: torch.Tensor, dt_b: torch.Tensor,
                      A_log: torch.Tensor, D: torch.Tensor, out_w: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """x [B, 1, D] + out_proj(Mamba's decode step) after RMSNorm, the states at rows `slots` of conv [slots, d_inner,
    d_conv] and ssm [slots, d_inner, N] updated in place (ssm/mamba.py's Mamba.step over the engine's state slots);
    conv_w [d_inner, d_conv], the depthwise conv's taps."""
    d_inner, dstate, rank = ssm.shape[1], ssm.shape[2], dt_w.shape[1]
    xs, z = cpu_decode.dense_gemv_eager(rms_norm_eager(x, norm, eps), in_w, None)[:, 0].chunk(2, dim=-1)
    window = torch.cat([conv[slots][..., 1:], xs[..., None].to(conv.dtype)], dim=-1)
    conv[slots] = window
    mixed = (window * conv_w).sum(-1)
    if conv_b is not None:
        mixed = mixed + conv_b
    xc = F.silu(mixed.to(x.dtype))
    dt, B, C = cpu_decode.dense_gemv_eager(xc, x_w, None).split([rank, dstate, dstate], dim=-1)
    dt = F.linear(dt, dt_w)
    state = ssm[slots]
    y = cpu_decode.state_update_eager(state.unsqueeze(1), xc[:, None].float(), dt[:, None].float(),
                                      (-torch.exp(A_log.float()))[None], B[:, None].float(), C[:, None].float(),
                                      D[None].float(), z[:, None].float(), dt_b[None].float(), True)
    ssm[slots] = state
    return x + cpu_decode.dense_gemv_eager(y[:, 0].to(x.dtype)[:, None], out_w, None)


mamba_block_op = cache_writing_op(
    "mamba_block", "Tensor x, Tensor norm, float eps, Tensor in_w, Tensor conv_w, Tensor? conv_b, Tensor x_w, "
    "Tensor dt_w, Tensor dt_b, Tensor A_log, Tensor D, Tensor out_w, Tensor(a!) conv, Tensor(b!) ssm, Tensor slots",
    mamba_block_eager)


ffn_block = served(ffn_block_op, ffn_block_eager)
attention_block = served(attention_block_op, attention_block_eager)
mla_block = served(mla_block_op, mla_block_eager)
linear_attention_block = served(linear_attention_block_op, linear_attention_block_eager)
mamba2_block = served(mamba2_block_op, mamba2_block_eager)
mamba_block = served(mamba_block_op, mamba_block_eager)


# A half as the modules decide it (their decode_half) and as decode_blocks takes it: per kind, its read-only tensors,
# the states it writes, its floats and its ints, counted here in the order of each op's arguments (ops.cpp keeps the
# same table). A kind that attends over cached rows finds its step's rows and lengths through its cache.
# "norm" and "head" are no halves of a block: the model's final RMSNorm and its head (the C GEMV, with its bias), so a
# step's plan can end at its logits (each called on its own measured 60-180 µs of a `small` step: its module's Python
# and the op's dispatch, run on caches the weights had evicted).
KINDS = ("ffn", "attention", "mla", "linear_attention", "mamba2", "mamba", "norm", "head")  # decode_blocks' codes
SIZES = {"ffn": (7, 0, 1, 0), "attention": (10, 2, 2, 0), "mla": (7, 1, 3, 3), "linear_attention": (5, 2, 2, 0),
         "mamba2": (9, 2, 2, 1), "mamba": (10, 2, 1, 0), "norm": (1, 0, 1, 0),
         "head": (2, 0, 0, 0)}  # (weights, states, floats, ints)


@dataclass(frozen=True, eq=False)
class Half:
    """One half of a decode block, decided: `kind` (KINDS), weights (None where an optional one is absent: an int8
    projection's scales, a conv bias, a layer's own keys), states (its cache or state tensors, written in place),
    floats and ints as SIZES counts them, and `cache`, whose decode_rows(batch) gives an attending kind its rows."""
    kind: str
    weights: tuple
    states: tuple = ()
    floats: tuple = ()
    ints: tuple = ()
    cache: object = None

    def __post_init__(self):
        counts = (len(self.weights), len(self.states), len(self.floats), len(self.ints))
        if SIZES.get(self.kind) != counts:
            raise ValueError(f"a {self.kind!r} half takes (weights, states, floats, ints) {SIZES.get(self.kind)}, "
                             f"got {counts}; kinds: {', '.join(KINDS)}")


def half_arguments(half: Half, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   rows: torch.Tensor | None, lengths: torch.Tensor | None) -> tuple:
    """The arguments of half's op (its kind's *_block) for this step, in the op's order."""
    w, s, f, i = half.weights, half.states, half.floats, half.ints
    if half.kind == "ffn":
        return (x, w[0], f[0], *w[1:4], *w[4:7])
    if half.kind == "attention":
        return (x, w[0], f[0], *w[1:5], positions, w[5], *s, slots, rows, lengths, f[1], *w[6:10])
    if half.kind == "mla":
        return (x, w[0], f[0], w[1], w[2], w[3], f[1], w[4], w[5], positions, w[6], s[0], slots, rows, lengths, f[2],
                *i)
    if half.kind == "linear_attention":
        return (x, w[0], f[0], *w[1:5], *s, slots, f[1])
    if half.kind == "mamba2":
        return (x, w[0], f[0], *w[1:7], w[7], f[1], w[8], *s, slots, i[0])
    if half.kind == "norm":
        return (x, w[0], f[0])
    if half.kind == "head":
        return (x, w[0], w[1])
    return (x, w[0], f[0], *w[1:10], *s, slots)  # mamba


EAGER = {"ffn": ffn_block_eager, "attention": attention_block_eager, "mla": mla_block_eager,
         "linear_attention": linear_attention_block_eager, "mamba2": mamba2_block_eager, "mamba": mamba_block_eager,
         "norm": rms_norm_eager, "head": cpu_decode.dense_gemv_eager}
SERVED = {"ffn": ffn_block, "attention": attention_block, "mla": mla_block,
          "linear_attention": linear_attention_block, "mamba2": mamba2_block, "mamba": mamba_block, "norm": rms_norm,
          "head": served(cpu_decode.dense_gemv, cpu_decode.dense_gemv_eager)}


def run_half(half: Half, x: torch.Tensor, positions: torch.Tensor | None, batch) -> torch.Tensor:
    """x after one half: its op where the C++ glue serves it, else its Python function (batch None: a half that
    reads no slots, the feed-forward's)."""
    rows, lengths = half.cache.decode_rows(batch) if half.cache is not None else (None, None)
    slots = None if batch is None else batch.slots
    return SERVED[half.kind](*half_arguments(half, x, positions, slots, rows, lengths))


def flatten_halves(halves: list[Half]) -> tuple[list, list, list[float], list[int], list]:
    """decode_blocks' lists for `halves` in order: (weights, states, floats, ints, caches). ints holds each half's kind
    code, its row group (an index into caches, whose decode_rows a step calls once; -1: none) and its own ints; caches
    that find rows by one rule (cache/layouts.py's rows_rule) share a group."""
    weights, states, floats, ints, caches, groups = [], [], [], [], [], {}
    for half in halves:
        group = -1
        if half.cache is not None:
            group = groups.setdefault(half.cache.rows_rule(), len(groups))
            if group == len(caches):
                caches.append(half.cache)
        weights += half.weights
        states += half.states
        floats += half.floats
        ints += [KINDS.index(half.kind), group, *half.ints]
    return weights, states, floats, ints, caches


def decode_blocks_eager(x: torch.Tensor, weights: list, states: list, floats: list[float], ints: list[int],
                        positions: torch.Tensor, slots: torch.Tensor, rows: list[torch.Tensor],
                        lengths: list[torch.Tensor], buffers: list[torch.Tensor]) -> torch.Tensor:
    """x after every half flatten_halves laid out, in order, each by its Python function (the op's reference).
    buffers (step_buffers'): where the C++ op may write a half's output and hidden rows; unused here."""
    w = s = f = i = 0
    while i < len(ints):
        kind, group = KINDS[ints[i]], ints[i + 1]
        nw, ns, nf, ni = SIZES[kind]
        half = Half(kind, tuple(weights[w:w + nw]), tuple(states[s:s + ns]), tuple(floats[f:f + nf]),
                    tuple(ints[i + 2:i + 2 + ni]))
        found = (rows[group], lengths[group]) if group >= 0 else (None, None)
        x = EAGER[kind](*half_arguments(half, x, positions, slots, *found))
        w, s, f, i = w + nw, s + ns, f + nf, i + 2 + ni
    return x


def last_kind(ints: list[int]) -> str | None:
    """The kind of the last half flatten_halves laid out in `ints` (None: none)."""
    i, kind = 0, None
    while i < len(ints):
        kind = KINDS[ints[i]]
        i += 2 + SIZES[kind][3]
    return kind


def decode_blocks_fake(x, weights, states, floats, ints, *args):
    """What a traced decode_blocks returns: x's shape, or logits' where the plan ends at the head."""
    return x.new_empty(*x.shape[:-1], weights[-2].shape[0]) if last_kind(ints) == "head" else torch.empty_like(x)


decode_blocks_op = cache_writing_op(
    "decode_blocks", "Tensor x, Tensor?[] weights, Tensor(a!)[] states, float[] floats, int[] ints, "
    "Tensor positions, Tensor slots, Tensor[] rows, Tensor[] lengths, Tensor(b!)[] buffers", decode_blocks_eager,
    decode_blocks_fake)


def step_buffers(x: torch.Tensor, halves: list[Half]) -> list[torch.Tensor]:
    """Where decode_blocks writes x between halves (two of x's shape, in turn) and the feed-forward's gated and up
    rows ([B, hidden]; the widest feed-forward's: a narrower one allocates its own), for a plan to hold and pass
    every step; the last half's output is always fresh, since the step returns it. Normal tensors, not inference
    ones, though a plan is decided in an engine's inference_mode: a step run under no_grad writes them too."""
    hidden = max((half.weights[1].shape[0] for half in halves if half.kind == "ffn"), default=0)
    with torch.inference_mode(False):
        return [torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[0], hidden),
                x.new_empty(x.shape[0], hidden)]
