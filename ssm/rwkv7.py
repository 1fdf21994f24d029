"""RWKV-7 "Goose" (Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution"): the time-mixing
layer, a linear RNN whose matrix state is decayed per channel and edited by a delta-rule-like rank-one term with a
vector in-context learning rate.

Per token, each of r, w, k, v, a, g reads its own mix of x_t and the previous token's input (token shift; zero before
the sequence): x^c_t = x_t + mu_c * (x_{t-1} - x_t). Then, per head of width dk (= dv):
    r = r_proj(x^r),  k' = k_proj(x^k),  v = v_proj(x^v)
    log w = -e^{-0.5} sigmoid(w_lora(x^w))   in (-0.607, 0): decays w in (0.545, 1)
    a = sigmoid(a_lora(x^a))                  the in-context learning rate, per channel
    g = g_lora(x^g)                           the output gate (sigmoid inside the low-rank pair, none outside)
    kk = L2-normalise(k' * k_k) per head      the removal key;   k = k' * (1 + (a - 1) * k_a)
    S_t = (diag(w_t) - (a_t * kk_t) kk_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T r_t      (S: [dk, dv])
    y_t = (GroupNorm_head(o_t) + (r_t . (k_t * r_k)) v_t) * g_t,   out = o_proj(y)
The paper's S is [dv, dk] (S_t = S_{t-1}(diag(w_t) - kk_t^T (a_t kk_t)) + v_t^T k_t); archzoo keeps its transpose, keys
along rows, as the Gated DeltaNet state (kernels/rwkv7.py). The decay's form is flash-linear-attention's
(`-0.6065 * w_lora(x).sigmoid()`), equal to RWKV-LM's w = exp(-exp(-0.5 - softplus(-z))); the low-rank pairs
(w: tanh between, bias after; a: bias after; g: sigmoid between, no bias), the removal-key norm (F.normalize, eps
1e-12), the GroupNorm eps (head_dim * norm_eps, with weight and bias) and the bonus term follow fla's RWKV7Attention.

Deviation: RWKV-7's value residual is left out. There, layer 0's v ("v_first") is mixed into every later layer's v
through a sigmoid low-rank gate; that crosses layers, and archzoo's mixer contract gives a layer only its own input
and its own cache. Every layer here is what RWKV-7's layer 0 is (no v_lora, v as projected). The initialisation is
fla's for a middle layer (its depth-dependent ratios at one half), since a mixer does not know the model's depth.

Prefill and training run the chunked form, decode one recurrent step (kernels/rwkv7.py). Per layer and sequence the
cache holds the previous token's input ("shift", [d_model]) and the state ("wkv", [n_heads, dk, dv]), in fp32.
"""
import math

import torch
from torch import nn

from attention.heads import default_head_dim
from cache.spec import CacheBatch, CacheSpec
from kernels import Linear
from kernels.rwkv7 import rwkv7_chunked, rwkv7_step

NORMALIZE_EPS = 1e-12  # F.normalize's floor on the norm, as fla's kk
DECAY_SCALE = math.exp(-0.5)  # log w = -e^{-0.5} sigmoid(.): the paper's -0.5 offset inside the double exponential
MIXES = ("r", "w", "k", "v", "a", "g")  # the token-shift mixes' order in `token_mix`
ACTIVATIONS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "none": lambda x: x}


def default_rank(d_model: int, head_dim: int, scale: float, by_head: bool) -> int:
    """fla's low-rank widths: scale * sqrt(d_model) (times head_dim / 64 for the decay and the learning rate),
    rounded to a multiple of 32, at least 32."""
    factor = head_dim / 64 if by_head else 1.0
    return max(32, int(round(scale * math.sqrt(d_model) * factor / 32) * 32))


