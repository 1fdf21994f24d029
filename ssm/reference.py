"""Naive float64 references of the state-space mixers, step by step from the papers.

The oracle of tests/test_reference_oracle.py: each reads only the mixer's weights and hyperparameters and runs the
recurrence one token at a time in float64 (its own conv, discretisation, scan and norm; no call into the mixer's
forward, ssm/scan.py, kernels/ or cache/). Input [B, T, d_model] from a zero state; output float64.

    mamba_reference(mixer, x)    Mamba-1 (Gu & Dao 2023, Alg. 2), mamba-ssm's discretisation
    mamba2_reference(mixer, x)   Mamba-2 / SSD (Dao & Gu 2024), scalar decay per head, gated RMSNorm
"""
import torch

F64 = torch.float64


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(F64)


def project(linear, x: torch.Tensor) -> torch.Tensor:
    y = x @ f64(linear.weight).T
    if getattr(linear, "bias", None) is not None:
        y = y + f64(linear.bias)
    return y


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), written to stay finite for large x."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))


def causal_depthwise_conv(x: torch.Tensor, conv) -> torch.Tensor:
    """x [B, T, C]; conv an nn.Conv1d(C, C, K, groups=C). Channel c at step t:
    sum_j w[c, j] * x[t - (K - 1) + j, c] + bias[c], with x = 0 before the start."""
    b, t, channels = x.shape
    w = f64(conv.weight)[:, 0]  # [C, K]
    kernel = w.shape[-1]
    out = torch.zeros(b, t, channels, dtype=F64)
    for step in range(t):
        for j in range(kernel):
            source = step - (kernel - 1) + j
            if source >= 0:
                out[:, step] += w[:, j] * x[:, source]
    if conv.bias is not None:
        out = out + f64(conv.bias)
    return out


def mamba_reference(mixer, u: torch.Tensor) -> torch.Tensor:
    """Mamba-1 selective SSM block (Gu & Dao 2023), from a zero state:

        x, z = in_proj(u)                          [d_inner] each
        x = SiLU(causal depthwise conv(x))
        dt_low, B, C = x_proj(x);  dt = softplus(dt_proj(dt_low))   (bias inside the softplus)
        A = -exp(A_log)                            [d_inner, d_state]
        h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t) B_t     (ZOH for A; B-bar x = dt B x, as mamba-ssm)
        y_t = h_t C_t + D x_t;   out = out_proj(y * SiLU(z))
    """
    u = f64(u)
    b, t, _ = u.shape
    d_inner, d_state, dt_rank = mixer.d_inner, mixer.d_state, mixer.dt_rank
    xz = project(mixer.in_proj, u)
    x, z = xz[..., :d_inner], xz[..., d_inner:]
    x = silu(causal_depthwise_conv(x, mixer.conv1d))
    dbc = project(mixer.x_proj, x)
    dt_low, B, C = dbc[..., :dt_rank], dbc[..., dt_rank:dt_rank + d_state], dbc[..., dt_rank + d_state:]
    dt = softplus(project(mixer.dt_proj, dt_low))  # [B, T, d_inner]
    A = -torch.exp(f64(mixer.A_log))  # [d_inner, d_state]
    D = f64(mixer.D)
    h = torch.zeros(b, d_inner, d_state, dtype=F64)
    y = torch.zeros(b, t, d_inner, dtype=F64)
    for step in range(t):
        dt_t, x_t = dt[:, step], x[:, step]  # [B, d_inner]
        decay = torch.exp(dt_t[..., None] * A)  # [B, d_inner, d_state]
        h = decay * h + (dt_t * x_t)[..., None] * B[:, step, None, :]
        y[:, step] = (h * C[:, step, None, :]).sum(-1) + D * x_t
    return project(mixer.out_proj, y * silu(z))


def mamba2_reference(mixer, u: torch.Tensor) -> torch.Tensor:
    """Mamba-2 block (Dao & Gu 2024, SSD; mamba-ssm's Mamba2), from a zero state:

        z, xBC, dt = in_proj(u)                    [d_inner], [d_inner + 2 G N], [H]
        xBC = SiLU(causal depthwise conv(xBC));  x [H, P], B [G, N], C [G, N]
        dt = softplus(dt + dt_bias);  A = -exp(A_log)   one scalar per head
        head h uses B/C group g = h // (H / G):
        h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T       [P, N]
        y_t = h_t C_t + D_h x_t
        y = RMSNorm(y * SiLU(z)) over groups of d_inner / G channels (norm_before_gate=False), times its gain
        out = out_proj(y)
    """
    u = f64(u)
    b, t, _ = u.shape
    d_inner, n, heads, p, groups = mixer.d_inner, mixer.d_state, mixer.n_heads, mixer.head_dim, mixer.n_groups
    proj = project(mixer.in_proj, u)
    z, xbc, dt = proj[..., :d_inner], proj[..., d_inner:d_inner + mixer.conv_dim], proj[..., d_inner + mixer.conv_dim:]
    assert dt.shape[-1] == heads and heads * p == d_inner
    xbc = silu(causal_depthwise_conv(xbc, mixer.conv1d))
    x = xbc[..., :d_inner].reshape(b, t, heads, p)
    B = xbc[..., d_inner:d_inner + groups * n].reshape(b, t, groups, n)
    C = xbc[..., d_inner + groups * n:].reshape(b, t, groups, n)
    dt = softplus(dt + f64(mixer.dt_bias))  # [B, T, H]
    A = -torch.exp(f64(mixer.A_log))  # [H]
    D = f64(mixer.D)
    per_group = heads // groups
    state = torch.zeros(b, heads, p, n, dtype=F64)
    y = torch.zeros(b, t, heads, p, dtype=F64)
    for step in range(t):
        for h in range(heads):
            g = h // per_group
            dt_h = dt[:, step, h][:, None, None]  # [B, 1, 1]
            x_h = x[:, step, h]  # [B, P]
            state[:, h] = torch.exp(dt_h * A[h]) * state[:, h] + dt_h * x_h[:, :, None] * B[:, step, g][:, None, :]
            y[:, step, h] = (state[:, h] * C[:, step, g][:, None, :]).sum(-1) + D[h] * x_h
    gated = y.reshape(b, t, d_inner) * silu(z)
    norm = mixer.norm
    size = d_inner // groups
    pieces = []
    for g in range(groups):
        piece = gated[..., g * size:(g + 1) * size]
        pieces.append(piece / torch.sqrt((piece * piece).mean(-1, keepdim=True) + norm.eps))
    normed = torch.cat(pieces, dim=-1) * f64(norm.weight)
    return project(mixer.out_proj, normed)

