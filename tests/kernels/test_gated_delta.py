"""The gated delta rule: our chunked form and recurrent step equal transformers' Qwen3-Next reference functions (an
implementation we did not write), equal each other from any initial state, backpropagate correctly (gradcheck), and
the Triton decode step equals the PyTorch one (interpreter on CPU: fp32 and fp16)."""
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
# a plain import: without transformers' functions these tests fail rather than skip
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

import kernels.gated_delta as gated_delta
from kernels import FORCE_TRITON_ENV, triton_available
from kernels.gated_delta import gated_delta_chunked, gated_delta_step, gated_delta_step_ref, gated_delta_step_triton
from ssm.gated_deltanet import l2_normalize

# the PyTorch bodies: transformers' decorators would route to flash-linear-attention's kernels where it is installed
HF_CHUNK = inspect.unwrap(torch_chunk_gated_delta_rule)
HF_RECURRENT = inspect.unwrap(torch_recurrent_gated_delta_rule)

OUTSIDE_ATOL = 1e-4  # fp32 against transformers' fp32 reference
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=5e-3)}
STATE_TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def make_inputs(batch, heads, length, dim_k, dim_v, dtype=torch.float32, device="cpu", seed=0):
    """Raw (unnormalised) q, k, v [B, H, T, d] as strided slices of one fused projection, log decays g in about
    [-3, 0] and beta in (0, 1), [B, H, T]."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, heads, length, 2 * dim_k + dim_v, generator=gen)
    q, k, v = fused.split([dim_k, dim_k, dim_v], dim=-1)
    g = -F.softplus(torch.randn(batch, heads, length, generator=gen) - 1) * 2
    beta = torch.rand(batch, heads, length, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v)] + [g.to(device), beta.to(device)]


def make_state(batch, heads, dim_k, dim_v, dtype=torch.float32, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, dim_k, dim_v, generator=gen).to(device, dtype)


def to_hf(*tensors):
    """[B, H, T, ...] -> transformers' [B, T, H, ...]."""
    return [t.transpose(1, 2) for t in tensors]


def steps(step, q, k, v, g, beta, state):
    """Apply a step function token by token; the state is updated in place."""
    outs = [step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state) for t in range(q.shape[2])]
    return torch.stack(outs, dim=2) if outs else q.new_empty(v.shape)


# (batch, heads, length, dk, dv, chunk, q/k scale): under a chunk, ragged over several chunks, an exact multiple,
# odd widths; the last with |q|, |k| ~ 0.1, where the L2 norm's eps is no longer negligible
OUTSIDE_SHAPES = [(1, 2, 7, 8, 8, 64, 1.0), (2, 3, 100, 16, 24, 64, 1.0), (2, 2, 64, 32, 16, 16, 1.0),
                  (1, 2, 45, 24, 40, 16, 1.0), (2, 2, 30, 16, 16, 16, 0.03)]


