"""RWKV-7 mixer: the fast forward equals the float64 token-by-token reference() (written in the paper's [dv, dk]
orientation); the shift state holds the last input; the state is d_model + n_heads * dk * dv fp32 elements; bad
settings are refused by name. The cache contract every state mixer owes (cached = uncached, batch rows, padding,
checkpoints, gradients) is tests/test_state_mixers.py."""
import pytest
import torch

from cache.state_slots import StateSlots
from ssm.rwkv7 import RWKV7
from batches import run_cached  # tests/ is on sys.path under pytest
from helpers import spread_weights  # tests/ is on sys.path under pytest

REFERENCE_ATOL = 1e-5  # fp32 forward against the float64 oracle; outputs are O(1)
ATOL = 1e-4  # cached against uncached: different summation orders in fp32


def make_mixer(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"d_model": 32, "layer_idx": 0, "n_heads": 4, "chunk_size": 8, **kwargs}
    return spread_weights(RWKV7(**kwargs), seed=seed, gain=1.0)


def max_err(got, want) -> float:
    return (got - want).abs().max().item()


def new_cache(mixer, max_batch):
    return StateSlots(mixer.cache_spec(), max_batch=max_batch, dtype=torch.float32, device="cpu")


# (settings, length): several chunks with a short last one, an explicit head width, narrow low ranks, one token
REFERENCE_CASES = [({}, 21), ({"head_dim": 6}, 13), ({"decay_low_rank": 4, "a_low_rank": 3, "gate_low_rank": 5}, 17),
                   ({}, 1)]


@pytest.mark.parametrize("settings,length", REFERENCE_CASES, ids=["base", "dk6", "low-ranks", "one-token"])
def test_forward_equals_float64_reference(settings, length):
    mixer = make_mixer(**settings)
    x = torch.randn(2, length, 32)
    with torch.no_grad():
        got = mixer(x)
    want = mixer.reference(x)
    assert want.dtype == x.dtype and got.shape == want.shape == x.shape
    err = max_err(got, want)
    assert err <= REFERENCE_ATOL, f"forward differs from the float64 reference by {err:.3g}"


def test_reference_is_sensitive_to_the_state():
    """The oracle must see the recurrence: with strong decays and learning rates the outputs depend on tokens long
    past (a reference that dropped S, or the token shift, would still match a forward wrong the same way)."""
    mixer = make_mixer()
    x = torch.randn(1, 12, 32)
    changed = x.clone()
    changed[0, 0] += 1.0
    assert max_err(mixer.reference(changed)[:, 5:], mixer.reference(x)[:, 5:]) > 1e-3


def test_the_shift_state_is_the_last_tokens_input():
    """Token shift reads x_{t-1}: after a prefill the cache holds the last token's input, which a decode step reads."""
    mixer = make_mixer()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        cache = new_cache(mixer, 2)
        run_cached(mixer, cache, x, [9])
    assert torch.equal(cache.tensors["shift"], x[:, -1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_is_shift_plus_heads_times_dk_dv(dtype):
    mixer = RWKV7(d_model=32, layer_idx=0, n_heads=4, head_dim=6)
    spec = mixer.cache_spec()
    elements = 32 + 4 * 6 * 6
    assert spec.kind == "state" and spec.state_dtype == torch.float32
    assert dict(spec.state_shapes) == {"shift": (32,), "wkv": (4, 6, 6)}
    assert spec.state_elements == elements and spec.elements(1) == spec.elements(5000) == elements
    assert StateSlots(spec, max_batch=3, dtype=dtype, device="cpu").nbytes == 3 * elements * 4


def test_module_bytes_counts_every_parameter():
    for kwargs in [{}, {"head_dim": 6, "decay_low_rank": 3, "a_low_rank": 5, "gate_low_rank": 7}]:
        mixer = RWKV7(d_model=32, layer_idx=0, n_heads=4, **kwargs)
        held = sum(p.nbytes for p in mixer.parameters())
        assert RWKV7.module_bytes(torch.float32, d_model=32, n_heads=4, **kwargs) == held


def test_default_low_ranks_are_fla_sized():
    """fla's widths: 32 at small d_model; at d_model 768, head_dim 64: 64 for w and a, 128 for the gate."""
    small = RWKV7(d_model=32, layer_idx=0, n_heads=4)
    assert [lora.down.out_features for lora in (small.w_lora, small.a_lora, small.g_lora)] == [32, 32, 32]
    with torch.device("meta"):
        base = RWKV7(d_model=768, layer_idx=0, n_heads=12)
    assert [lora.down.out_features for lora in (base.w_lora, base.a_lora, base.g_lora)] == [64, 64, 128]


def test_decays_lie_in_rwkv7s_range():
    """log w = -e^{-0.5} sigmoid(.): every decay in (e^{-e^{-0.5}}, 1) ~ (0.545, 1), whatever the input."""
    mixer = make_mixer()
    _, log_w, *_ = mixer.inputs(torch.randn(2, 7, 32) * 100, torch.zeros(2, 32))
    assert (log_w < 0).all() and (log_w > -0.6066).all()


BAD_SETTINGS = [
    ({"n_heads": 0}, "n_heads must be >= 1, got 0"),
    ({"d_model": 30}, "d_model=30 is not divisible by n_heads=4"),
    ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
    ({"chunk_size": -3}, "chunk_size must be >= 1, got -3"),
    ({"norm_eps": 0.0}, "norm_eps must be > 0 .*, got 0.0"),
    ({"decay_low_rank": 0}, "decay_low_rank must be >= 1 .*, got 0"),
    ({"a_low_rank": -1}, "a_low_rank must be >= 1 .*, got -1"),
    ({"gate_low_rank": 0}, "gate_low_rank must be >= 1 .*, got 0"),
]


@pytest.mark.parametrize("bad,message", BAD_SETTINGS, ids=[next(iter(b)) for b, _ in BAD_SETTINGS])
def test_bad_settings_raise(bad, message):
    settings = {"d_model": 32, "n_heads": 4, **bad}
    with pytest.raises(ValueError, match=message):
        RWKV7(layer_idx=0, **settings)
    if next(iter(bad)) not in ("chunk_size", "norm_eps"):  # module_bytes refuses the sizes before pricing them
        with pytest.raises(ValueError, match=message):
            RWKV7.module_bytes(torch.float32, **settings)
    RWKV7(d_model=30, layer_idx=0, n_heads=4, head_dim=8)  # an explicit head_dim need not divide d_model
