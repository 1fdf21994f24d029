"""RWKV-7's state update: the chunked form and the recurrent step equal the recurrence as the paper writes it (state
[dv, dk], S_t = S_{t-1} (diag(w_t) - kk_t^T (a_t kk_t)) + v_t^T k_t, out_t = S_t r_t; Peng et al. 2025, eq. for the
WKV state) in float64, from any initial state, at lengths off the chunk grid and under decays far stronger than the
mixer's; the chunked form backpropagates correctly (gradcheck); the Triton decode step equals the PyTorch one
(interpreter on CPU: fp32 and fp16)."""
import re

import pytest
import torch
import torch.nn.functional as F

import kernels.rwkv7 as rwkv7
from kernels import FORCE_TRITON_ENV, triton_available
from kernels.rwkv7 import rwkv7_chunked, rwkv7_step, rwkv7_step_ref, rwkv7_step_triton

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=5e-3)}
STATE_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
FP64 = dict(atol=1e-10, rtol=1e-10)


def make_inputs(batch, heads, length, dim_k, dim_v, dtype=torch.float32, device="cpu", seed=0, max_decay=0.6):
    """r, log_w, k, v, kk, a [B, H, T, d]: log decays in [-max_decay, 0] per channel (the mixer's lie in
    [-0.61, 0]), kk L2-normalised, a in (0, 1); r, k, v slices of one fused tensor (strided, as the mixer's)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, heads, length, 2 * dim_k + dim_v, generator=gen)
    r, k, v = fused.split([dim_k, dim_k, dim_v], dim=-1)
    log_w = -torch.rand(batch, heads, length, dim_k, generator=gen) * max_decay
    kk = F.normalize(torch.randn(batch, heads, length, dim_k, generator=gen), dim=-1)
    a = torch.rand(batch, heads, length, dim_k, generator=gen)
    return [t.to(device, dtype) for t in (r, log_w, k, v, kk, a)]


def make_state(batch, heads, dim_k, dim_v, dtype=torch.float32, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, dim_k, dim_v, generator=gen).to(device, dtype)


def paper_recurrence(r, log_w, k, v, kk, a, initial):
    """The paper's form in float64, token by token, with the state [dv, dk] and the transition as a matrix; returns
    out [B, H, T, dv] and the final state in the kernels' [dk, dv] orientation."""
    r, log_w, k, v, kk, a = (t.double() for t in (r, log_w, k, v, kk, a))
    S = initial.double().transpose(-1, -2).clone()  # [B, H, dv, dk]
    outs = []
    for t in range(r.shape[2]):
        transition = torch.diag_embed(log_w[:, :, t].exp()) - kk[:, :, t, :, None] * (a * kk)[:, :, t, None, :]
        S = S @ transition + v[:, :, t, :, None] * k[:, :, t, None, :]
        outs.append((S @ r[:, :, t, :, None])[..., 0])
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out, S.transpose(-1, -2)


def steps(step, r, log_w, k, v, kk, a, state):
    """Apply a step function token by token; the state is updated in place."""
    outs = [step(*(z[:, :, t] for z in (r, log_w, k, v, kk, a)), state) for t in range(r.shape[2])]
    return torch.stack(outs, dim=2) if outs else v.new_empty(v.shape)


@pytest.mark.parametrize("max_decay", [0.6, 30.0], ids=["rwkv7-decays", "strong-decays"])
@pytest.mark.parametrize("length", [0, 1, 7, 16, 37])
@pytest.mark.parametrize("chunk_size", [1, 4, 16])
def test_chunked_equals_the_papers_recurrence_in_fp64(length, chunk_size, max_decay):
    inputs = [t.double() for t in make_inputs(2, 3, length, 12, 10, max_decay=max_decay)]
    initial = make_state(2, 3, 12, 10, torch.float64)
    out, state = rwkv7_chunked(*inputs, initial, chunk_size=chunk_size)
    want_out, want_state = paper_recurrence(*inputs, initial)
    assert out.dtype == state.dtype == torch.float64
    torch.testing.assert_close(out, want_out, **FP64)
    torch.testing.assert_close(state, want_state, **FP64)
    assert state.data_ptr() != initial.data_ptr(), "the final state must be a new tensor, not the caller's"


