"""What every recurrent-state mixer owes the engine (cache.StateSlots: prefill, multi-token continuations, decode
steps, checkpointed steps, right-padded batched prefill), checked on each at mixer level: cached = uncached with the
reference and the Triton decode step, a prefill split in two = one, a slot's old state never leaks into a new
prefill, batch rows are independent, padding leaves no trace, every checkpoint is the state of its prefix, gradients
flow through the chunked form, a bf16 model keeps fp32 states. Each mixer's own maths (its float64 oracle, its parametrisation) is in its own file:
tests/test_gated_deltanet.py, tests/test_retnet.py, tests/test_rwkv7.py."""
import dataclasses

import pytest
import torch

from cache.state_slots import StateSlots
from kernels import FORCE_TRITON_ENV, triton_available
from ssm.gated_deltanet import GatedDeltaNet
from ssm.retnet import MultiScaleRetention
from ssm.rwkv7 import RWKV7
from batches import run_cached, slot_batch  # tests/ is on sys.path under pytest
from helpers import spread_weights  # tests/ is on sys.path under pytest

ATOL = 1e-4  # outputs are O(1); the chunked and step-by-step fp32 forms round differently
D_MODEL = 32
MIXERS = {  # chunk 8, so the sequences below span several chunks with a short last one
    "gdn": (GatedDeltaNet, {}),
    "gdn-no-conv-history": (GatedDeltaNet, {"d_conv": 1}),
    "gdn-signed": (GatedDeltaNet, {"eigenvalues": "signed"}),
    "retnet": (MultiScaleRetention, {}),
    "rwkv7": (RWKV7, {}),
}


@pytest.fixture(params=list(MIXERS))
def mixer(request):
    cls, settings = MIXERS[request.param]
    torch.manual_seed(0)
    return spread_weights(cls(d_model=D_MODEL, layer_idx=0, n_heads=4, chunk_size=8, **settings), seed=0, gain=1.0)


def max_err(got, want) -> float:
    return (got - want).abs().max().item() if got.numel() else 0.0  # d_conv 1 keeps an empty conv history


def new_cache(mixer, max_batch):
    return StateSlots(mixer.cache_spec(), max_batch=max_batch, dtype=torch.float32, device="cpu")


def assert_states_close(got: dict, want: dict, context: str = "") -> None:
    for name in want:
        assert max_err(got[name], want[name]) <= ATOL, f"{context}: {name} state differs"


@pytest.mark.parametrize("forced", ["0", "1"], ids=["reference-step", "triton-step"])
def test_cached_prefill_then_decode_equals_uncached(monkeypatch, mixer, forced):
    if forced == "1" and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, forced)  # "1": decode steps run the Triton kernel (interpreter on CPU)
    x = torch.randn(2, 30, D_MODEL)
    with torch.no_grad():
        full = mixer(x)
        # prefill 13 (two chunks, the second short), single tokens, a 7-token continuation, single tokens
        cached = run_cached(mixer, new_cache(mixer, 2), x, [13, 1, 1, 1, 7] + [1] * 7)
    assert max_err(cached, full) <= ATOL, f"cached differs from uncached by {max_err(cached, full):.3g}"


def test_prefill_in_two_calls_equals_one(mixer):
    """The second call continues the chunked form from the first's states, chunk boundaries misaligned with the
    split; outputs and every state left in the cache agree."""
    x = torch.randn(2, 21, D_MODEL)
    with torch.no_grad():
        one_cache, two_cache = new_cache(mixer, 2), new_cache(mixer, 2)
        one = run_cached(mixer, one_cache, x, [21])
        two = run_cached(mixer, two_cache, x, [11, 10])
    assert max_err(two, one) <= ATOL
    assert_states_close(two_cache.tensors, one_cache.tensors, "two calls")


