"""Retention's decayed linear-attention kernels: the chunked form equals the step-by-step recurrence and the paper's
parallel form in float64 from any initial state, keeps its dtypes and backpropagates correctly (gradcheck); the
Triton decode step equals the PyTorch one (interpreter on CPU: fp32 and fp16), writing only the state rows it is
given; bad shapes are refused by name."""
import re

import pytest
import torch

import kernels.retention_decay as retention_decay
from kernels import FORCE_TRITON_ENV, triton_available
from kernels.retention_decay import (
    retention_decay_chunked,
    retention_decay_step,
    retention_decay_step_ref,
    retention_decay_step_triton,
)

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=5e-3)}
STATE_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
FP64 = dict(atol=1e-12, rtol=1e-12)


def make_inputs(batch, heads, length, dim_k, dim_v, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v [B, H, T, d] as strided slices of one fused projection, and log decays g [B, H, T]: RetNet's
    per-head log(1 - 2^(-5-h)) perturbed per token, in about [-0.4, 0], and exactly 0 (no decay) at some tokens."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, heads, length, 2 * dim_k + dim_v, generator=gen)
    q, k, v = fused.split([dim_k, dim_k, dim_v], dim=-1)
    per_head = torch.log1p(-(2.0 ** (-5.0 - torch.arange(heads))))[None, :, None]
    g = per_head - 0.4 * torch.rand(batch, heads, length, generator=gen)
    g = g * (torch.rand(batch, heads, length, generator=gen) > 0.2)
    return [t.to(device, dtype) for t in (q, k, v)] + [g.to(device)]


def make_state(batch, heads, dim_k, dim_v, dtype=torch.float32, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, dim_k, dim_v, generator=gen).to(device, dtype)


def steps(step, q, k, v, g, state):
    """Apply a step function token by token; the state is updated in place."""
    outs = [step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], state) for t in range(q.shape[2])]
    return torch.stack(outs, dim=2) if outs else q.new_empty(v.shape)


def recurrence(q, k, v, g, state, scale=None):
    """S_t = e^{g_t} S_{t-1} + k_t v_t^T, out_t = S_t^T (scale q_t), one (batch, head) and token at a time."""
    batch, heads, length, dim_k = q.shape
    scale = dim_k ** -0.5 if scale is None else scale
    state = state.clone()
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    for b in range(batch):
        for h in range(heads):
            for t in range(length):
                state[b, h] = torch.exp(g[b, h, t]) * state[b, h] + torch.outer(k[b, h, t], v[b, h, t])
                out[b, h, t] = state[b, h].T @ (scale * q[b, h, t])
    return out, state


@pytest.mark.parametrize("length", [0, 1, 7, 33])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_equals_the_recurrence_in_float64(length, chunk_size):
    """Odd widths (dk 7, dv 13), a ragged last chunk, from a nonzero state."""
    q, k, v, g = (t.double() for t in make_inputs(2, 3, length, 7, 13))
    initial = make_state(2, 3, 7, 13).double()
    out, state = retention_decay_chunked(q, k, v, g, initial, chunk_size=chunk_size)
    want_out, want_state = recurrence(q, k, v, g, initial)
    torch.testing.assert_close(out, want_out, **FP64)
    torch.testing.assert_close(state, want_state, **FP64)
    assert state.data_ptr() != initial.data_ptr(), "the final state must be a new tensor, not the caller's"


def test_chunked_equals_the_papers_parallel_form():
    """A constant decay per head and a zero state: out = (q k^T * scale * D) v, D[n, m] = gamma^(n - m) for n >= m
    (Sun et al. 2023, equation 5)."""
    q, k, v, _ = (t.double() for t in make_inputs(2, 4, 29, 8, 16))
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(4, dtype=torch.float64))
    g = gamma.log()[None, :, None].expand(2, 4, 29)
    n = torch.arange(29, dtype=torch.float64)
    D = (gamma[:, None, None] ** (n[:, None] - n[None, :]).clamp_min(0)) * (n[:, None] >= n[None, :])
    want = ((q @ k.transpose(-1, -2)) * 8 ** -0.5 * D) @ v
    out, _ = retention_decay_chunked(q, k, v, g, chunk_size=8)
    torch.testing.assert_close(out, want, **FP64)