def test_chunked_is_finite_under_extreme_decays():
    """Per-channel log decays of -1000 a step in fp32 (e^{-1000} underflows, e^{+1000} would overflow): only
    non-positive exponents are taken, so nothing overflows, and what survives (each step's write, and the rank-one
    term's read of it before the decay) is the recurrence's."""
    r, log_w, k, v, kk, a = make_inputs(1, 2, 20, 8, 8)
    log_w = torch.full_like(log_w, -1000.0)
    initial = make_state(1, 2, 8, 8)
    out, state = rwkv7_chunked(r, log_w, k, v, kk, a, initial, chunk_size=16)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    want_out, want_state = paper_recurrence(r, log_w, k, v, kk, a, initial)
    torch.testing.assert_close(out, want_out.float(), **TOLERANCE[torch.float32])
    torch.testing.assert_close(state, want_state.float(), **STATE_TOLERANCE)


@pytest.mark.parametrize("with_initial", [False, True], ids=["zeros", "initial"])
def test_step_equals_the_papers_recurrence(with_initial):
    inputs = make_inputs(2, 3, 9, 16, 24)
    initial = make_state(2, 3, 16, 24) if with_initial else torch.zeros(2, 3, 16, 24)
    state = initial.clone()
    out = steps(rwkv7_step_ref, *inputs, state)
    want_out, want_state = paper_recurrence(*inputs, initial)
    torch.testing.assert_close(out, want_out.float(), **TOLERANCE[torch.float32])
    torch.testing.assert_close(state, want_state.float(), **STATE_TOLERANCE)


def test_chunked_keeps_dtypes():
    inputs = make_inputs(1, 2, 9, 8, 8, dtype=torch.float16)
    out, state = rwkv7_chunked(*inputs, chunk_size=4)
    assert out.dtype == torch.float16 and state.dtype == torch.float32
    _, state = rwkv7_chunked(*inputs, make_state(1, 2, 8, 8, torch.float16), chunk_size=4)
    assert state.dtype == torch.float16


def test_chunked_backward_matches_finite_differences():
    inputs = [t.double().requires_grad_() for t in make_inputs(1, 2, 6, 3, 2)]
    initial = make_state(1, 2, 3, 2).double().requires_grad_()

    def forward(*args):  # chunks of 4 over 6 steps: the solve, the carry and the padding
        return rwkv7_chunked(*args, chunk_size=4)

    assert torch.autograd.gradcheck(forward, (*inputs, initial))


