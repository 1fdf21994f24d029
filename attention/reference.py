"""Naive float64 references of the attention mixers, written from the papers for clarity, not speed.

They are the oracle of tests/test_reference_oracle.py: each reads only the mixer's weights and hyperparameters and
computes everything else itself (RoPE, scale, masks, feature maps) in float64, with no call into the mixer's forward,
kernels/ or cache/. Inputs are [B, T, d_model] at positions 0 .. T-1 (an uncached forward); outputs are float64.

    attention_reference(mixer, x, kv_from=None)   softmax attention: MHA / GQA / MQA, window, sinks, chunk,
                                                  non-causal, cross-layer (kv_from = the source layer and its input),
                                                  q/k RMSNorm per head or over all heads (Qwen3, OLMoE)
    mla_reference(mixer, x)                       DeepSeek-V2 MLA, the uncached (non-absorbed) form
    linear_attention_reference(mixer, x)          Katharopoulos et al. linear attention, a loop over t
    evicting_attention_reference(mixer, x, P)     scored retention (H2O, TOVA): a P-token prefill, then a token a
                                                  step, keeping what kept_by_score says
"""
import math

import torch

F64 = torch.float64
SNAPKV_POOL = 7  # SnapKV's pooling kernel: a key's score is the largest vote within 3 positions of it


def weight(linear) -> torch.Tensor:
    return linear.weight.detach().to(F64)


