"""Gated DeltaNet with negative eigenvalues (Grazzi et al. 2024, "Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues"): eigenvalues="signed" takes beta = 2 sigmoid(b) in (0, 2), so the state transition
alpha (I - beta k k^T) has the eigenvalue alpha (1 - beta) < 0 whenever beta > 1.

The signed mixer's chunked prefill and its decode steps equal a float64 token-by-token recurrence written here; its
transitions have negative eigenvalues where the default's have none; the default still hands the kernels exactly
sigmoid(b); the kernels agree with transformers' Qwen3-Next reference for beta in (0, 2); the registry's "gdn-neg" is
gdn's layers and state with the signed range fixed."""
import inspect
import math

import pytest
import torch

import ssm.gated_deltanet as gated_deltanet
import zoo
from cache.state_slots import StateSlots
from kernels import FORCE_TRITON_ENV, triton_available
from kernels.gated_delta import gated_delta_chunked, gated_delta_step_ref, gated_delta_step_triton
from ssm.gated_deltanet import L2_EPS, GatedDeltaNet, l2_normalize
from ssm.reference import causal_depthwise_conv, f64, project, silu, softplus
from batches import run_cached  # tests/ is on sys.path under pytest
from helpers import spread_weights  # tests/ is on sys.path under pytest

ATOL = 1e-4  # outputs are O(1)


def make_mixer(eigenvalues="signed", seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"d_model": 32, "layer_idx": 0, "n_heads": 4, "chunk_size": 8, "eigenvalues": eigenvalues, **kwargs}
    return spread_weights(GatedDeltaNet(**kwargs), seed=seed, gain=1.0)


def max_err(got, want) -> float:
    return (got.double() - want).abs().max().item()


def beta_logits(mixer, x):
    """b_t [B, T, H]: in_proj's outputs after q, k, v and the output gate."""
    start = mixer.conv_dim + mixer.n_heads * mixer.value_dim
    return mixer.in_proj(x)[..., start:start + mixer.n_heads]


@torch.no_grad()
def naive_signed_layer(mixer, x):
    """The whole layer in float64, one token at a time, with beta = 2 sigmoid(b) written here (not read from the
    mixer): S = alpha S + beta k (v - alpha S^T k)^T, o = S^T q, then the gated RMSNorm and out_proj."""
    H, dk, dv = mixer.n_heads, mixer.head_dim, mixer.value_dim
    qkv, gate, b, a = project(mixer.in_proj, f64(x)).split([mixer.conv_dim, H * dv, H, H], dim=-1)
    q, k, v = silu(causal_depthwise_conv(qkv, mixer.conv1d)).split([H * dk, H * dk, H * dv], dim=-1)
    q, k, v = q.unflatten(-1, (H, dk)), k.unflatten(-1, (H, dk)), v.unflatten(-1, (H, dv))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS) / math.sqrt(dk)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    alpha = torch.exp(-torch.exp(f64(mixer.A_log)) * softplus(a + f64(mixer.dt_bias)))  # [B, T, H]
    beta = 2 * torch.sigmoid(b)
    S = torch.zeros(x.shape[0], H, dk, dv, dtype=torch.float64)
    outs = []
    for t in range(x.shape[1]):
        S = alpha[:, t, :, None, None] * S
        recalled = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * (v[:, t] - recalled)[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1)  # [B, T, H, dv]
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + mixer.norm.eps) * f64(mixer.norm.weight)
    return project(mixer.out_proj, (o * silu(gate.unflatten(-1, (H, dv)))).flatten(-2))


# ---- (a) the signed mixer against the naive recurrence --------------------------------------------------------------

@pytest.mark.parametrize("settings,length", [({}, 21), ({"expand_v": 2, "d_conv": 2}, 17), ({}, 1)],
                         ids=["base", "expand_v2-d_conv2", "one-token"])
