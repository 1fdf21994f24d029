import re

import pytest
import torch
import torch.nn.functional as F

import kernels.linear_attention as linear_attention
from kernels import (
    FORCE_TRITON_ENV,
    linear_attention_chunked,
    linear_attention_chunked_ref,
    linear_attention_chunked_triton,
    linear_attention_parallel_ref,
    linear_attention_step,
    linear_attention_step_ref,
    linear_attention_step_triton,
    triton_available,
)

# outputs are ratios of O(1) averages; fp16 inputs and outputs carry ~1e-3 relative error
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=5e-3)}
# S and z are fp32 sums of up to ~100 terms of size ~1-10: entries near 0 after cancellation need an atol
STATE_TOLERANCE = dict(atol=1e-4, rtol=1e-5)
LENGTHS = [1, 7, 64, 100]  # one token, under a chunk, exactly one 64-chunk, ragged over several
CHUNKS = [16, 64]


def make_sequence(batch, heads, length, dim_k, dim_v, dtype, device, seed=0):
    """phi(q), phi(k) with phi = elu + 1 (positive, as the mixer's feature map leaves them); q, k, v strided
    slices of one fused projection."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, heads, length, 2 * dim_k + dim_v, generator=gen)
    q, k, v = fused.split([dim_k, dim_k, dim_v], dim=-1)
    return (F.elu(q) + 1).to(device, dtype), (F.elu(k) + 1).to(device, dtype), v.to(device, dtype)


def make_initial(batch, heads, dim_k, dim_v, dtype, device, seed=1):
    """A state and normalizer as a prefix of ~20 positive-feature tokens leaves them."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, heads, dim_k, dim_v, generator=gen) * 5
    normalizer = 20 + 5 * torch.rand(batch, heads, dim_k, generator=gen)
    return state.to(device, dtype), normalizer.to(device, dtype)


def naive_recurrence(q, k, v, state=None, normalizer=None, eps=1e-6):
    """Float64, one token at a time: S += k v^T, z += k, out = q S / (q . z + eps)."""
    batch, heads, length, dim_k = q.shape
    S = torch.zeros(batch, heads, dim_k, v.shape[-1], dtype=torch.float64) if state is None else state.double().cpu()
    z = torch.zeros(batch, heads, dim_k, dtype=torch.float64) if normalizer is None else normalizer.double().cpu()
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    out = torch.empty(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for t in range(length):
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        z = z + k[:, :, t]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S) / ((q[:, :, t] * z).sum(-1, keepdim=True) + eps)
    return out, S, z


def steps(step, q, k, v, state, normalizer):
    """Apply a step function token by token; state and normalizer are updated in place."""
    return torch.stack([step(q[:, :, t], k[:, :, t], v[:, :, t], state, normalizer) for t in range(q.shape[2])], 2)


def assert_close64(actual, expected, dtype):
    torch.testing.assert_close(actual.cpu().double(), expected, **TOLERANCE[dtype])


def assert_state_close64(actual, expected):
    torch.testing.assert_close(actual.cpu().double(), expected, **STATE_TOLERANCE)


@pytest.mark.parametrize("with_initial", [False, True], ids=["zeros", "initial"])
@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_parallel_recurrent_agree_fp32(length, chunk_size, with_initial):
    q, k, v = make_sequence(2, 3, length, 12, 20, torch.float32, "cpu")
    initial = make_initial(2, 3, 12, 20, torch.float32, "cpu") if with_initial else (None, None)
    expected_out, expected_state, expected_normalizer = naive_recurrence(q, k, v, *initial)

    out, state, normalizer = linear_attention_chunked_ref(q, k, v, *initial, chunk_size=chunk_size)
    assert state.dtype == normalizer.dtype == torch.float32
    assert_close64(out, expected_out, torch.float32)
    assert_state_close64(state, expected_state)
    assert_state_close64(normalizer, expected_normalizer)
    assert_close64(linear_attention_parallel_ref(q, k, v, state=initial[0], normalizer=initial[1]),
                   expected_out, torch.float32)

    step_state, step_normalizer = (make_initial(2, 3, 12, 20, torch.float32, "cpu") if with_initial else
                                   (torch.zeros(2, 3, 12, 20), torch.zeros(2, 3, 12)))
    assert_close64(steps(linear_attention_step_ref, q, k, v, step_state, step_normalizer), expected_out, torch.float32)
    torch.testing.assert_close(step_state, state, **STATE_TOLERANCE)
    torch.testing.assert_close(step_normalizer, normalizer, **STATE_TOLERANCE)


