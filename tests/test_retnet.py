"""RetNet's multi-scale retention mixer: the fast forward equals the float64 step-by-step reference() and the paper's
parallel form; the state is n_heads * dk * dv fp32 elements; bad settings are refused by name, before pricing too.
The cache contract every state mixer owes (cached = uncached, batch rows, padding, checkpoints, gradients) is
tests/test_state_mixers.py."""
import pytest
import torch

from cache.state_slots import StateSlots
from ssm.retnet import MultiScaleRetention, log_decays
from helpers import spread_weights  # tests/ is on sys.path under pytest

ATOL = 1e-5  # outputs are O(1); fp32 against float64


def make_mixer(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"d_model": 32, "layer_idx": 0, "n_heads": 4, "chunk_size": 8, **kwargs}
    return spread_weights(MultiScaleRetention(**kwargs), seed=seed, gain=1.0)


def max_err(got, want) -> float:
    return (got - want).abs().max().item()


def test_decays_are_the_papers():
    """gamma_h = 1 - 2^(-5-h) (Sun et al. 2023, section 2.2): 31/32, 63/64, ..."""
    want = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(8)], dtype=torch.float64)
    torch.testing.assert_close(log_decays(8, dtype=torch.float64).exp(), want, atol=0, rtol=1e-15)


# (settings, length): several chunks with a short last one, value head = key head, a narrow head, one token
REFERENCE_CASES = [({}, 21), ({"expand_v": 1}, 21), ({"head_dim": 6, "expand_v": 3}, 9), ({}, 1)]


@pytest.mark.parametrize("settings,length", REFERENCE_CASES, ids=["base", "expand_v1", "dk6-ev3", "one-token"])
def test_forward_equals_float64_reference(settings, length):
    mixer = make_mixer(**settings)
    x = torch.randn(2, length, 32)
    with torch.no_grad():
        got = mixer(x)
    want = mixer.reference(x)
    assert want.dtype == x.dtype and got.shape == want.shape == x.shape
    assert max_err(got, want) <= ATOL, f"forward differs from the float64 reference by {max_err(got, want):.3g}"


def test_forward_equals_the_papers_parallel_form():
    """Retention(X) = (Q K^T / sqrt(dk) * D) V with D[n, m] = gamma^(n - m) for n >= m, else 0 (the paper's
    equation 5, q and k rotated by their positions), then the gated RMSNorm and o_proj: an independent formula."""
    mixer = make_mixer(head_dim=8)
    x = torch.randn(2, 13, 32).double()
    H, dk = mixer.n_heads, mixer.head_dim
    positions = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        mixer64 = mixer.double()
        q, k, v = mixer64.heads(x, positions)  # projections and RoPE, [B, H, T, d]
        n = torch.arange(13, dtype=torch.float64)
        gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(H)], dtype=torch.float64)
        D = (gamma[:, None, None] ** (n[:, None] - n[None, :]).clamp_min(0)) * (n[:, None] >= n[None, :])
        o = ((q @ k.transpose(-1, -2)) / dk ** 0.5 * D) @ v
        want = mixer64.output(o, mixer64.g_proj(x), torch.float64)
        got = mixer64(x)
    assert max_err(got, want) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_is_heads_times_dk_dv(dtype):
    mixer = MultiScaleRetention(d_model=32, layer_idx=0, n_heads=4, head_dim=6, expand_v=2)
    spec = mixer.cache_spec()
    elements = 4 * 6 * 12
    assert spec.kind == "state" and spec.state_dtype == torch.float32
    assert dict(spec.state_shapes) == {"retention": (4, 6, 12)}
    assert spec.state_elements == elements and spec.elements(1) == spec.elements(5000) == elements
    assert StateSlots(spec, max_batch=3, dtype=dtype, device="cpu").nbytes == 3 * elements * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_bytes_equals_the_built_module(dtype):
    """Parameters in the model's dtype; RoPE's frequencies an fp32 buffer as __init__ makes it."""
    settings = {"d_model": 32, "n_heads": 4, "head_dim": 6, "expand_v": 3, "chunk_size": 8, "norm_eps": 1e-6,
                "rope_base": 10000.0}
    mixer = MultiScaleRetention(layer_idx=0, **settings)
    parameters = sum(p.numel() for p in mixer.parameters()) * dtype.itemsize
    buffers = sum(b.nbytes for b in mixer.buffers())
    assert buffers == 3 * 4  # dk / 2 frequencies
    assert MultiScaleRetention.module_bytes(dtype, **settings) == parameters + buffers


BAD_SETTINGS = [
    ({"n_heads": 0}, "n_heads must be >= 1, got 0"),
    ({"d_model": 30}, "d_model=30 is not divisible by n_heads=4"),
    ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
    ({"head_dim": 7}, "head_dim must be even .*, got 7"),
    ({"expand_v": 0}, "expand_v must be >= 1, got 0"),
    ({"chunk_size": -3}, "chunk_size must be >= 1, got -3"),
    ({"norm_eps": 0.0}, "norm_eps must be > 0 .*, got 0.0"),
    ({"rope_base": -1.0}, "rope_base must be > 0 .*, got -1.0"),
]


@pytest.mark.parametrize("bad,message", BAD_SETTINGS, ids=[next(iter(b)) for b, _ in BAD_SETTINGS])
def test_bad_settings_raise(bad, message):
    settings = {"d_model": 32, "n_heads": 4, "head_dim": None, "expand_v": 2, "chunk_size": 64, "norm_eps": 1e-6,
                "rope_base": 10000.0, **bad}
    with pytest.raises(ValueError, match=message):
        MultiScaleRetention(layer_idx=0, **settings)
    with pytest.raises(ValueError, match=message):  # refused by name before it is priced
        MultiScaleRetention.module_bytes(torch.float32, **settings)
    MultiScaleRetention(d_model=30, layer_idx=0, n_heads=4, head_dim=8)  # an explicit head_dim need not divide d_model
