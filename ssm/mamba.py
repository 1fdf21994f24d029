"""Mamba (v1) selective-state-space mixer, with mamba-ssm's (and HF MambaMixer's) weight names.

    x, z = in_proj(u)                                     [B, T, d_inner] each
    x = silu(causal depthwise conv1d(x))                  kernel d_conv, left-padded (or fed by the conv state)
    dt, B, C = split(x_proj(x))                           [dt_rank], [d_state], [d_state]
    dt = softplus(dt_proj(dt))                            [d_inner], bias = inverse softplus of the initial step
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * x_t      A = -exp(A_log), h [d_inner, d_state]
    y_t = h_t . C_t + D * x_t,   out = out_proj(y * silu(z))

The cache is a fixed-size state per sequence: the last d_conv conv inputs and h.
"""
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from attention.norm import RMSNorm
from cache.spec import CacheBatch, CacheSpec
from cache.state_slots import StateSlots
from ssm.reference import mamba_reference
from kernels import Linear, cpu_blocks, cpu_decode, selective_state_update
from ssm.scan import SelectiveScan, compiled_kernel_fits, scan_forward

def selective_scan(x, dt, A, B, C, D, z, state, last=None, every_state: bool = False):
    """The recurrence over T steps from `state`, one step at a time on [b, d, n] tensors that stay in cache
    (ssm/scan.py; 2-3x faster on CPU than precomputing exp(dt*A) for all steps).

    x, dt, z: [b, T, d]; A: [d, n]; B, C: [b, T, n]; D: [d]; state: [b, d, n] (any dtype; arithmetic in at
    least fp32). dt is after bias and softplus. last: [b] index of each row's last real token (a right-padded
    batch keeps each row's state after that token), None = T - 1 for every row.
    Returns y [b, T, d] and the final state [b, d, n], both fp32 (or wider); every_state: the state after each
    step instead, [b, T, d, n] (a speculative verification's checkpoints).
    """
    t = x.shape[1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (v.to(dtype) for v in (x, dt, A, B, C))
    if last is not None:  # dt = 0 after a row's end: decay 1 and no input, so its state stops there
        dt = dt * (torch.arange(t, device=x.device) <= last[:, None]).unsqueeze(-1)
    dtx = dt * x
    if every_state:
        ys, _, hs = scan_forward(dt, A, dtx, B, C, state.to(dtype), keep_states=True)
        h = hs.transpose(0, 1)
    elif torch.is_grad_enabled() and any(v.requires_grad for v in (x, dt, A, B, C, state)):
        ys, h = SelectiveScan.apply(dt, A, dtx, B, C, state.to(dtype))
    elif compiled_kernel_fits(dt, A):
        ys, h = cpu_decode.selective_scan_cpu(dt, A, dtx, B, C, state.to(dtype))
    else:
        ys, h, _ = scan_forward(dt, A, dtx, B, C, state.to(dtype), keep_states=False)
    y = (ys + x * D.to(dtype)) * F.silu(z.to(dtype))
    return y, h


@functools.cache
def cuda_kernels():
    """mamba-ssm's fused scan and the causal-conv1d kernel, when both are installed (CUDA only); else None.
    Imported lazily: a CPU run never imports mamba_ssm."""
    try:
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except (ImportError, OSError):
        return None
    return selective_scan_fn, causal_conv1d_fn


def checked_dt_rank(d_model: int, d_state: int, d_conv: int, expand: int, dt_rank: int | None) -> int:
    """The sizes checked; dt_rank with its default (mamba-ssm's "auto") filled in."""
    for name, value in (("d_state", d_state), ("d_conv", d_conv), ("expand", expand)):
        if value <= 0:
            raise ValueError(f"Mamba {name} must be > 0, got {name}={value}")
    dt_rank = math.ceil(d_model / 16) if dt_rank is None else dt_rank
    if dt_rank <= 0:
        raise ValueError(f"Mamba dt_rank must be > 0 (or None for ceil(d_model/16)), got dt_rank={dt_rank}")
    return dt_rank


class Mamba(nn.Module):
    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | None = None,
        conv_bias: bool = True,
        bias: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
    ):
        """dt_rank: width of the low-rank time-step projection (None: ceil(d_model / 16), mamba-ssm's "auto").
        bias: biases on in_proj and out_proj; conv_bias: on the depthwise conv. dt_min/dt_max/dt_init_floor:
        the initial time steps are log-uniform in [dt_min, dt_max], at least dt_init_floor (init only)."""
        super().__init__()
        dt_rank = checked_dt_rank(d_model, d_state, d_conv, expand, dt_rank)
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"Mamba needs 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        self.layer_idx = layer_idx
        self.d_state, self.d_conv, self.dt_rank = d_state, d_conv, dt_rank
        self.d_inner = int(expand * d_model)
        self.dt_min, self.dt_max, self.dt_init_floor = dt_min, dt_max, dt_init_floor
        self.in_proj = Linear(d_model, 2 * self.d_inner, bias=bias)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1,
                                bias=conv_bias)
        self.x_proj = Linear(self.d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = Linear(dt_rank, self.d_inner, bias=True)
        # S4D-real init: A = -(1..d_state) for every channel, stored as its log
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(self.d_inner, 1))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = Linear(self.d_inner, d_model, bias=bias)
        self.reset_dt()

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, d_state: int, d_conv: int, expand: int, dt_rank: int | None,
                     conv_bias: bool, bias: bool, **_) -> int:
        """Bytes of the parameters __init__ makes, from its arguments alone (the rest size nothing)."""
        dt_rank = checked_dt_rank(d_model, d_state, d_conv, expand, dt_rank)
        d_inner = int(expand * d_model)
        elements = (d_model * 2 * d_inner + (2 * d_inner + d_model if bias else 0)  # in_proj, out_proj biases
                    + d_inner * (d_conv + (1 if conv_bias else 0))  # depthwise conv1d
                    + d_inner * (dt_rank + 2 * d_state)  # x_proj
                    + (dt_rank + 1) * d_inner  # dt_proj, with its bias
                    + d_inner  # D
                    + d_inner * d_model)  # out_proj
        return elements * dtype.itemsize + d_inner * d_state * 4  # A_log is fp32 whatever the default dtype

    @torch.no_grad()
    def reset_dt(self) -> None:
        """mamba-ssm's time-step init. The dt projection's weight and bias are marked `_no_reinit` (mamba-ssm's
        mark) so a model-wide init that honours it leaves them alone; else call this after it."""
        std = self.dt_rank**-0.5
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        dt = torch.exp(torch.rand(self.d_inner) * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min))
        dt = dt.clamp(min=self.dt_init_floor)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus: softplus(bias) = dt
        self.dt_proj.weight._no_reinit = True
        self.dt_proj.bias._no_reinit = True

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kind="state", state_shapes=(("conv", (self.d_inner, self.d_conv)),
                                                     ("ssm", (self.d_inner, self.d_state))))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None, batch: CacheBatch | None = None):
        """x: [B, T, d_model] -> [B, T, d_model]. Without a cache: from a zero state. With one (StateSlots): from the
        sequences' states, which are written back; a decode step (T == 1) advances them by one token."""
        if cache is None:
            if x.is_cuda and cuda_kernels() is not None:
                return self.forward_cuda(x)[0]
            return self.forward_scan(x, self.zero_states(x))[0]
        states = cache.read(batch)
        if batch.is_decode:
            out, new_states = self.step(x, states)
        elif batch.checkpoints:  # several tokens, any prefix of which the engine may keep
            out, steps = self.forward_scan(x, states, every_state=True)
            cache.write_steps(steps, batch)
            return out
        elif batch.is_prefill and x.shape[0] == 1 and x.is_cuda and cuda_kernels() is not None:
            out, new_states = self.forward_cuda(x)
        else:
            # tokens of each row that are real: a right-padded batch keeps each row's state after its last one
            new_tokens = batch.lengths.to(torch.long) - batch.positions[:, 0].to(torch.long)
            out, new_states = self.forward_scan(x, states, last=new_tokens - 1)
        cache.write(new_states, batch)
        return out

    def decode_residual(self, norm: nn.Module, x: torch.Tensor, positions, cache, batch: CacheBatch | None
                        ) -> torch.Tensor | None:
        """x + self(norm(x), ...) in one call (kernels/cpu_blocks.py) where decode_half decides one; None elsewhere,
        where the block runs the two modules."""
        half = self.decode_half(norm, x, cache, batch)
        return None if half is None else cpu_blocks.run_half(half, x, positions, batch)

    def decode_half(self, norm: nn.Module, x: torch.Tensor, cache, batch: CacheBatch | None
                    ) -> "cpu_blocks.Half | None":
        """This layer's half of an eager CPU one-token decode step over the engine's state slots in x's dtype, after
        an RMSNorm, with plain projections on the C GEMV (in_proj and out_proj bias-free); None elsewhere."""
        if (batch is None or batch.step != "decode" or batch.checkpoints or batch.padded
                or type(cache) is not StateSlots or type(norm) is not RMSNorm or type(self) is not Mamba
                or {"forward", "step", "time_step"} & vars(self).keys()):  # the fused half computes these itself
            return None
        # dt_proj's weight is read whole ([d_inner, dt_rank]: its rows are not the C GEMV's to stream)
        weights = cpu_blocks.half_weights(self, norm, ("in_proj", "x_proj", "out_proj", "dt_proj"), biased=("dt_proj",))
        if weights is None:
            return None
        conv, ssm, conv_bias = cache.tensors["conv"], cache.tensors["ssm"], self.conv1d.bias
        # every parameter in x's dtype: the half reads them as they are (kernels/cpu/mamba_half.c)
        if (not cpu_blocks.gemv_half_fits(x, weights[:3], norm.weight, weights[3], self.dt_proj.bias,
                                          self.conv1d.weight, self.A_log, self.D,
                                          *(() if conv_bias is None else (conv_bias,)))
                or conv.dtype != x.dtype or ssm.dtype != x.dtype or not cpu_decode.state_update_fits(ssm)):
            return None
        return cpu_blocks.Half("mamba", (norm.weight, weights[0], self.conv1d.weight[:, 0], self.conv1d.bias,
                                         weights[1], weights[3], self.dt_proj.bias, self.A_log, self.D, weights[2]),
                               (conv, ssm), (norm.eps,))

    def zero_states(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        b = x.shape[0]
        return {"conv": x.new_zeros(b, self.d_inner, self.d_conv), "ssm": x.new_zeros(b, self.d_inner, self.d_state)}

    def time_step(self, x: torch.Tensor):
        """x (after the conv) -> dt before bias and softplus, B, C."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        return F.linear(dt, self.dt_proj.weight), B, C

    def forward_scan(self, u: torch.Tensor, states: dict, last: torch.Tensor | None = None, every_state: bool = False):
        """The whole chunk of T tokens from `states`; returns the output and the states after each row's last token
        (every_state: after each token, [b, T, ...])."""
        b, t, _ = u.shape
        x, z = self.in_proj(u).chunk(2, dim=-1)
        # conv input: the previous d_conv - 1 inputs (zeros at the start) then the new ones
        window = torch.cat([states["conv"].to(x.dtype), x.transpose(1, 2)], dim=2)  # [b, d_inner, d_conv + T]
        weight, bias = self.conv1d.weight, self.conv1d.bias
        xc = F.silu(F.conv1d(window[:, :, 1:], weight, bias, groups=self.d_inner)).transpose(1, 2)  # [b, T, d_inner]
        dt, B, C = self.time_step(xc)
        dtype = torch.promote_types(u.dtype, torch.float32)  # the scan runs in fp32 at least (mamba-ssm does)
        dt = F.softplus(dt.to(dtype) + self.dt_proj.bias.to(dtype))
        A = -torch.exp(self.A_log.to(dtype))
        y, ssm = selective_scan(xc, dt, A, B, C, self.D, z, states["ssm"], last, every_state)
        if every_state:  # the conv state after token i: the d_conv inputs ending at it
            conv = window.unfold(2, self.d_conv, 1)[:, :, 1:].transpose(1, 2)
        elif last is None:
            conv = window[:, :, -self.d_conv:]
        else:  # the d_conv inputs ending at each row's last real token
            idx = (last + 1)[:, None] + torch.arange(self.d_conv, device=u.device)
            conv = window.gather(2, idx[:, None, :].expand(b, self.d_inner, self.d_conv))
        return self.out_proj(y.to(u.dtype)), {"conv": conv, "ssm": ssm}

    def step(self, u: torch.Tensor, states: dict):
        """One token per row: shift it into the conv state, then advance the SSM state by one step."""
        x, z = self.in_proj(u[:, 0]).chunk(2, dim=-1)  # [B, d_inner]
        conv = torch.cat([states["conv"][:, :, 1:], x[:, :, None].to(states["conv"].dtype)], dim=2)
        xc = (conv * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            xc = xc + self.conv1d.bias
        xc = F.silu(xc.to(u.dtype))
        dt, B, C = self.time_step(xc)
        ssm = states["ssm"]
        y = selective_state_update(ssm, xc, dt, -torch.exp(self.A_log.float()), B, C, D=self.D, z=z,
                                   dt_bias=self.dt_proj.bias, dt_softplus=True)
        return self.out_proj(y.to(u.dtype))[:, None], {"conv": conv, "ssm": ssm}

    def forward_cuda(self, u: torch.Tensor):
        """Prefill from a zero state through mamba-ssm's fused scan and the causal-conv1d kernel."""
        selective_scan_fn, causal_conv1d_fn = cuda_kernels()
        t = u.shape[1]
        xz = self.in_proj(u).transpose(1, 2)  # [b, 2 d_inner, T]
        x, z = xz.chunk(2, dim=1)
        conv = F.pad(x, (self.d_conv - t, 0))  # last d_conv inputs, zero-padded (cropped when T > d_conv)
        x = causal_conv1d_fn(x.contiguous(), self.conv1d.weight[:, 0], self.conv1d.bias, activation="silu")
        dt, B, C = self.time_step(x.transpose(1, 2))
        y, ssm = selective_scan_fn(
            x, dt.transpose(1, 2).contiguous(), -torch.exp(self.A_log.float()), B.transpose(1, 2).contiguous(),
            C.transpose(1, 2).contiguous(), self.D.float(), z=z.contiguous(), delta_bias=self.dt_proj.bias.float(),
            delta_softplus=True, return_last_state=True,
        )
        return self.out_proj(y.transpose(1, 2)), {"conv": conv, "ssm": ssm}

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 oracle: the recurrence, one token at a time (ssm/reference.py)."""
        return mamba_reference(self, x)
