"""Gated DeltaNet mixer: the fast forward equals the float64 step-by-step reference(); the state is
n_heads * dk * dv + conv_dim * (d_conv - 1) fp32 elements. The cache contract every state mixer owes (cached =
uncached, batch rows, padding, checkpoints, gradients) is tests/test_state_mixers.py."""
import pytest
import torch

from cache.state_slots import StateSlots
from ssm.gated_deltanet import GatedDeltaNet
from helpers import spread_weights  # tests/ is on sys.path under pytest

ATOL = 1e-4  # outputs are O(1)


def make_mixer(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"d_model": 32, "layer_idx": 0, "n_heads": 4, "chunk_size": 8, **kwargs}
    return spread_weights(GatedDeltaNet(**kwargs), seed=seed, gain=1.0)


def max_err(got, want) -> float:
    return (got - want).abs().max().item()


# (settings, length): several chunks with a short last one, a wider value head, no conv history, one token
REFERENCE_CASES = [({}, 21), ({"expand_v": 2}, 21), ({"d_conv": 1, "head_dim": 6}, 9), ({}, 1)]


@pytest.mark.parametrize("settings,length", REFERENCE_CASES, ids=["base", "expand_v2", "d_conv1-dk6", "one-token"])
def test_forward_equals_float64_reference(settings, length):
    mixer = make_mixer(**settings)
    x = torch.randn(2, length, 32)
    with torch.no_grad():
        got = mixer(x)
    want = mixer.reference(x)
    assert want.dtype == x.dtype and got.shape == want.shape == x.shape
    assert max_err(got, want) <= ATOL, f"forward differs from the float64 reference by {max_err(got, want):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_is_heads_times_dk_dv_plus_conv_history(dtype):
    mixer = GatedDeltaNet(d_model=32, layer_idx=0, n_heads=4, head_dim=6, expand_v=2, d_conv=3)
    spec = mixer.cache_spec()
    conv_dim = 4 * (6 + 6 + 12)
    elements = 4 * 6 * 12 + conv_dim * 2
    assert spec.kind == "state" and spec.state_dtype == torch.float32
    assert dict(spec.state_shapes) == {"conv": (conv_dim, 2), "ssm": (4, 6, 12)}
    assert spec.state_elements == elements and spec.elements(1) == spec.elements(5000) == elements
    assert StateSlots(spec, max_batch=3, dtype=dtype, device="cpu").nbytes == 3 * elements * 4


BAD_SETTINGS = [
    ({"n_heads": 0}, "n_heads must be >= 1, got 0"),
    ({"d_model": 30}, "d_model=30 is not divisible by n_heads=4"),
    ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
    ({"expand_v": 0}, "expand_v must be >= 1, got 0"),
    ({"d_conv": 0}, "d_conv must be >= 1, got 0"),
    ({"chunk_size": -3}, "chunk_size must be >= 1, got -3"),
    ({"norm_eps": 0.0}, "norm_eps must be > 0 .*, got 0.0"),
]


@pytest.mark.parametrize("bad,message", BAD_SETTINGS, ids=[next(iter(b)) for b, _ in BAD_SETTINGS])
def test_bad_settings_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        GatedDeltaNet(**{"d_model": 32, "layer_idx": 0, "n_heads": 4, **bad})
    GatedDeltaNet(d_model=30, layer_idx=0, n_heads=4, head_dim=8)  # an explicit head_dim need not divide d_model
