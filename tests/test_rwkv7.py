"""RWKV-7 mixer: the fast forward equals the float64 token-by-token reference() (written in the paper's [dv, dk]
orientation); the cached mixer (StateSlots: prefill, multi-token continuations, decode steps, checkpointed steps,
right-padded prefill) equals the uncached one; batch rows are independent; gradients flow through the chunked form;
the state is d_model + n_heads * dk * dv fp32 elements; bad settings are refused by name."""
import pytest
import torch

from cache.state_slots import StateSlots
from kernels import FORCE_TRITON_ENV, triton_available
from ssm.rwkv7 import RWKV7
from batches import run_cached, slot_batch  # tests/ is on sys.path under pytest
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
    assert max_err(cached, full) <= ATOL, f"cached differs from uncached by {max_err(cached, full):.3g}"


def test_prefill_in_two_calls_equals_one():
    """The second call continues the chunked form from the first's states (the shift and S), chunk boundaries
    misaligned with the split; outputs and the states left in the cache agree."""
    mixer = make_mixer()
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        one_cache, two_cache = new_cache(mixer, 2), new_cache(mixer, 2)
        one = run_cached(mixer, one_cache, x, [21])
        two = run_cached(mixer, two_cache, x, [11, 10])
    assert max_err(two, one) <= ATOL
    for name in ("shift", "wkv"):
        assert max_err(two_cache.tensors[name], one_cache.tensors[name]) <= ATOL, f"{name} state differs"
    assert torch.equal(one_cache.tensors["shift"], x[:, -1]), "the shift state is the last token's input"


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


def test_checkpointed_steps_keep_the_state_after_every_token():
    """A speculative verification (batch.checkpoints) writes the state after each of its tokens: each equals the
    state a prefill of that prefix leaves."""
    mixer = make_mixer()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        cache = new_cache(mixer, 2)
        run_cached(mixer, cache, x, [5])
        positions = torch.arange(5, 9).expand(2, 4)
        batch = slot_batch(positions, prefill=False)
        batch.checkpoints = True
        out = mixer(x[:, 5:], positions, cache, batch)
        assert max_err(out, mixer(x)[:, 5:]) <= ATOL
        _, _, steps = cache.steps[-1]
        for i in range(4):
            prefix = new_cache(mixer, 2)
            run_cached(mixer, prefix, x, [6 + i])
            for name in ("shift", "wkv"):
                assert max_err(steps[name][:, i], prefix.tensors[name]) <= ATOL, f"{name} after token {5 + i}"


def test_right_padded_prefill_stops_each_row_at_its_end():
    """A batched prefill pads rows on the right: each row's state and shift are those of its real tokens alone."""
    mixer = make_mixer()
    x = torch.randn(2, 11, 32)
    lengths = [11, 6]
    with torch.no_grad():
        cache = new_cache(mixer, 2)
        positions = torch.arange(11).expand(2, 11)
        batch = slot_batch(positions, prefill=True, lengths=lengths)
        batch.padded = True
        out = mixer(x, positions, cache, batch)
        for row, n in enumerate(lengths):
            alone = new_cache(mixer, 1)
            want = run_cached(mixer, alone, x[row : row + 1, :n], [n])
            assert max_err(out[row : row + 1, :n], want) <= ATOL
            for name in ("shift", "wkv"):
                assert max_err(cache.tensors[name][row], alone.tensors[name][0]) <= ATOL, f"row {row}: {name}"


def test_gradients_flow_through_the_chunked_form():
    mixer = make_mixer().train()
    x = torch.randn(2, 19, 32, requires_grad=True)
    mixer(x).square().sum().backward()
    for name, param in [("x", x), *mixer.named_parameters()]:
        assert param.grad is not None and torch.isfinite(param.grad).all(), f"{name}: no finite gradient"
        assert param.grad.abs().max() > 0, f"{name}: zero gradient"


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