@pytest.mark.parametrize("with_initial", [False, True], ids=["zeros", "initial"])
@pytest.mark.parametrize("shape", OUTSIDE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chunked_and_recurrent_equal_transformers(shape, with_initial):
    batch, heads, length, dim_k, dim_v, chunk, qk_scale = shape
    q, k, v, g, beta = make_inputs(batch, heads, length, dim_k, dim_v)
    q, k = q * qk_scale, k * qk_scale
    initial = make_state(batch, heads, dim_k, dim_v) if with_initial else None
    # transformers normalises q and k itself when asked (as Qwen3-Next asks); ours takes them normalised by the mixer
    hf_chunk_out, hf_chunk_state = HF_CHUNK(*to_hf(q, k, v, g, beta), chunk_size=chunk, initial_state=initial,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_rec_out, hf_rec_state = HF_RECURRENT(*to_hf(q, k, v, g, beta), initial_state=initial,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k = l2_normalize(q), l2_normalize(k)
    out, state = gated_delta_chunked(q, k, v, g, beta, initial, chunk_size=chunk)
    step_state = torch.zeros(batch, heads, dim_k, dim_v) if initial is None else initial.clone()
    step_out = steps(gated_delta_step_ref, q, k, v, g, beta, step_state)
    for name, got, want in [("chunked out", out, hf_chunk_out.transpose(1, 2)),
                            ("chunked state", state, hf_chunk_state),
                            ("recurrent out", step_out, hf_rec_out.transpose(1, 2)),
                            ("recurrent state", step_state, hf_rec_state)]:
        err = (got - want).abs().max().item()
        assert err <= OUTSIDE_ATOL, f"{name} differs from transformers by {err:.3g}"


@pytest.mark.parametrize("length", [0, 1, 7, 64, 100])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_chunked_equals_steps_from_a_state(length, chunk_size):
    q, k, v, g, beta = make_inputs(2, 3, length, 12, 20)
    q, k = l2_normalize(q), l2_normalize(k)
    initial = make_state(2, 3, 12, 20)
    out, state = gated_delta_chunked(q, k, v, g, beta, initial, chunk_size=chunk_size)
    step_state = initial.clone()
    step_out = steps(gated_delta_step_ref, q, k, v, g, beta, step_state)
    torch.testing.assert_close(out, step_out, **TOLERANCE[torch.float32])
    torch.testing.assert_close(state, step_state, **STATE_TOLERANCE)
    assert state.data_ptr() != initial.data_ptr(), "the final state must be a new tensor, not the caller's"


def test_chunked_keeps_dtypes():
    q, k, v, g, beta = make_inputs(1, 2, 9, 8, 8, dtype=torch.float16)
    out, state = gated_delta_chunked(l2_normalize(q), l2_normalize(k), v, g, beta, chunk_size=4)
    assert out.dtype == torch.float16 and state.dtype == torch.float32
    _, state = gated_delta_chunked(l2_normalize(q), l2_normalize(k), v, g, beta,
                                   make_state(1, 2, 8, 8, torch.float16), chunk_size=4)
    assert state.dtype == torch.float16


def test_chunked_backward_matches_finite_differences():
    q, k, v, g, beta = (t.double().requires_grad_() for t in make_inputs(1, 2, 6, 3, 2))
    initial = make_state(1, 2, 3, 2).double().requires_grad_()

    def forward(q, k, v, g, beta, initial):  # chunks of 4 over 6 steps: the solve, the carry and the padding
        return gated_delta_chunked(l2_normalize(q), l2_normalize(k), v, g, beta, initial, chunk_size=4)

    assert torch.autograd.gradcheck(forward, (q, k, v, g, beta, initial))


# (dk, dv): one tile each, odd widths padded with masks, several dv tiles beside a wide dk
STEP_SHAPES = [(16, 16), (24, 40), (128, 72)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", STEP_SHAPES, ids=lambda d: f"dk{d[0]}-dv{d[1]}")
def test_triton_step_equals_reference(force_triton, device, dtype, dims):
    # the state pool is fp32 and passed as every other slot row (a strided view), as the engine hands the running
    # slots' rows; the other rows must not change
    dim_k, dim_v = dims
    q, k, v, g, beta = make_inputs(3, 2, 4, dim_k, dim_v, dtype, device, seed=5)
    q, k = l2_normalize(q.float()).to(dtype), l2_normalize(k.float()).to(dtype)
    pool = make_state(6, 2, dim_k, dim_v, device=device)
    original = pool.clone()
    state = pool[1::2]
    ref_state = state.clone()
    out = steps(gated_delta_step_triton, q, k, v, g, beta, state)
    ref_out = steps(gated_delta_step_ref, q, k, v, g, beta, ref_state)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    torch.testing.assert_close(pool[1::2], ref_state, **STATE_TOLERANCE)
    assert torch.equal(pool[0::2], original[0::2]), "the kernel wrote rows it was not given"


def test_triton_step_fp16_state_and_scale(force_triton, device):
    q, k, v, g, beta = make_inputs(2, 2, 3, 24, 40, torch.float16, device)
    state = make_state(2, 2, 24, 40, torch.float16, device)
    ref_state = state.clone()
    out = steps(lambda *a: gated_delta_step_triton(*a, scale=0.5), q, k, v, g, beta, state)
    ref_out = steps(lambda *a: gated_delta_step_ref(*a, scale=0.5), q, k, v, g, beta, ref_state)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float16])
    torch.testing.assert_close(state, ref_state, atol=2e-3, rtol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is broken in the Triton interpreter")
def test_triton_step_bf16_on_gpu():
    q, k, v, g, beta = make_inputs(4, 32, 1, 128, 128, torch.bfloat16, "cuda")
    q, k = l2_normalize(q.float()).bfloat16(), l2_normalize(k.float()).bfloat16()
    state = make_state(4, 32, 128, 128, device="cuda")
    ref_state = state.clone()
    out = gated_delta_step_triton(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], state)
    ref_out = gated_delta_step_ref(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], ref_state)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_continues_the_sequence(monkeypatch, device):
    # the cached path the mixer takes: the chunked prefill hands its state to the steps, through both dispatch paths
    q, k, v, g, beta = make_inputs(2, 2, 23, 12, 20, device=device)
    q, k = l2_normalize(q), l2_normalize(k)
    whole, _ = gated_delta_chunked(q, k, v, g, beta, chunk_size=8)
    for forced in ["0", "1"] if triton_available() else ["0"]:
        monkeypatch.setenv(FORCE_TRITON_ENV, forced)
        prefix = 17
        out, state = gated_delta_chunked(*(t[:, :, :prefix] for t in (q, k, v, g, beta)), chunk_size=8)
        tail = steps(gated_delta_step, *(t[:, :, prefix:] for t in (q, k, v, g, beta)), state)
        torch.testing.assert_close(torch.cat([out, tail], dim=2), whole, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("forced", [False, True])
def test_dispatcher_routes_by_use_triton(monkeypatch, forced):
    if forced and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if forced else "0")
    called = []
    monkeypatch.setattr(gated_delta, "gated_delta_step_triton", lambda *a: called.append("triton"))
    monkeypatch.setattr(gated_delta, "gated_delta_step_ref", lambda *a: called.append("ref"))
    q, k, v, g, beta = make_inputs(1, 2, 1, 8, 4)
    gated_delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], torch.zeros(1, 2, 8, 4))
    assert called == ["triton" if forced else "ref"]


