"""Gated DeltaNet mixer: the fast forward equals the float64 step-by-step reference(); the cached mixer (StateSlots:
prefill, multi-token continuations, decode steps) equals the uncached one; batch rows are independent; gradients flow
through the chunked form; the state is n_heads * dk * dv + conv_dim * (d_conv - 1) fp32 elements."""
import pytest
import torch

from cache.state_slots import StateSlots
from kernels import FORCE_TRITON_ENV, triton_available
from ssm.gated_deltanet import GatedDeltaNet
from batches import run_cached  # tests/ is on sys.path under pytest
from helpers import spread_weights  # tests/ is on sys.path under pytest

ATOL = 1e-4  # outputs are O(1)


def make_mixer(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"d_model": 32, "layer_idx": 0, "n_heads": 4, "chunk_size": 8, **kwargs}
    return spread_weights(GatedDeltaNet(**kwargs), seed=seed, gain=1.0)


def max_err(got, want) -> float:
    return (got - want).abs().max().item()


def new_cache(mixer, max_batch):
    return StateSlots(mixer.cache_spec(), max_batch=max_batch, dtype=torch.float32, device="cpu")


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


@pytest.mark.parametrize("forced", ["0", "1"], ids=["reference-step", "triton-step"])
@pytest.mark.parametrize("d_conv", [1, 4])
def test_cached_prefill_then_decode_equals_uncached(monkeypatch, d_conv, forced):
    if forced == "1" and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, forced)  # "1": decode steps run the Triton kernel (interpreter on CPU)
    mixer = make_mixer(d_conv=d_conv)
    x = torch.randn(2, 30, 32)
    with torch.no_grad():
        full = mixer(x)
        # prefill 13 (two chunks, the second short), single tokens, a 7-token continuation, single tokens
        cached = run_cached(mixer, new_cache(mixer, 2), x, [13, 1, 1, 1, 7] + [1] * 7)
    assert max_err(cached, full) <= ATOL, f"cached differs from uncached by {max_err(cached, full):.3g}"


def test_prefill_in_two_calls_equals_one():
    """The second call continues the chunked form from the first's states (conv history and S), chunk boundaries
    misaligned with the split; outputs and the states left in the cache agree."""
    mixer = make_mixer()
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        one_cache, two_cache = new_cache(mixer, 2), new_cache(mixer, 2)
        one = run_cached(mixer, one_cache, x, [21])
        two = run_cached(mixer, two_cache, x, [11, 10])
    assert max_err(two, one) <= ATOL
    for name in ("conv", "ssm"):
        assert max_err(two_cache.tensors[name], one_cache.tensors[name]) <= ATOL, f"{name} state differs"


def test_prefill_overwrites_a_finished_sequences_state():
    """A slot's previous owner leaves its state behind; a prefill must start from zeros regardless."""
    mixer = make_mixer()
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        cache = new_cache(mixer, 1)
        run_cached(mixer, cache, torch.randn(1, 6, 32), [6])
        cached = run_cached(mixer, cache, x, [5] + [1] * 7)
        full = mixer(x)
    assert max_err(cached, full) <= ATOL


def test_batch_rows_are_independent():
    """Three sequences of equal length prefilled together in non-consecutive slots of a larger pool, then decoded
    together, equal each run alone."""
    mixer = make_mixer()
    x = torch.randn(3, 16, 32)
    with torch.no_grad():
        cache = new_cache(mixer, 5)
        batched = run_cached(mixer, cache, x, [10, 1, 1, 3, 1], slots=[4, 0, 2])
        for row in range(3):
            alone = run_cached(mixer, new_cache(mixer, 1), x[row : row + 1], [10] + [1] * 6)
            assert max_err(batched[row : row + 1], alone) <= ATOL, f"row {row} depends on its batch"
    assert all(t[[1, 3]].abs().max() == 0 for t in cache.tensors.values()), "unused slots were written"


def test_gradients_flow_through_the_chunked_form():
    mixer = make_mixer().train()
    x = torch.randn(2, 19, 32, requires_grad=True)
    mixer(x).square().sum().backward()
    for name, param in [("x", x), *mixer.named_parameters()]:
        assert param.grad is not None and torch.isfinite(param.grad).all(), f"{name}: no finite gradient"
        assert param.grad.abs().max() > 0, f"{name}: zero gradient"


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


def test_bf16_model_runs_and_caches():
    mixer = make_mixer().to(torch.bfloat16)
    x = torch.randn(1, 12, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        full = mixer(x)
        cached = run_cached(mixer, new_cache(mixer, 1), x, [9, 1, 1, 1])
    assert full.dtype == cached.dtype == torch.bfloat16
    assert max_err(cached.float(), full.float()) <= 0.05  # bf16 projections; the states stay fp32


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