def test_chunked_and_steps_agree_in_fp32_and_a_scale():
    q, k, v, g = make_inputs(2, 2, 40, 12, 20)
    initial = make_state(2, 2, 12, 20)
    out, state = retention_decay_chunked(q, k, v, g, initial, chunk_size=16, scale=0.3)
    step_state = initial.clone()
    step_out = steps(lambda *a: retention_decay_step_ref(*a, scale=0.3), q, k, v, g, step_state)
    torch.testing.assert_close(out, step_out, **TOLERANCE[torch.float32])
    torch.testing.assert_close(state, step_state, **STATE_TOLERANCE)


def test_chunked_keeps_dtypes():
    q, k, v, g = make_inputs(1, 2, 9, 8, 8, dtype=torch.float16)
    out, state = retention_decay_chunked(q, k, v, g, chunk_size=4)
    assert out.dtype == torch.float16 and state.dtype == torch.float32
    _, state = retention_decay_chunked(q, k, v, g, make_state(1, 2, 8, 8, torch.float16), chunk_size=4)
    assert state.dtype == torch.float16


def test_chunked_does_not_overflow_over_long_decays():
    """A strong decay over a long chunk: e^{gamma_i - gamma_j} above the diagonal would be e^{+1000}; it is masked
    before the exponential, so outputs and gradients stay finite."""
    q, k, v, _ = make_inputs(1, 1, 64, 4, 4)
    g = torch.full((1, 1, 64), -20.0, requires_grad=True)
    out, state = retention_decay_chunked(q, k, v, g, chunk_size=64)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(state).all() and torch.isfinite(g.grad).all()


def test_chunked_backward_matches_finite_differences():
    q, k, v, g = (t.double().requires_grad_() for t in make_inputs(1, 2, 6, 3, 2))
    initial = make_state(1, 2, 3, 2).double().requires_grad_()

    def forward(q, k, v, g, initial):  # chunks of 4 over 6 steps: the carry and the padding
        return retention_decay_chunked(q, k, v, g, initial, chunk_size=4)

    assert torch.autograd.gradcheck(forward, (q, k, v, g, initial))