def test_signed_chunked_prefill_equals_naive_recurrence(settings, length):
    mixer = make_mixer(**settings)
    x = torch.randn(2, length, 32)
    with torch.no_grad():
        got = mixer(x)
    want = naive_signed_layer(mixer, x)
    assert max_err(got, want) <= ATOL, f"chunked prefill differs from the naive recurrence by {max_err(got, want):.3g}"
    assert max_err(mixer.reference(x), want) <= 1e-6, "the mixer's own float64 reference ignores the signed range"


@pytest.mark.parametrize("forced", ["0", "1"], ids=["reference-step", "triton-step"])
def test_signed_decode_steps_equal_naive_recurrence(monkeypatch, forced):
    if forced == "1" and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, forced)  # "1": decode steps run the Triton kernel (interpreter on CPU)
    mixer = make_mixer()
    x = torch.randn(2, 20, 32)
    cache = StateSlots(mixer.cache_spec(), max_batch=2, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        got = run_cached(mixer, cache, x, [3] + [1] * 17)  # a short prefill, then one recurrent step a token
    want = naive_signed_layer(mixer, x)
    assert max_err(got, want) <= ATOL, f"decode steps differ from the naive recurrence by {max_err(got, want):.3g}"


# ---- (b) negative eigenvalues, and (c) the default hands the kernels exactly sigmoid(b) -----------------------------

def kernel_arguments(monkeypatch, mixer, x):
    """(k, g, beta) as the chunked kernel receives them from an uncached forward: [B, H, T, dk], [B, H, T] twice."""
    seen = []

    def spy(q, k, v, g, beta, *args, **kwargs):
        seen.append((k, g, beta))
        return gated_delta_chunked(q, k, v, g, beta, *args, **kwargs)

    monkeypatch.setattr(gated_deltanet, "gated_delta_chunked", spy)
    with torch.no_grad():
        mixer(x)
    (arguments,) = seen
    return arguments


def transition_eigenvalues(k, g, beta):
    """Eigenvalues of alpha (I - beta k k^T) per (batch, head, token), ascending: [B, H, T, dk]."""
    k, alpha, beta = k.double(), g.double().exp(), beta.double()
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    transitions = alpha[..., None, None] * (eye - beta[..., None, None] * k[..., :, None] * k[..., None, :])
    return torch.linalg.eigvalsh(transitions)


def test_signed_transitions_have_negative_eigenvalues(monkeypatch):
    signed = make_mixer("signed")
    positive = make_mixer("positive")
    positive.load_state_dict(signed.state_dict())
    x = torch.randn(2, 21, 32)
    k, g, beta = kernel_arguments(monkeypatch, signed, x)
    assert 1 < beta.max() < 2 and 0 < beta.min(), "the inputs should give some token a write strength above 1"
    lowest = transition_eigenvalues(k, g, beta)[..., 0]
    # the eigenvalue along k is alpha (1 - beta |k|^2): negative exactly where beta |k|^2 > 1
    along_k = g.double().exp() * (1 - beta.double() * k.double().pow(2).sum(-1))
    torch.testing.assert_close(lowest, torch.minimum(along_k, g.double().exp()))
    assert (lowest < 0).any() and ((lowest < 0) == (along_k < 0)).all()
    assert lowest.min() > -1, "a transition's eigenvalues stay within (-1, 1]"
    k, g, beta = kernel_arguments(monkeypatch, positive, x)
    assert (transition_eigenvalues(k, g, beta) > 0).all(), "the default's transitions have only positive eigenvalues"


@pytest.mark.parametrize("eigenvalues,scale", [("positive", 1), ("signed", 2)])
def test_kernels_receive_exactly_the_scaled_sigmoid(monkeypatch, eigenvalues, scale):
    """The default passes torch.sigmoid(b) itself, bit for bit (as before the option existed), to the chunked form
    and to the decode step; the signed range passes exactly twice that."""
    mixer = make_mixer(eigenvalues)
    x = torch.randn(2, 9, 32)
    seen = []

    def chunked_spy(q, k, v, g, beta, *args, **kwargs):
        seen.append(beta.transpose(1, 2))  # [B, H, T] -> [B, T, H]
        return gated_delta_chunked(q, k, v, g, beta, *args, **kwargs)

    def step_spy(q, k, v, g, beta, state):
        seen.append(beta[:, None])  # [B, H] -> [B, 1, H]
        return gated_delta_step_ref(q, k, v, g, beta, state)

    monkeypatch.setattr(gated_deltanet, "gated_delta_chunked", chunked_spy)
    monkeypatch.setattr(gated_deltanet, "gated_delta_step", step_spy)
    cache = StateSlots(mixer.cache_spec(), max_batch=2, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        run_cached(mixer, cache, x, [5, 1, 1, 1, 1])
        # projected call by call, as the mixer does: one matmul over all 9 tokens may round differently
        want = [scale * torch.sigmoid(beta_logits(mixer, x[:, start:end])) for start, end in
                [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)]]
    assert len(seen) == 5 and all(torch.equal(got, wanted) for got, wanted in zip(seen, want))


def test_default_is_positive_and_gdn_configs_are_unchanged():
    default = GatedDeltaNet(d_model=32, layer_idx=0, n_heads=4, chunk_size=8)
    assert default.eigenvalues == "positive"
    assert {name for name, _ in default.named_parameters()} == {
        "in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"}
    # gdn's layer specs gain no parameter, so saved configs read the same
    assert all(spec.params == {"n_heads": 4} for spec in zoo.make_config("gdn", preset="tiny").layers)
    explicit = make_mixer("positive")
    default.load_state_dict(explicit.state_dict())
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        assert torch.equal(default(x), explicit(x))


# ---- (d) bad values ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["negative", "Signed", "", None, True])
def test_bad_eigenvalues_raise(bad):
    with pytest.raises(ValueError, match=r"unknown eigenvalues .*; allowed: positive, signed"):
        GatedDeltaNet(d_model=32, layer_idx=0, n_heads=4, eigenvalues=bad)


@pytest.mark.parametrize("bad", ["negative", "Signed", "", True])  # None is the registry's "the mixer's default"
def test_bad_eigenvalues_setting_raises(bad):
    with pytest.raises(ValueError, match=r"unknown eigenvalues .*; allowed: positive, signed"):
        zoo.build("gdn", preset="tiny", eigenvalues=bad)


# ---- the kernels for beta in (0, 2) --------------------------------------------------------------------------------

def signed_inputs(batch, heads, length, dim_k, dim_v, seed=0):
    """q, k (L2-normalised), v [B, H, T, d]; log decays g in [-1, 0]; beta = 2 sigmoid(3 z), often near 0 or 2."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2_normalize(torch.randn(batch, heads, length, dim_k, generator=gen)) for _ in range(2))
    v = torch.randn(batch, heads, length, dim_v, generator=gen)
    g = -torch.rand(batch, heads, length, generator=gen)
    beta = 2 * torch.sigmoid(3 * torch.randn(batch, heads, length, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("shape", [(2, 2, 45, 16, 8, 16), (1, 2, 100, 32, 24, 64)], ids=lambda s: "x".join(map(str, s)))
def test_kernels_equal_transformers_for_signed_betas(shape):
    """Our chunked form (WY/UT solve), the PyTorch and Triton steps, and transformers' Qwen3-Next chunked and
    recurrent functions (written independently) agree from a random state when beta spans (0, 2)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                    torch_recurrent_gated_delta_rule)
    batch, heads, length, dim_k, dim_v, chunk = shape
    q, k, v, g, beta = signed_inputs(batch, heads, length, dim_k, dim_v)
    assert beta.max() > 1.9
    initial = torch.randn(batch, heads, dim_k, dim_v, generator=torch.Generator().manual_seed(1))
    out, state = gated_delta_chunked(q, k, v, g, beta, initial, chunk_size=chunk)
    steppers = [gated_delta_step_ref] + ([gated_delta_step_triton] if triton_available() else [])
    for step in steppers:
        step_state = initial.clone()
        step_out = torch.stack([step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], step_state)
                                for t in range(length)], dim=2)
        torch.testing.assert_close(step_out, out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step_state, state, atol=1e-4, rtol=1e-4)
    hf = [t.transpose(1, 2) for t in (q, k, v, g, beta)]  # transformers' [B, T, H, ...]
    # the PyTorch bodies: transformers' decorators would route to flash-linear-attention's kernels where installed
    for reference, kwargs in [(torch_chunk_gated_delta_rule, {"chunk_size": chunk}),
                              (torch_recurrent_gated_delta_rule, {})]:
        hf_out, hf_state = inspect.unwrap(reference)(*hf, initial_state=initial, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=False, **kwargs)
        torch.testing.assert_close(hf_out.transpose(1, 2), out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hf_state, state, atol=1e-4, rtol=1e-4)