def checked_sizes(d_model: int, n_heads: int, head_dim: int | None, decay_low_rank: int | None,
                  a_low_rank: int | None, gate_low_rank: int | None) -> tuple[int, int, int, int]:
    """The sizes checked: head_dim and the three low-rank widths with their defaults filled in."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    head_dim = default_head_dim(d_model, n_heads, head_dim)
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    defaults = {"decay_low_rank": default_rank(d_model, head_dim, 2.5, by_head=True),
                "a_low_rank": default_rank(d_model, head_dim, 2.5, by_head=True),
                "gate_low_rank": default_rank(d_model, head_dim, 5, by_head=False)}
    given = {"decay_low_rank": decay_low_rank, "a_low_rank": a_low_rank, "gate_low_rank": gate_low_rank}
    ranks = {name: defaults[name] if value is None else value for name, value in given.items()}
    for name, value in ranks.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1 (or None for fla's default), got {value}")
    return head_dim, ranks["decay_low_rank"], ranks["a_low_rank"], ranks["gate_low_rank"]


class LowRank(nn.Module):
    """up(activation(down(x))): RWKV-7's low-rank projections (fla's LoRA)."""

    def __init__(self, d_in: int, rank: int, d_out: int, activation: str, bias: bool):
        super().__init__()
        self.activation = activation
        self.down = Linear(d_in, rank, bias=False)
        self.up = Linear(rank, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(ACTIVATIONS[self.activation](self.down(x)))


class RWKV7(nn.Module):
    # layers whose outputs meet in the receptance-key products (the state read and the bonus): AWQ leaves their
    # weights unclipped (zoo/quantize.py)
    query_key_projections = ("r_proj", "k_proj")

    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        n_heads: int,
        head_dim: int | None = None,
        chunk_size: int = 16,
        norm_eps: float = 1e-5,
        decay_low_rank: int | None = None,
        a_low_rank: int | None = None,
        gate_low_rank: int | None = None,
    ):
        """head_dim: each head's key and value width (default d_model // n_heads). chunk_size: tokens per chunk of
        the chunked (prefill) form, which builds [C, C, dk] decay tensors: keep it small. norm_eps: the per-head
        GroupNorm's eps per channel (eps = head_dim * norm_eps, as fla). decay_low_rank, a_low_rank, gate_low_rank:
        widths of the low-rank projections for the decay w, the in-context learning rate a and the gate g (default:
        fla's, 32 for d_model up to ~250 at head_dim 64)."""
        super().__init__()
        head_dim, decay_rank, a_rank, gate_rank = checked_sizes(d_model, n_heads, head_dim, decay_low_rank,
                                                                a_low_rank, gate_low_rank)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0 (it keeps the per-head GroupNorm finite), got {norm_eps}")
        self.layer_idx, self.n_heads, self.head_dim, self.d_model = layer_idx, n_heads, head_dim, d_model
        self.chunk_size, self.norm_eps = chunk_size, head_dim * norm_eps
        width = n_heads * head_dim
        self.token_mix = nn.Parameter(torch.empty(len(MIXES), d_model))  # mu_r, mu_w, mu_k, mu_v, mu_a, mu_g
        self.k_k = nn.Parameter(torch.empty(width))  # scales k into the removal key kk
        self.k_a = nn.Parameter(torch.empty(width))  # how far a scales the written key
        self.r_k = nn.Parameter(torch.empty(n_heads, head_dim))  # the bonus term's weights
        self.r_proj = Linear(d_model, width, bias=False)
        self.k_proj = Linear(d_model, width, bias=False)
        self.v_proj = Linear(d_model, width, bias=False)
        self.w_lora = LowRank(d_model, decay_rank, width, "tanh", bias=True)
        self.a_lora = LowRank(d_model, a_rank, width, "none", bias=True)
        self.g_lora = LowRank(d_model, gate_rank, width, "sigmoid", bias=False)
        self.norm_weight = nn.Parameter(torch.empty(width))
        self.norm_bias = nn.Parameter(torch.empty(width))
        self.o_proj = Linear(width, d_model, bias=False)
        self.reset_rwkv_parameters()

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, n_heads: int, head_dim: int | None = None,
                     decay_low_rank: int | None = None, a_low_rank: int | None = None,
                     gate_low_rank: int | None = None, **_) -> int:
        """Bytes of the parameters __init__ makes, from its arguments alone (the rest size nothing)."""
        head_dim, decay_rank, a_rank, gate_rank = checked_sizes(d_model, n_heads, head_dim, decay_low_rank,
                                                                a_low_rank, gate_low_rank)
        width = n_heads * head_dim
        elements = (len(MIXES) * d_model  # token_mix
                    + 3 * width  # k_k, k_a, r_k
                    + 4 * d_model * width  # r, k, v and o projections
                    + decay_rank * (d_model + width) + width  # w_lora, with its bias
                    + a_rank * (d_model + width) + width  # a_lora, with its bias
                    + gate_rank * (d_model + width)  # g_lora, no bias
                    + 2 * width)  # the GroupNorm's weight and bias
        return elements * dtype.itemsize

    @torch.no_grad()
    def reset_rwkv_parameters(self) -> None:
        """fla's RWKV-7 init for a layer halfway down the model (its ratios layer/(L-1) and 1 - layer/L at 0.5):
        token mixes 1 - (n/d)^p, decay biases spread from slow (-5.5) to fast (+0.5) along the channels with a
        zigzag within each head, k_k ~0.71, k_a 1.02, r_k -0.04, GroupNorm weight 0.5^0.7. The low-rank biases are
        marked _no_reinit so the model's init (zoo/model.py), which zeroes Linear biases, keeps them."""
        d, width, head_dim = self.d_model, self.n_heads * self.head_dim, self.head_dim
        depth_in, depth_left = 0.5, 0.5  # fla's ratio_0_to_1 and ratio_1_to_almost0
        position = torch.arange(d, dtype=torch.float32) / d
        for row, power in enumerate((0.2, 0.9, 0.7, 0.7, 0.9, 0.2)):  # r, w, k, v, a, g
            self.token_mix[row].copy_(1 - position.pow(power * depth_left))
        channel = torch.arange(width, dtype=torch.float32)
        linear = channel / max(width - 1, 1) - 0.5
        half = max((head_dim - 1) / 2, 0.5)
        zigzag = ((channel % head_dim) - (head_dim - 1) / 2) / half
        zigzag = zigzag * zigzag.abs()
        slow_to_fast = -6 + 6 * (channel / max(width - 1, 1)).pow(1 + depth_in ** 0.3)
        self.w_lora.up.bias.copy_(slow_to_fast + 0.5 + 2.5 * zigzag)
        self.a_lora.up.bias.copy_(-0.19 + 0.3 * zigzag + 0.4 * linear)
        for bias in (self.w_lora.up.bias, self.a_lora.up.bias):
            bias._no_reinit = True
        self.k_k.copy_(0.71 - 0.1 * linear)
        self.k_a.fill_(1.02)
        self.r_k.fill_(-0.04)
        self.norm_weight.fill_(depth_left ** 0.7)
        self.norm_bias.zero_()

    def cache_spec(self) -> CacheSpec:
        # fp32 whatever the model's dtype: S is a running, decayed sum that 16-bit floats stop resolving
        return CacheSpec(kind="state", state_shapes=(("shift", (self.d_model,)),
                                                     ("wkv", (self.n_heads, self.head_dim, self.head_dim))),
                         state_dtype=torch.float32)

    def forward(self, x: torch.Tensor, positions=None, cache=None, batch: CacheBatch | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. Without a cache: the chunked form from a zero state. With one
        (StateSlots): continue this batch's states (zeros on prefill), one recurrent step for a single decode token,
        then write them back. Positions are unused: the state carries the order."""
        b, t, _ = x.shape
        states = cache.read(batch) if cache is not None else None
        previous = x.new_zeros(b, self.d_model) if states is None else states["shift"].to(x.dtype)
        r, log_w, k, v, kk, a, g = self.inputs(x, previous)
        if states is not None and batch.is_decode:
            wkv = states["wkv"]  # updated in place by the step
            o = rwkv7_step(*(z[:, :, 0] for z in (r, log_w, k, v, kk, a)), wkv).unsqueeze(2)
            shift = x[:, -1]
        elif states is not None and batch.checkpoints:  # the engine may keep any prefix: the state after each token
            wkv, outs, wkvs = states["wkv"], [], []
            for i in range(t):
                outs.append(rwkv7_step(*(z[:, :, i] for z in (r, log_w, k, v, kk, a)), wkv))
                wkvs.append(wkv.clone())  # the step updates it in place
            cache.write_steps({"shift": x, "wkv": torch.stack(wkvs, 1)}, batch)  # each token's shift is its input
            return self.output(torch.stack(outs, 2), r, k, v, g, x.dtype)
        else:
            shift = x[:, -1]
            if batch is not None and batch.padded:  # past a row's end: no decay, no removal, no write
                real = batch.real_tokens()[:, None, :, None]  # [B, 1, T, 1] against [B, H, T, dk]
                log_w, a, k_write = log_w * real, a * real, k * real
                shift = x[torch.arange(b, device=x.device), batch.last_tokens()]  # each row's last real input
            else:
                k_write = k
            o, wkv = rwkv7_chunked(r, log_w, k_write, v, kk, a, None if states is None else states["wkv"],
                                   chunk_size=self.chunk_size)
        if cache is not None:
            cache.write({"shift": shift, "wkv": wkv}, batch)
        return self.output(o, r, k, v, g, x.dtype)

    def inputs(self, x: torch.Tensor, previous: torch.Tensor):
        """x [B, T, d] and the input before it [B, d] -> r, log_w, k, v, kk, a [B, H, T, dk] (fp32; log_w <= 0,
        k already scaled by the learning rate) and the gate g [B, T, H * dv]."""
        shifted = torch.cat([previous[:, None], x[:, :-1]], dim=1)
        mixed = x[None] + (shifted - x)[None] * self.token_mix[:, None, None, :].to(x.dtype)
        xr, xw, xk, xv, xa, xg = mixed  # along the first axis, MIXES' order
        r, k, v = self.r_proj(xr).float(), self.k_proj(xk).float(), self.v_proj(xv).float()
        log_w = -DECAY_SCALE * torch.sigmoid(self.w_lora(xw).float())
        a = torch.sigmoid(self.a_lora(xa).float())
        g = self.g_lora(xg)
        kk = self.heads(k * self.k_k.float())
        kk = kk / kk.norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)  # F.normalize's form
        k = k * (1 + (a - 1) * self.k_a.float())
        r, log_w, k, v, a = (self.heads(z) for z in (r, log_w, k, v, a))
        return r, log_w, k, v, kk, a, g

    def heads(self, z: torch.Tensor) -> torch.Tensor:
        """[B, T, H * d] -> [B, H, T, d]."""
        return z.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)

    def output(self, o, r, k, v, g, dtype: torch.dtype) -> torch.Tensor:
        """o [B, H, T, dv] -> per-head GroupNorm, the bonus (r . (k * r_k)) v, the gate, o_proj -> [B, T, d_model]."""
        centred = o - o.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        weight, bias = (self.heads(p.float()[None, None]) for p in (self.norm_weight, self.norm_bias))  # [1, H, 1, dv]
        normed = normed * weight + bias
        bonus = (r * k * self.r_k.float()[:, None, :]).sum(-1, keepdim=True) * v
        y = (normed + bonus).transpose(1, 2).flatten(-2) * g.float()
        return self.o_proj(y.to(dtype))

    @torch.no_grad()
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer token by token in float64, in the paper's orientation (S [dv, dk], S_t = S_{t-1} (diag(w)
        - kk^T (a kk)) + v^T k, o = S r), written for clarity: the oracle for forward()."""
        f64 = torch.float64
        H, N = self.n_heads, self.head_dim

        def linear(module, z):
            out = z @ module.weight.to(f64).T
            return out if module.bias is None else out + module.bias.to(f64)

        def low_rank(lora, z):
            hidden = linear(lora.down, z)
            hidden = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "none": lambda h: h}[lora.activation](hidden)
            return linear(lora.up, hidden)

        mix = self.token_mix.to(f64)
        batch, length, _ = x.shape
        out = torch.zeros(batch, length, self.d_model, dtype=f64, device=x.device)
        for b in range(batch):
            S = torch.zeros(H, N, N, dtype=f64, device=x.device)  # [head, value, key]
            before = torch.zeros(self.d_model, dtype=f64, device=x.device)
            for t in range(length):
                now = x[b, t].to(f64)
                xr, xw, xk, xv, xa, xg = (now + (before - now) * mix[i] for i in range(len(MIXES)))
                before = now
                r = linear(self.r_proj, xr).view(H, N)
                w = torch.exp(-math.exp(-0.5) / (1 + torch.exp(-low_rank(self.w_lora, xw)))).view(H, N)
                k = linear(self.k_proj, xk)
                v = linear(self.v_proj, xv).view(H, N)
                a = 1 / (1 + torch.exp(-low_rank(self.a_lora, xa)))
                g = low_rank(self.g_lora, xg).view(H, N)
                kk = (k * self.k_k.to(f64)).view(H, N)
                kk = kk / kk.norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)
                k = (k * (1 + (a - 1) * self.k_a.to(f64))).view(H, N)
                a = a.view(H, N)
                y = torch.zeros(H, N, dtype=f64, device=x.device)
                for h in range(H):
                    # S (diag(w) - kk^T (a kk)): columns scaled by w, less the rank-one term
                    S[h] = S[h] * w[h] - torch.outer(S[h] @ kk[h], a[h] * kk[h]) + torch.outer(v[h], k[h])
                    o = S[h] @ r[h]
                    centred = o - o.mean()
                    normed = centred / torch.sqrt((centred * centred).mean() + self.norm_eps)
                    normed = (normed * self.norm_weight.to(f64).view(H, N)[h]
                              + self.norm_bias.to(f64).view(H, N)[h])
                    bonus = (r[h] * k[h] * self.r_k.to(f64)[h]).sum() * v[h]
                    y[h] = (normed + bonus) * g[h]
                out[b, t] = linear(self.o_proj, y.flatten())
        return out.to(x.dtype)
