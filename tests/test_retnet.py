"""RetNet's multi-scale retention mixer: the fast forward equals the float64 step-by-step reference() and the paper's
parallel form; the cached mixer (StateSlots: prefill, multi-token continuations, decode steps, checkpointed steps,
right-padded batched prefill) equals the uncached one; batch rows are independent; gradients flow through the chunked
form; the state is n_heads * dk * dv fp32 elements; bad settings are refused by name, before pricing too."""
import dataclasses

import pytest
import torch

from cache.state_slots import StateSlots
from kernels import FORCE_TRITON_ENV, triton_available
from ssm.retnet import MultiScaleRetention, log_decays
from batches import run_cached, slot_batch  # tests/ is on sys.path under pytest
from helpers import spread_weights  # tests/ is on sys.path under pytest

ATOL = 1e-5  # outputs are O(1); fp32 against float64
CACHED_ATOL = 1e-4  # the chunked and the step-by-step fp32 forms round differently


def make_mixer(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"d_model": 32, "layer_idx": 0, "n_heads": 4, "chunk_size": 8, **kwargs}
    return spread_weights(MultiScaleRetention(**kwargs), seed=seed, gain=1.0)


def max_err(got, want) -> float:
    return (got - want).abs().max().item()


def new_cache(mixer, max_batch):
    return StateSlots(mixer.cache_spec(), max_batch=max_batch, dtype=torch.float32, device="cpu")


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


@pytest.mark.parametrize("forced", ["0", "1"], ids=["reference-step", "triton-step"])
def test_cached_prefill_then_decode_equals_uncached(monkeypatch, forced):
    if forced == "1" and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, forced)  # "1": decode steps run the Triton kernel (interpreter on CPU)
    mixer = make_mixer()
    x = torch.randn(2, 30, 32)
    with torch.no_grad():
        full = mixer(x)
        # prefill 13 (two chunks, the second short), single tokens, a 7-token continuation, single tokens
        cached = run_cached(mixer, new_cache(mixer, 2), x, [13, 1, 1, 1, 7] + [1] * 7)
    assert max_err(cached, full) <= CACHED_ATOL, f"cached differs from uncached by {max_err(cached, full):.3g}"


def test_prefill_in_two_calls_equals_one():
    """The second call continues the chunked form from the first's state, chunk boundaries misaligned with the
    split; outputs and the states left in the cache agree."""
    mixer = make_mixer()
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        one_cache, two_cache = new_cache(mixer, 2), new_cache(mixer, 2)
        one = run_cached(mixer, one_cache, x, [21])
        two = run_cached(mixer, two_cache, x, [11, 10])
    assert max_err(two, one) <= CACHED_ATOL
    assert max_err(two_cache.tensors["retention"], one_cache.tensors["retention"]) <= CACHED_ATOL


def test_prefill_overwrites_a_finished_sequences_state():
    """A slot's previous owner leaves its state behind; a prefill must start from zeros regardless."""
    mixer = make_mixer()
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        cache = new_cache(mixer, 1)
        run_cached(mixer, cache, torch.randn(1, 6, 32), [6])
        cached = run_cached(mixer, cache, x, [5] + [1] * 7)
        full = mixer(x)
    assert max_err(cached, full) <= CACHED_ATOL


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
            assert max_err(batched[row : row + 1], alone) <= CACHED_ATOL, f"row {row} depends on its batch"
    assert cache.tensors["retention"][[1, 3]].abs().max() == 0, "unused slots were written"


@torch.no_grad()
def test_right_padded_prefill_stops_each_state_at_its_row():
    """A batched prefill of unequal prompts, right-padded with garbage: each row's outputs and the state it leaves
    (checked by decoding on) equal its prompt run alone."""
    mixer = make_mixer()
    lengths = [3, 11, 6]
    seqs = [torch.randn(1, n + 4, 32) for n in lengths]
    x = torch.full((3, max(lengths), 32), 100.0)  # garbage past each row's end
    for row, (s, n) in enumerate(zip(seqs, lengths)):
        x[row, :n] = s[0, :n]
    cache = new_cache(mixer, 3)
    positions = torch.arange(max(lengths)).expand(3, -1)
    batch = dataclasses.replace(slot_batch(positions, True, lengths=lengths), padded=True)
    out = mixer(x, positions, cache, batch)
    for step in range(4):
        positions = torch.tensor([[n + step] for n in lengths])
        token = torch.cat([s[:, n + step : n + step + 1] for s, n in zip(seqs, lengths)])
        decoded = mixer(token, positions, cache, slot_batch(positions, False))
        for row, (s, n) in enumerate(zip(seqs, lengths)):
            alone = mixer(s)
            assert max_err(decoded[row, 0], alone[0, n + step]) <= CACHED_ATOL, f"row {row} step {step}"
            if step == 0:
                assert max_err(out[row, :n], alone[0, :n]) <= CACHED_ATOL, f"row {row} prefill"


@torch.no_grad()
def test_checkpointed_steps_keep_the_state_after_every_token():
    """A step with checkpoints (speculative verification) gives the plain outputs, and rolling back to any token
    leaves the state a prefill of that prefix would."""
    mixer = make_mixer()
    x = torch.randn(2, 12, 32)
    full = mixer(x)
    cache = new_cache(mixer, 2)
    run_cached(mixer, cache, x, [7])
    positions = torch.arange(7, 12).expand(2, 5)
    batch = dataclasses.replace(slot_batch(positions, False), checkpoints=True)
    out = mixer(x[:, 7:], positions, cache, batch)
    assert max_err(out, full[:, 7:]) <= CACHED_ATOL
    for keep in (8, 10, 12):
        cache.rollback({0: keep, 1: keep})
        prefix_cache = new_cache(mixer, 2)
        run_cached(mixer, prefix_cache, x[:, :keep], [keep])
        assert max_err(cache.tensors["retention"], prefix_cache.tensors["retention"]) <= CACHED_ATOL, keep


def test_gradients_flow_through_the_chunked_form():
    mixer = make_mixer().train()
    x = torch.randn(2, 19, 32, requires_grad=True)
    mixer(x).square().sum().backward()
    for name, param in [("x", x), *mixer.named_parameters()]:
        assert param.grad is not None and torch.isfinite(param.grad).all(), f"{name}: no finite gradient"
        assert param.grad.abs().max() > 0, f"{name}: zero gradient"


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