def test_signed_betas_let_the_state_track_parity():
    """With one fixed key, no decay and no value, each write multiplies k^T S by 1 - beta: about -0.9 with signed
    betas for bit 1 (b = 3) and about 0.9 for bit 0 (b = -3), so the read's sign is the bits' parity. With beta in
    (0, 1) the factor is positive and the sign never flips."""
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 1])
    length, f64 = len(bits), torch.float64  # fp64: the positive range's read shrinks to ~1e-11
    k = torch.zeros(1, 1, length, 4, dtype=f64)
    k[..., 0] = 1
    v, g = torch.zeros(1, 1, length, 1, dtype=f64), torch.zeros(1, 1, length, dtype=f64)
    logit = (6 * bits - 3).to(f64)[None, None]
    initial = torch.zeros(1, 1, 4, 1, dtype=f64)
    initial[0, 0, 0, 0] = 1
    parity = torch.where(bits.cumsum(0) % 2 == 1, -1.0, 1.0).to(f64)
    signed, _ = gated_delta_chunked(k, k, v, g, 2 * torch.sigmoid(logit), initial, chunk_size=4, scale=1.0)
    assert torch.equal(signed[0, 0, :, 0].sign(), parity)
    positive, _ = gated_delta_chunked(k, k, v, g, torch.sigmoid(logit), initial, chunk_size=4, scale=1.0)
    assert (positive > 0).all()