def test_reference_fp16_inputs_and_states():
    # fp16 everywhere: the initial state's dtype is kept for the returned state
    q, k, v = make_sequence(2, 3, 100, 12, 20, torch.float16, "cpu")
    initial = make_initial(2, 3, 12, 20, torch.float16, "cpu")
    expected_out, expected_state, expected_normalizer = naive_recurrence(q, k, v, *initial)
    out, state, normalizer = linear_attention_chunked_ref(q, k, v, *initial, chunk_size=16)
    assert out.dtype == state.dtype == normalizer.dtype == torch.float16
    assert_close64(out, expected_out, torch.float16)
    assert_close64(linear_attention_parallel_ref(q, k, v, state=initial[0], normalizer=initial[1]),
                   expected_out, torch.float16)
    torch.testing.assert_close(state.double(), expected_state, atol=0.1, rtol=2e-3)  # |S| ~ 100: fp16 rounding
    torch.testing.assert_close(normalizer.double(), expected_normalizer, atol=0.1, rtol=2e-3)
    step_state, step_normalizer = make_initial(2, 3, 12, 20, torch.float16, "cpu")
    # the step rounds its state to fp16 after every token, so it drifts from the fp32-carried chunked state
    assert_close64(steps(linear_attention_step_ref, q, k, v, step_state, step_normalizer), expected_out, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zeros", "initial"])
@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_triton_chunked(force_triton, device, length, chunk_size, with_initial, dtype):
    # dk 12 and dv 20 pad to 16 and 32
    q, k, v = make_sequence(2, 2, length, 12, 20, dtype, device)
    initial = make_initial(2, 2, 12, 20, torch.float32, device) if with_initial else (None, None)
    out, state, normalizer = linear_attention_chunked_triton(q, k, v, *initial, chunk_size=chunk_size)
    ref_out, ref_state, ref_normalizer = linear_attention_chunked_ref(q, k, v, *initial, chunk_size=chunk_size)
    expected_out, expected_state, expected_normalizer = naive_recurrence(q, k, v, *initial)
    assert out.dtype == dtype and state.dtype == normalizer.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert_close64(out, expected_out, dtype)
    # the states are sums of fp16-exact inputs accumulated in fp32 on both paths
    torch.testing.assert_close(state, ref_state, **STATE_TOLERANCE)
    torch.testing.assert_close(normalizer, ref_normalizer, **STATE_TOLERANCE)
    assert_state_close64(state, expected_state)
    assert_state_close64(normalizer, expected_normalizer)


@pytest.mark.parametrize("dim_k,dim_v", [(16, 80), (273, 24)], ids=["two_dv_tiles", "taylor_width_dk"])
def test_triton_chunked_tiling(force_triton, device, dim_k, dim_v):
    # dv 80 splits into two dv tiles (only tile 0 stores the normalizer); dk 273 (the Taylor map of a
    # 16-wide feature, 1 + 16 + 256) pads to 512 and shrinks the chunk to 16
    q, k, v = make_sequence(1, 2, 40, dim_k, dim_v, torch.float32, device, seed=4)
    q, k = q / dim_k, k / dim_k  # keep q.k O(1) at this width
    initial = make_initial(1, 2, dim_k, dim_v, torch.float32, device)
    out, state, normalizer = linear_attention_chunked_triton(q, k, v, *initial, chunk_size=64)
    expected_out, expected_state, expected_normalizer = naive_recurrence(q, k, v, *initial)
    assert_close64(out, expected_out, torch.float32)
    assert_state_close64(state, expected_state)
    assert_state_close64(normalizer, expected_normalizer)


def test_triton_chunked_fp16_state_dtype(force_triton, device):
    # an fp16 initial state: the returned state is fp16 too, as the reference's
    q, k, v = make_sequence(2, 2, 30, 12, 20, torch.float16, device)
    initial = make_initial(2, 2, 12, 20, torch.float16, device)
    out, state, normalizer = linear_attention_chunked_triton(q, k, v, *initial, chunk_size=16)
    ref_out, ref_state, ref_normalizer = linear_attention_chunked_ref(q, k, v, *initial, chunk_size=16)
    assert state.dtype == normalizer.dtype == torch.float16
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float16])
    torch.testing.assert_close(state, ref_state, atol=0, rtol=1e-3)
    torch.testing.assert_close(normalizer, ref_normalizer, atol=0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("dim_k,dim_v", [(12, 20), (80, 72)], ids=["small", "several_tiles"])
def test_triton_step(force_triton, device, dtype, dim_k, dim_v):
    # 80 x 72 walks two dk and two dv tiles of 64. The state pool is fp32 and passed as every other slot row
    # (a strided view), as the engine hands the running slots' rows; other rows must not change.
    q, k, v = make_sequence(3, 2, 5, dim_k, dim_v, dtype, device, seed=5)
    state_pool, normalizer_pool = make_initial(6, 2, dim_k, dim_v, torch.float32, device)
    original_state, original_normalizer = state_pool.clone(), normalizer_pool.clone()
    state, normalizer = state_pool[1::2], normalizer_pool[1::2]
    ref_state, ref_normalizer = state.clone(), normalizer.clone()
    out = steps(linear_attention_step_triton, q, k, v, state, normalizer)
    ref_out = steps(linear_attention_step_ref, q, k, v, ref_state, ref_normalizer)
    expected_out, expected_state, expected_normalizer = naive_recurrence(q, k, v, original_state[1::2],
                                                                         original_normalizer[1::2])
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert_close64(out, expected_out, dtype)
    torch.testing.assert_close(state, ref_state, **STATE_TOLERANCE)
    torch.testing.assert_close(normalizer, ref_normalizer, **STATE_TOLERANCE)
    assert_state_close64(state_pool[1::2], expected_state)
    assert_state_close64(normalizer_pool[1::2], expected_normalizer)
    assert torch.equal(state_pool[0::2], original_state[0::2])
    assert torch.equal(normalizer_pool[0::2], original_normalizer[0::2])


def test_triton_step_fp16_state(force_triton, device):
    q, k, v = make_sequence(2, 2, 4, 12, 20, torch.float16, device)
    state, normalizer = make_initial(2, 2, 12, 20, torch.float16, device)
    ref_state, ref_normalizer = state.clone(), normalizer.clone()
    out = steps(linear_attention_step_triton, q, k, v, state, normalizer)
    ref_out = steps(linear_attention_step_ref, q, k, v, ref_state, ref_normalizer)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float16])
    torch.testing.assert_close(state, ref_state, atol=0, rtol=1e-3)
    torch.testing.assert_close(normalizer, ref_normalizer, atol=0, rtol=1e-3)