STEP_BAD_SHAPES = {
    # name: (q, k, v, g, beta, state, words in the message)
    "q_4d": ((2, 3, 1, 8), (2, 3, 1, 8), (2, 3, 1, 4), (2, 3), (2, 3), (2, 3, 8, 4), "(2, 3, 1, 8)"),
    "k_differs": ((2, 3, 8), (2, 3, 6), (2, 3, 4), (2, 3), (2, 3), (2, 3, 8, 4), "(2, 3, 6)"),
    "g": ((2, 3, 8), (2, 3, 8), (2, 3, 4), (2, 1), (2, 3), (2, 3, 8, 4), "g and beta (2, 3)"),
    "state": ((2, 3, 8), (2, 3, 8), (2, 3, 4), (2, 3), (2, 3), (2, 3, 4, 8), "state (2, 3, 8, 4)"),
}
SEQUENCE_BAD_SHAPES = {
    # name: (q, k, v, g, beta, state or None, words in the message)
    "v_length": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 4, 4), (2, 3, 5), (2, 3, 5), None, "(2, 3, 4, 4)"),
    "beta": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 4), (2, 3, 5), (2, 3), None, "g and beta (2, 3, 5)"),
    "state": ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 4), (2, 3, 5), (2, 3, 5), (2, 3, 8, 5), "state (2, 3, 8, 4)"),
}


@pytest.mark.parametrize("step", [gated_delta_step_ref, gated_delta_step_triton], ids=["ref", "triton"])
@pytest.mark.parametrize("case", STEP_BAD_SHAPES.values(), ids=STEP_BAD_SHAPES.keys())
def test_step_bad_shapes_raise(case, step):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        step(*(torch.zeros(shape) for shape in shapes))


@pytest.mark.parametrize("case", SEQUENCE_BAD_SHAPES.values(), ids=SEQUENCE_BAD_SHAPES.keys())
def test_chunked_bad_shapes_raise(case):
    *shapes, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        gated_delta_chunked(*(None if shape is None else torch.zeros(shape) for shape in shapes))


def test_chunked_bad_chunk_size_raises():
    q, k, v, g, beta = make_inputs(1, 1, 3, 4, 4)
    with pytest.raises(ValueError, match="chunk_size must be at least 1, got 0"):
        gated_delta_chunked(q, k, v, g, beta, chunk_size=0)