# (dk, dv): one tile each, odd widths padded with masks, several dv tiles beside a wide dk
STEP_SHAPES = [(16, 32), (6, 13), (24, 40), (128, 72)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", STEP_SHAPES, ids=lambda d: f"dk{d[0]}-dv{d[1]}")
def test_triton_step_equals_reference(force_triton, device, dtype, dims):
    # the state pool is fp32 and passed as every other slot row (a strided view), as the engine hands the running
    # slots' rows; the other rows must not change
    dim_k, dim_v = dims
    q, k, v, g = make_inputs(3, 2, 4, dim_k, dim_v, dtype, device, seed=5)
    pool = make_state(6, 2, dim_k, dim_v, device=device)
    original = pool.clone()
    state = pool[1::2]
    ref_state = state.clone()
    out = steps(retention_decay_step_triton, q, k, v, g, state)
    ref_out = steps(retention_decay_step_ref, q, k, v, g, ref_state)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    torch.testing.assert_close(pool[1::2], ref_state, **STATE_TOLERANCE)
    assert torch.equal(pool[0::2], original[0::2]), "the kernel wrote rows it was not given"


def test_triton_step_fp16_state_broadcast_decay_and_scale(force_triton, device):
    """An fp16 state, a decay broadcast over the batch (stride 0, as the mixer passes its per-head decays)."""
    q, k, v, g = make_inputs(2, 2, 3, 24, 40, torch.float16, device)
    g = g[:1].expand(2, -1, -1)
    state = make_state(2, 2, 24, 40, torch.float16, device)
    ref_state = state.clone()
    out = steps(lambda *a: retention_decay_step_triton(*a, scale=0.5), q, k, v, g, state)
    ref_out = steps(lambda *a: retention_decay_step_ref(*a, scale=0.5), q, k, v, g, ref_state)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float16])
    torch.testing.assert_close(state, ref_state, atol=2e-3, rtol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is broken in the Triton interpreter")
def test_triton_step_bf16_on_gpu():
    """RetNet-1.3B-like heads: 8 of them, dk 256, dv 512 (expand_v 2), fp32 state."""
    q, k, v, g = make_inputs(4, 8, 1, 256, 512, torch.bfloat16, "cuda")
    state = make_state(4, 8, 256, 512, device="cuda")
    ref_state = state.clone()
    out = retention_decay_step_triton(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], state)
    ref_out = retention_decay_step_ref(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], ref_state)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_continues_the_sequence(monkeypatch, device):
    # the cached path the mixer takes: the chunked prefill hands its state to the steps, through both dispatch paths
    q, k, v, g = make_inputs(2, 2, 23, 12, 20, device=device)
    whole, _ = retention_decay_chunked(q, k, v, g, chunk_size=8)
    for forced in ["0", "1"] if triton_available() else ["0"]:
        monkeypatch.setenv(FORCE_TRITON_ENV, forced)
        prefix = 17
        out, state = retention_decay_chunked(*(t[:, :, :prefix] for t in (q, k, v, g)), chunk_size=8)
        tail = steps(retention_decay_step, *(t[:, :, prefix:] for t in (q, k, v, g)), state)
        torch.testing.assert_close(torch.cat([out, tail], dim=2), whole, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("forced", [False, True])
def test_dispatcher_routes_by_use_triton(monkeypatch, forced):
    if forced and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if forced else "0")
    called = []
    monkeypatch.setattr(retention_decay, "retention_decay_step_triton", lambda *a: called.append("triton"))
    monkeypatch.setattr(retention_decay, "retention_decay_step_ref", lambda *a: called.append("ref"))
    q, k, v, g = make_inputs(1, 2, 1, 8, 4)
    retention_decay_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], torch.zeros(1, 2, 8, 4))
    assert called == ["triton" if forced else "ref"]


STEP_BAD_SHAPES = {
    # name: (q, k, v, g, state, words in the message)
    "q_4d": ((2, 3, 1, 8), (2, 3, 1, 8), (2, 3, 1, 4), (2, 3), (2, 3, 8, 4), "(2, 3, 1, 8)"),
    "k_differs": ((2, 3, 8), (2, 3, 6), (2, 3, 4), (2, 3), (2, 3, 8, 4), "(2, 3, 6)"),
    "g": ((2, 3, 8), (2, 3, 8), (2, 3, 4), (2, 1), (2, 3, 8, 4), "g (2, 3)"),
    "state": ((2, 3, 8), (2, 3, 8), (2, 3, 4), (2, 3), (2, 3, 4, 8), "state (2, 3, 8, 4)"),
}
SEQUENCE_BAD_SHAPES = {
    # name: (q, k, v, g, state or None, words in the message)
    "v_length": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 4, 4), (2, 3, 5), None, "(2, 3, 4, 4)"),
    "g": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 4), (2, 3), None, "g (2, 3, 5)"),
    "state": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 4), (2, 3, 5), (2, 3, 8, 5), "state (2, 3, 8, 4)"),
}


@pytest.mark.parametrize("step", [retention_decay_step_ref, retention_decay_step_triton], ids=["ref", "triton"])
@pytest.mark.parametrize("case", STEP_BAD_SHAPES.values(), ids=STEP_BAD_SHAPES.keys())
def test_step_bad_shapes_raise(case, step):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        step(*(torch.zeros(shape) for shape in shapes))


@pytest.mark.parametrize("case", SEQUENCE_BAD_SHAPES.values(), ids=SEQUENCE_BAD_SHAPES.keys())
def test_chunked_bad_shapes_raise(case):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        retention_decay_chunked(*(None if shape is None else torch.zeros(shape) for shape in shapes))


def test_chunked_bad_chunk_size_raises():
    q, k, v, g = make_inputs(1, 1, 3, 4, 4)
    with pytest.raises(ValueError, match="chunk_size must be at least 1, got 0"):
        retention_decay_chunked(q, k, v, g, chunk_size=0)