def test_prefill_then_decode_continues_the_sequence(monkeypatch, device):
    # the cached path the mixer takes: chunked prefill hands its state to the steps; both paths (dispatch)
    for forced in ["0", "1"] if triton_available() else ["0"]:
        monkeypatch.setenv(FORCE_TRITON_ENV, forced)
        q, k, v = make_sequence(2, 2, 23, 12, 20, torch.float32, device)
        prefix = 17
        out, state, normalizer = linear_attention_chunked(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix],
                                                          chunk_size=16)
        tail = steps(linear_attention_step, q[:, :, prefix:], k[:, :, prefix:], v[:, :, prefix:], state, normalizer)
        assert_close64(torch.cat([out, tail], 2), naive_recurrence(q, k, v)[0], torch.float32)


@pytest.mark.parametrize("forward", [linear_attention_chunked_ref, linear_attention_chunked_triton],
                         ids=["ref", "triton"])
def test_empty_sequence_returns_copies_of_the_initial_state(monkeypatch, device, forward):
    if forward is linear_attention_chunked_triton:
        pytest.importorskip("triton")
    q, k, v = make_sequence(2, 2, 0, 12, 20, torch.float32, device)
    initial = make_initial(2, 2, 12, 20, torch.float32, device)
    out, state, normalizer = forward(q, k, v, *initial)
    assert out.shape == (2, 2, 0, 20)
    assert torch.equal(state, initial[0]) and torch.equal(normalizer, initial[1])
    assert state.data_ptr() != initial[0].data_ptr() and normalizer.data_ptr() != initial[1].data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is broken in the Triton interpreter")