# (dk, dv): one tile each, odd widths padded with masks, several dv tiles beside a wide dk
STEP_SHAPES = [(16, 16), (24, 40), (128, 72)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", STEP_SHAPES, ids=lambda d: f"dk{d[0]}-dv{d[1]}")
def test_triton_step_equals_reference(force_triton, device, dtype, dims):
    # the state pool is fp32 and passed as every other slot row (a strided view), as the engine hands the running
    # slots' rows; the other rows must not change
    dim_k, dim_v = dims
    inputs = make_inputs(3, 2, 4, dim_k, dim_v, dtype, device, seed=5)
    pool = make_state(6, 2, dim_k, dim_v, device=device)
    original = pool.clone()
    state = pool[1::2]
    ref_state = state.clone()
    out = steps(rwkv7_step_triton, *inputs, state)
    ref_out = steps(rwkv7_step_ref, *inputs, ref_state)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    torch.testing.assert_close(pool[1::2], ref_state, **STATE_TOLERANCE)
    assert torch.equal(pool[0::2], original[0::2]), "the kernel wrote rows it was not given"


def test_triton_step_fp16_state(force_triton, device):
    inputs = make_inputs(2, 2, 3, 24, 40, torch.float16, device)
    state = make_state(2, 2, 24, 40, torch.float16, device)
    ref_state = state.clone()
    out = steps(rwkv7_step_triton, *inputs, state)
    ref_out = steps(rwkv7_step_ref, *inputs, ref_state)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float16])
    torch.testing.assert_close(state, ref_state, atol=2e-3, rtol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is broken in the Triton interpreter")
def test_triton_step_bf16_on_gpu():
    inputs = make_inputs(4, 32, 1, 64, 64, torch.bfloat16, "cuda")  # RWKV-7's heads: dk = dv = 64
    state = make_state(4, 32, 64, 64, device="cuda")
    ref_state = state.clone()
    out = rwkv7_step_triton(*(t[:, :, 0] for t in inputs), state)
    ref_out = rwkv7_step_ref(*(t[:, :, 0] for t in inputs), ref_state)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_continues_the_sequence(monkeypatch, device):
    # the cached path the mixer takes: the chunked prefill hands its state to the steps, through both dispatch paths
    inputs = make_inputs(2, 2, 23, 12, 20, device=device)
    whole, _ = rwkv7_chunked(*inputs, chunk_size=8)
    for forced in ["0", "1"] if triton_available() else ["0"]:
        monkeypatch.setenv(FORCE_TRITON_ENV, forced)
        prefix = 17
        out, state = rwkv7_chunked(*(t[:, :, :prefix] for t in inputs), chunk_size=8)
        tail = steps(rwkv7_step, *(t[:, :, prefix:] for t in inputs), state)
        torch.testing.assert_close(torch.cat([out, tail], dim=2), whole, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("forced", [False, True])
def test_dispatcher_routes_by_use_triton(monkeypatch, forced):
    if forced and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if forced else "0")
    called = []
    monkeypatch.setattr(rwkv7, "rwkv7_step_triton", lambda *a: called.append("triton"))
    monkeypatch.setattr(rwkv7, "rwkv7_step_ref", lambda *a: called.append("ref"))
    inputs = make_inputs(1, 2, 1, 8, 4)
    rwkv7_step(*(t[:, :, 0] for t in inputs), torch.zeros(1, 2, 8, 4))
    assert called == ["triton" if forced else "ref"]


KEY = (2, 3, 8)
STEP_BAD_SHAPES = {
    # name: (r, log_w, k, v, kk, a, state, words in the message)
    "r_4d": ((2, 3, 1, 8), (2, 3, 1, 8), (2, 3, 1, 8), (2, 3, 1, 4), (2, 3, 1, 8), (2, 3, 1, 8), (2, 3, 8, 4),
             "r (2, 3, 1, 8)"),
    "kk_differs": (KEY, KEY, KEY, (2, 3, 4), (2, 3, 6), KEY, (2, 3, 8, 4), "kk (2, 3, 8) like r, got (2, 3, 6)"),
    "log_w": (KEY, (2, 3), KEY, (2, 3, 4), KEY, KEY, (2, 3, 8, 4), "log_w (2, 3, 8) like r, got (2, 3)"),
    "state": (KEY, KEY, KEY, (2, 3, 4), KEY, KEY, (2, 3, 4, 8), "state (2, 3, 8, 4)"),
}
SEQ = (2, 3, 5, 8)
SEQUENCE_BAD_SHAPES = {
    # name: (r, log_w, k, v, kk, a, state or None, words in the message)
    "v_length": (SEQ, SEQ, SEQ, (2, 3, 4, 4), SEQ, SEQ, None, "v (2, 3, 4, 4)"),
    "a": (SEQ, SEQ, SEQ, (2, 3, 5, 4), SEQ, (2, 3, 5, 7), None, "a (2, 3, 5, 8) like r, got (2, 3, 5, 7)"),
    "state": (SEQ, SEQ, SEQ, (2, 3, 5, 4), SEQ, SEQ, (2, 3, 4, 8), "state (2, 3, 8, 4)"),
}


@pytest.mark.parametrize("step", [rwkv7_step_ref, rwkv7_step_triton], ids=["ref", "triton"])
@pytest.mark.parametrize("case", STEP_BAD_SHAPES.values(), ids=STEP_BAD_SHAPES.keys())
def test_step_bad_shapes_raise(case, step):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        step(*(torch.zeros(shape) for shape in shapes))


@pytest.mark.parametrize("case", SEQUENCE_BAD_SHAPES.values(), ids=SEQUENCE_BAD_SHAPES.keys())
def test_chunked_bad_shapes_raise(case):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        rwkv7_chunked(*(None if shape is None else torch.zeros(shape) for shape in shapes))


def test_chunked_bad_chunk_size_raises():
    with pytest.raises(ValueError, match="chunk_size must be at least 1, got 0"):
        rwkv7_chunked(*make_inputs(1, 1, 3, 4, 4), chunk_size=0)