def project(linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T (+ b), in float64."""
    y = x @ weight(linear).T
    if getattr(linear, "bias", None) is not None:
        y = y + linear.bias.detach().to(F64)
    return y


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * gain, over the last dim (Zhang & Sennrich 2019)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gain.detach().to(F64)


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, GPT-NeoX / HF Llama layout) at positions 0 .. T-1.

    x: [..., T, d]. Channel i < d/2 pairs with channel i + d/2 and both turn by angle t * base^(-2i/d):
        out_i       = x_i cos - x_{i+d/2} sin
        out_{i+d/2} = x_{i+d/2} cos + x_i sin
    """
    t, d = x.shape[-2], x.shape[-1]
    half = d // 2
    freq = torch.tensor([base ** (-2.0 * i / d) for i in range(half)], dtype=F64)
    angle = torch.arange(t, dtype=F64)[:, None] * freq[None, :]  # [T, d/2]
    cos, sin = torch.cos(angle), torch.sin(angle)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def visible(q: int, p: int, causal: bool = True, window: int | None = None, sinks: int = 0,
            chunk: int | None = None, dilation: int = 1) -> bool:
    """Whether the query at position q sees the key at position p (dilation r: q, q - r, ..., q - (window-1)·r)."""
    if not causal:
        return True
    if p > q:
        return False
    if chunk is not None:
        return p // chunk == q // chunk
    if window is not None:
        return p < sinks or ((q - p) % dilation == 0 and (q - p) // dilation < window)
    return True


def visibility_mask(t: int, causal: bool, window=None, sinks: int = 0, chunk=None, dilation: int = 1) -> torch.Tensor:
    """[T, T] bool: row q, column p."""
    return torch.tensor([[visible(q, p, causal, window, sinks, chunk, dilation) for p in range(t)] for q in range(t)])


def softmax_attention(q, k, v, mask, scale: float, kv_group: int) -> torch.Tensor:
    """q [B, Hq, T, d], k [B, Hkv, T, d], v [B, Hkv, T, dv], mask [T, T] -> [B, Hq, T, dv].

    Query head h reads KV head h // kv_group. Each row is softmax over its visible keys only; a row with no visible
    key would be an error (every causal query sees itself)."""
    b, n_heads, t, _ = q.shape
    out = torch.zeros(b, n_heads, t, v.shape[-1], dtype=F64)
    for h in range(n_heads):
        kh, vh = k[:, h // kv_group], v[:, h // kv_group]
        scores = scale * (q[:, h] @ kh.transpose(-1, -2))  # [B, T, T]
        scores = scores.masked_fill(~mask, -math.inf)
        scores = scores - scores.max(-1, keepdim=True).values
        weights = torch.exp(scores)
        weights = weights / weights.sum(-1, keepdim=True)
        out[:, h] = weights @ vh
    return out


def heads(y: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, n * d] -> [B, n, T, d]."""
    b, t, _ = y.shape
    return y.view(b, t, n, -1).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """[B, n, T, d] -> [B, T, n * d]."""
    b, n, t, d = y.shape
    return y.transpose(1, 2).reshape(b, t, n * d)


def qk_normed(mixer, norm: str, y: torch.Tensor, n: int) -> torch.Tensor:
    """Projected queries or keys [B, T, n * d] split into heads [B, n, T, d], RMS-normed first as mixer.qk_norm says:
    "head" over each head's d values with one gain of d, "all" over the n * d values of a token with a gain of n * d
    (its eps the norm module's, the model's norm_eps), None not at all."""
    qk_norm = getattr(mixer, "qk_norm", None)
    if qk_norm is None:
        return heads(y, n)
    gain, eps = getattr(mixer, norm).weight, getattr(mixer, norm).eps
    if qk_norm == "all":
        return heads(rms_norm(y, gain, eps), n)
    return rms_norm(heads(y, n), gain, eps)


def attention_reference(mixer, x: torch.Tensor, kv_from=None) -> torch.Tensor:
    """Softmax attention (Vaswani et al. 2017) with grouped KV heads (Ainslie et al. 2023) and RoPE, in float64.

    x: the layer's (normed) input [B, T, d_model]. kv_from = (source_mixer, source_x): a cross-layer attention
    layer (mixer.kv_source set) takes its keys and values from the source layer's projections of the source's input.
    Retention read from the mixer: window W (q - p < W), sinks S (p < S or in the window), chunk C (same C-block),
    dilation r (q - p a multiple of r, fewer than W strides back);
    mixer.causal False: every key visible."""
    x = x.detach().to(F64)
    n_heads, n_kv_heads, head_dim = mixer.n_heads, mixer.n_kv_heads, mixer.head_dim
    base = mixer.rope_base
    q = rope(qk_normed(mixer, "q_norm", project(mixer.q_proj, x), n_heads), base)
    if mixer.kv_source is not None:
        if kv_from is None:
            raise ValueError(f"layer {mixer.layer_idx} reads the keys of layer {mixer.kv_source}: pass "
                             f"kv_from=(source_mixer, source_input)")
        source, source_x = kv_from
        kv_mixer, kv_x = source, source_x.detach().to(F64)
    else:
        kv_mixer, kv_x = mixer, x
    k = rope(qk_normed(kv_mixer, "k_norm", project(kv_mixer.k_proj, kv_x), n_kv_heads), base)
    v = heads(project(kv_mixer.v_proj, kv_x), n_kv_heads)
    assert q.shape[-1] == k.shape[-1] == head_dim
    if mixer.retention.scored:  # uncached, a scored layer keeps everything (evicting_attention_reference: cached)
        mask = visibility_mask(x.shape[1], mixer.causal)
    else:
        mask = visibility_mask(x.shape[1], mixer.causal, mixer.window, mixer.sinks, mixer.chunk, mixer.dilation)
    out = softmax_attention(q, k, v, mask, head_dim**-0.5, n_heads // n_kv_heads)
    return project(mixer.o_proj, merge_heads(out))


def kept_by_score(retention, scores: list[float], positions: list[int], length: int) -> set[int]:
    """The positions a sequence of `length` tokens keeps of its held ones (with their scores) under scored
    retention: all while they fit sinks + window + budget; else the first `sinks` positions, the newest `window`,
    and the `budget`-many others with the highest scores, the newer first among equal ones."""
    capacity = retention.sinks + (retention.window or 0) + retention.budget
    if len(positions) <= capacity:
        return set(positions)
    safe = {p for p in positions if p < retention.sinks or p >= length - (retention.window or 0)}
    others = sorted(((s, p) for s, p in zip(scores, positions) if p not in safe), reverse=True)
    return safe | {p for _, p in others[:max(0, capacity - len(safe))]}


def evicting_attention_reference(mixer, x: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, list[list[set]]]:
    """A scored-retention layer (cache/eviction.py) fed x [B, T, d_model] as an engine feeds it: the first
    prompt_len tokens as one prefill, then one token a step, in float64 and plain Python over positions.

    The prefill's queries see the whole prompt (causal); its keys are scored by the prompt's queries (H2O: the
    attention each received from all of them, summed over heads; TOVA: the last query's; SnapKV: the votes of the
    last `window` queries, then each key the largest vote within SNAPKV_POOL // 2 positions of it) and the
    retention keeps its capacity of them. Each later query at t sees the kept set and itself; the scores then take
    its weights (H2O adds them, TOVA replaces them, SnapKV keeps the prompt's votes and gives a new key none) and
    the set keeps its capacity again (kept_by_score).
    Returns the output [B, T, d_model] and, per sequence, the kept set after the prefill and after each step."""
    retention = mixer.retention
    x = x.detach().to(F64)
    q = rope(qk_normed(mixer, "q_norm", project(mixer.q_proj, x), mixer.n_heads), mixer.rope_base)
    k = rope(qk_normed(mixer, "k_norm", project(mixer.k_proj, x), mixer.n_kv_heads), mixer.rope_base)
    v = heads(project(mixer.v_proj, x), mixer.n_kv_heads)
    group, scale = mixer.n_heads // mixer.n_kv_heads, mixer.head_dim**-0.5
    out = torch.zeros(q.shape[0], mixer.n_heads, x.shape[1], v.shape[-1], dtype=F64)
    kept_sets = []
    for b in range(x.shape[0]):

        def weights(t: int, keys: list[int]) -> torch.Tensor:  # [H, len(keys)] query t's softmax over those keys
            logits = torch.stack([q[b, h, t] @ k[b, h // group, keys].T for h in range(mixer.n_heads)]) * scale
            return torch.softmax(logits, dim=-1)

        def attend(t: int, keys: list[int]) -> torch.Tensor:
            w = weights(t, keys)
            return torch.stack([w[h] @ v[b, h // group, keys] for h in range(mixer.n_heads)])

        scores = dict.fromkeys(range(prompt_len), 0.0)
        voters = {"h2o": 0, "tova": prompt_len - 1, "snapkv": prompt_len - (retention.window or 0)}[retention.score]
        for t in range(prompt_len):
            out[b, :, t] = attend(t, list(range(t + 1)))
            if t >= voters:
                for p, w in zip(range(t + 1), weights(t, list(range(t + 1))).sum(dim=0).tolist()):
                    scores[p] += w
        if retention.score == "snapkv":  # each key takes the largest vote near it
            reach = SNAPKV_POOL // 2
            votes = dict(scores)
            scores = {p: max(votes[n] for n in range(max(0, p - reach), min(prompt_len, p + reach + 1)))
                      for p in votes}
        held = kept_by_score(retention, list(scores.values()), list(scores), prompt_len)
        steps = [held]
        for t in range(prompt_len, x.shape[1]):
            keys = sorted(held) + [t]
            out[b, :, t] = attend(t, keys)
            step_weights = weights(t, keys).sum(dim=0).tolist()
            if retention.score == "snapkv":
                scores = {p: scores.get(p, 0.0) for p in keys}
            else:
                scores = {p: (scores.get(p, 0.0) if retention.score == "h2o" else 0.0) + w
                          for p, w in zip(keys, step_weights)}
            held = kept_by_score(retention, [scores[p] for p in keys], keys, t + 1)
            scores = {p: scores[p] for p in held}
            steps.append(held)
        kept_sets.append(steps)
    return project(mixer.o_proj, merge_heads(out)), kept_sets


def mla_reference(mixer, x: torch.Tensor) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2, Sec. 2.1), the expanded form, in float64.

        q        = W_UQ RMSNorm(W_DQ x)  (or W_Q x without q_lora)      split per head into [q_nope ; q_rope]
        [c ; kr] = W_DKV x;   c = RMSNorm(c)                            latent c, one rope key kr shared by all heads
        [k_nope ; v] = W_UKV c                                          per head
        k = [k_nope ; RoPE(kr)],  q = [q_nope ; RoPE(q_rope)]
        out = softmax(q.k / sqrt(d_nope + d_rope)) v, causal (or not), then W_O
    """
    x = x.detach().to(F64)
    b, t, _ = x.shape
    n_heads, nope, rope_dim, v_dim, rank = (mixer.n_heads, mixer.nope_dim, mixer.rope_dim, mixer.v_head_dim,
                                            mixer.kv_lora_rank)
    base = mixer.rope_base
    if hasattr(mixer, "q_proj"):
        q = project(mixer.q_proj, x)
    else:
        qn = mixer.q_a_layernorm
        q = project(mixer.q_b_proj, rms_norm(project(mixer.q_a_proj, x), qn.weight, qn.eps))
    q = heads(q, n_heads)  # [B, H, T, nope + rope]
    q_nope, q_rope = q[..., :nope], rope(q[..., nope:], base)
    compressed = project(mixer.kv_a_proj_with_mqa, x)  # [B, T, rank + rope]
    kvn = mixer.kv_a_layernorm
    latent = rms_norm(compressed[..., :rank], kvn.weight, kvn.eps)
    k_rope = rope(compressed[..., rank:].unsqueeze(1), base)  # [B, 1, T, rope]
    kv = heads(project(mixer.kv_b_proj, latent), n_heads)  # [B, H, T, nope + v]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    assert v.shape[-1] == v_dim
    k = torch.cat([k_nope, k_rope.expand(b, n_heads, t, rope_dim)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    mask = visibility_mask(t, mixer.causal)
    out = softmax_attention(q, k, v, mask, (nope + rope_dim) ** -0.5, 1)
    return project(mixer.o_proj, merge_heads(out))


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1: x + 1 for x > 0, exp(x) otherwise (Katharopoulos et al. 2020)."""
    return torch.where(x > 0, x + 1, torch.exp(x))


def taylor(x: torch.Tensor) -> torch.Tensor:
    """Based's 2nd-order Taylor feature map, so that phi(q).phi(k) = 1 + u + u^2 / 2 with u = q.k / sqrt(f):
    phi(x) = [1, x / f^(1/4), (x_i x_j for all i, j) / sqrt(2 f)]."""
    f = x.shape[-1]
    outer = (x[..., :, None] * x[..., None, :]).reshape(*x.shape[:-1], f * f)
    return torch.cat([torch.ones(*x.shape[:-1], 1, dtype=x.dtype), x / f**0.25, outer / math.sqrt(2 * f)], dim=-1)


def linear_attention_reference(mixer, x: torch.Tensor) -> torch.Tensor:
    """Causal linear attention (Katharopoulos et al. 2020, eq. 4-5), run as its recurrence one token at a time:

        S_t = S_{t-1} + phi(k_t) v_t^T,   z_t = z_{t-1} + phi(k_t)
        out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)
    per head, from S_0 = 0, z_0 = 0; no RoPE, no scaling; then o_proj."""
    x = x.detach().to(F64)
    b, t, _ = x.shape
    phi = {"elu": elu_plus_one, "taylor": taylor}[mixer.feature_map]
    q = phi(heads(project(mixer.q_proj, x), mixer.n_heads))  # [B, H, T, dk]
    k = phi(heads(project(mixer.k_proj, x), mixer.n_heads))
    v = heads(project(mixer.v_proj, x), mixer.n_heads)  # [B, H, T, dv]
    dk, dv = q.shape[-1], v.shape[-1]
    state = torch.zeros(b, mixer.n_heads, dk, dv, dtype=F64)
    normalizer = torch.zeros(b, mixer.n_heads, dk, dtype=F64)
    out = torch.zeros(b, mixer.n_heads, t, dv, dtype=F64)
    for step in range(t):
        qt, kt, vt = q[:, :, step], k[:, :, step], v[:, :, step]
        state = state + kt[..., :, None] * vt[..., None, :]
        normalizer = normalizer + kt
        numerator = (qt[..., :, None] * state).sum(-2)  # [B, H, dv]
        denominator = (qt * normalizer).sum(-1, keepdim=True) + mixer.eps
        out[:, :, step] = numerator / denominator
    return project(mixer.o_proj, merge_heads(out))