def test_triton_bf16_on_gpu():
    q, k, v = make_sequence(4, 8, 1000, 128, 128, torch.bfloat16, "cuda")
    initial = make_initial(4, 8, 128, 128, torch.float32, "cuda")
    out, state, normalizer = linear_attention_chunked_triton(q, k, v, *initial)
    ref_out, ref_state, ref_normalizer = linear_attention_chunked_ref(q, k, v, *initial)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=1e-3, rtol=1e-4)
    ref_step_state, ref_step_normalizer = state.clone(), normalizer.clone()
    step_out = linear_attention_step_triton(q[:, :, 0], k[:, :, 0], v[:, :, 0], state, normalizer)
    ref_step = linear_attention_step_ref(q[:, :, 0], k[:, :, 0], v[:, :, 0], ref_step_state, ref_step_normalizer)
    torch.testing.assert_close(step_out, ref_step, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_step_state, atol=1e-3, rtol=1e-4)


STEP_BAD_SHAPES = {
    # name: (q, k, v, state, normalizer, words in the message)
    "q_4d": ((2, 3, 1, 8), (2, 3, 1, 8), (2, 3, 1, 4), (2, 3, 8, 4), (2, 3, 8), "(2, 3, 1, 8)"),
    "k_differs": ((2, 3, 8), (2, 3, 6), (2, 3, 4), (2, 3, 8, 4), (2, 3, 8), "(2, 3, 6)"),
    "state": ((2, 3, 8), (2, 3, 8), (2, 3, 4), (2, 3, 4, 8), (2, 3, 8), "state (2, 3, 8, 4)"),
    "normalizer": ((2, 3, 8), (2, 3, 8), (2, 3, 4), (2, 3, 8, 4), (2, 3, 4), "normalizer (2, 3, 8)"),
}
SEQUENCE_BAD_SHAPES = {
    # name: (q, k, v, state or None, normalizer or None, words in the message)
    "q_3d": ((2, 3, 8), (2, 3, 8), (2, 3, 4), None, None, "(2, 3, 8)"),
    "v_length": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 4, 4), None, None, "(2, 3, 4, 4)"),
    "state": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 4), (2, 3, 8, 5), None, "state (2, 3, 8, 4)"),
    "normalizer": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 4), None, (2, 1, 8), "normalizer (2, 3, 8)"),
}


@pytest.mark.parametrize("step", [linear_attention_step_ref, linear_attention_step_triton], ids=["ref", "triton"])
@pytest.mark.parametrize("case", STEP_BAD_SHAPES.values(), ids=STEP_BAD_SHAPES.keys())
def test_step_bad_shapes_raise(case, step):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        step(*(torch.zeros(shape) for shape in shapes))


@pytest.mark.parametrize("forward", [linear_attention_chunked_ref, linear_attention_chunked_triton,
                                     lambda q, k, v, s, z: linear_attention_parallel_ref(q, k, v, state=s, normalizer=z)],
                         ids=["chunked_ref", "chunked_triton", "parallel_ref"])
@pytest.mark.parametrize("case", SEQUENCE_BAD_SHAPES.values(), ids=SEQUENCE_BAD_SHAPES.keys())
def test_sequence_bad_shapes_raise(case, forward):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        forward(*(None if shape is None else torch.zeros(shape) for shape in shapes))


@pytest.mark.parametrize("forced", [False, True])
def test_dispatchers_route_by_use_triton(monkeypatch, forced):
    if forced and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if forced else "0")
    called = []
    for name in ["linear_attention_step", "linear_attention_chunked"]:
        monkeypatch.setattr(linear_attention, f"{name}_triton", lambda *a, name=name: called.append(f"{name} triton"))
        monkeypatch.setattr(linear_attention, f"{name}_ref", lambda *a, name=name: called.append(f"{name} ref"))
    q, k, v = make_sequence(1, 2, 3, 8, 4, torch.float32, "cpu")
    linear_attention_chunked(q, k, v)
    linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8))
    path = "triton" if forced else "ref"
    assert called == [f"linear_attention_chunked {path}", f"linear_attention_step {path}"]