# ---- the registry --------------------------------------------------------------------------------------------------

def test_gdn_neg_is_gdn_with_the_signed_range():
    neg, gdn = zoo.build("gdn-neg", preset="tiny"), zoo.build("gdn", preset="tiny")
    assert [block.mixer.eigenvalues for block in neg.blocks] == ["signed"] * len(gdn.blocks)
    assert [block.mixer.eigenvalues for block in gdn.blocks] == ["positive"] * len(gdn.blocks)
    assert [b.mixer.cache_spec() for b in neg.blocks] == [b.mixer.cache_spec() for b in gdn.blocks]
    assert {n: p.shape for n, p in neg.named_parameters()} == {n: p.shape for n, p in gdn.named_parameters()}
    assert "Grazzi" in zoo.describe("gdn-neg")
    assert "gdn-neg" not in zoo.registry.compare_defaults() + zoo.registry.recall_defaults()
    # gdn takes the range as a setting; gdn-neg fixes it
    assert zoo.build("gdn", preset="tiny", eigenvalues="signed").blocks[0].mixer.eigenvalues == "signed"
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['eigenvalues'\] for 'gdn-neg'"):
        zoo.build("gdn-neg", preset="tiny", eigenvalues="positive")
    hybrid = zoo.build("hybrid", preset="tiny", layers="gdn-neg,gdn", n_layers=2)
    assert [block.mixer.eigenvalues for block in hybrid.blocks] == ["signed", "positive"]