def test_prefill_overwrites_a_finished_sequences_state(mixer):
    """A slot's previous owner leaves its state behind; a prefill must start from zeros regardless."""
    x = torch.randn(1, 12, D_MODEL)
    with torch.no_grad():
        cache = new_cache(mixer, 1)
        run_cached(mixer, cache, torch.randn(1, 6, D_MODEL), [6])
        cached = run_cached(mixer, cache, x, [5] + [1] * 7)
        full = mixer(x)
    assert max_err(cached, full) <= ATOL


def test_batch_rows_are_independent(mixer):
    """Three sequences prefilled together in non-consecutive slots of a larger pool, then decoded together, equal
    each run alone; the unused slots stay untouched."""
    x = torch.randn(3, 16, D_MODEL)
    with torch.no_grad():
        cache = new_cache(mixer, 5)
        batched = run_cached(mixer, cache, x, [10, 1, 1, 3, 1], slots=[4, 0, 2])
        for row in range(3):
            alone = run_cached(mixer, new_cache(mixer, 1), x[row : row + 1], [10] + [1] * 6)
            assert max_err(batched[row : row + 1], alone) <= ATOL, f"row {row} depends on its batch"
    assert all(not t[[1, 3]].any() for t in cache.tensors.values()), "unused slots were written"


def test_right_padded_prefill_stops_each_row_at_its_end(mixer):
    """A batched prefill pads rows on the right: each row's outputs and states are those of its real tokens alone."""
    x = torch.randn(2, 11, D_MODEL)
    lengths = [11, 6]
    with torch.no_grad():
        cache = new_cache(mixer, 2)
        positions = torch.arange(11).expand(2, 11)
        batch = dataclasses.replace(slot_batch(positions, prefill=True, lengths=lengths), padded=True)
        out = mixer(x, positions, cache, batch)
        for row, n in enumerate(lengths):
            alone = new_cache(mixer, 1)
            want = run_cached(mixer, alone, x[row : row + 1, :n], [n])
            assert max_err(out[row : row + 1, :n], want) <= ATOL, f"row {row}"
            assert_states_close({k: t[row] for k, t in cache.tensors.items()},
                                {k: t[0] for k, t in alone.tensors.items()}, f"row {row}")


def test_checkpointed_steps_roll_back_to_the_state_of_any_prefix(mixer):
    """A step with checkpoints (speculative verification) gives the plain outputs, and rolling back to any of its
    tokens leaves the states a prefill of that prefix would."""
    x = torch.randn(2, 12, D_MODEL)
    with torch.no_grad():
        full = mixer(x)
        cache = new_cache(mixer, 2)
        run_cached(mixer, cache, x, [7])
        positions = torch.arange(7, 12).expand(2, 5)
        batch = dataclasses.replace(slot_batch(positions, False), checkpoints=True)
        out = mixer(x[:, 7:], positions, cache, batch)
        assert max_err(out, full[:, 7:]) <= ATOL
        for keep in (12, 10, 8):  # newest first: a rollback keeps the checkpoints before it
            cache.rollback({0: keep, 1: keep})
            prefix = new_cache(mixer, 2)
            run_cached(mixer, prefix, x[:, :keep], [keep])
            assert_states_close(cache.tensors, prefix.tensors, f"rolled back to {keep}")


def test_gradients_flow_through_the_chunked_form(mixer):
    mixer.train()
    x = torch.randn(2, 19, D_MODEL, requires_grad=True)
    mixer(x).square().sum().backward()
    for name, param in [("x", x), *mixer.named_parameters()]:
        assert param.grad is not None and torch.isfinite(param.grad).all(), f"{name}: no finite gradient"
        assert param.grad.abs().max() > 0, f"{name}: zero gradient"


def test_a_bf16_model_runs_and_caches_with_fp32_states(mixer):
    mixer = mixer.to(torch.bfloat16)
    x = torch.randn(1, 12, D_MODEL, dtype=torch.bfloat16)
    with torch.no_grad():
        full = mixer(x)
        cache = new_cache(mixer, 1)
        cached = run_cached(mixer, cache, x, [9, 1, 1, 1])
    assert full.dtype == cached.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in cache.tensors.values())
    assert max_err(cached.float(), full.float()) <= 0.05  # bf16 projections; the states stay fp32
