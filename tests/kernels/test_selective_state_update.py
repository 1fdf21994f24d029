import importlib
import math
import re

import pytest
import torch

from kernels import (
    FORCE_TRITON_ENV,
    cpu_kernels_available,
    selective_state_update,
    selective_state_update_ref,
    selective_state_update_triton,
    triton_available,
)

# `kernels.selective_state_update` is the exported function (it shadows its module's name on the package)
ssu_module = importlib.import_module("kernels.selective_state_update")

# y is a sum of dstate products of O(1) terms; fp16 inputs and outputs carry ~1e-3 relative error
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
OPTIONS = {
    "plain": dict(),
    "all": dict(D=True, z=True, dt_bias=True, dt_softplus=True),
    "D_z": dict(D=True, z=True),
    "bias_softplus": dict(dt_bias=True, dt_softplus=True),
}
# name: (heads, head_dim, dstate, groups); heads None = the Mamba-1 layout. Non-powers of two on purpose.
LAYOUTS = {
    "mamba1": (None, 24, 16, 1),
    "mamba1_dstate5": (None, 10, 5, 1),
    "mamba1_dstate21": (None, 6, 21, 1),  # the CPU kernel's 8-lane exp over A's row, then a scalar tail
    "mamba2_g1": (4, 12, 16, 1),
    "mamba2_g2": (4, 12, 16, 2),
}


def make_inputs(layout, dtype, device, D=False, z=False, dt_bias=False, dt_softplus=False, batch=3, dense=False):
    """Inputs as the mixers pass them: Mamba-2's per-head dt, A, D and dt_bias as stride-0 views over
    head_dim (and dstate) unless `dense`; x and z strided slices of one fused projection."""
    heads, head_dim, dstate, groups = layout
    gen = torch.Generator().manual_seed(head_dim * 100 + dstate)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    rows = (batch, head_dim) if heads is None else (batch, heads, head_dim)
    per_row = (head_dim,) if heads is None else (heads, head_dim)
    fused = randn(*rows[:-1], 2 * head_dim).to(device, dtype)  # [x ; z] per row, as in_proj leaves them
    x, gate = fused[..., :head_dim], fused[..., head_dim:]
    if heads is None or dense:
        dt = (0.5 * randn(*rows)).to(device, dtype)
        A = -torch.rand(*per_row, dstate, generator=gen).to(device) - 0.1
        bias = randn(*per_row).to(device)
        skip = randn(*per_row).to(device)
    else:  # one value per head, broadcast with stride 0
        dt = (0.5 * randn(batch, heads, 1)).to(device, dtype).expand(*rows)
        A = (-torch.rand(heads, 1, 1, generator=gen) - 0.1).to(device).expand(heads, head_dim, dstate)
        bias = randn(heads, 1).to(device).expand(heads, head_dim)
        skip = randn(heads, 1).to(device).expand(heads, head_dim)
    if dt_softplus:
        # above softplus's threshold (20) the identity branch is taken
        dt = dt.clone()
        dt.view(-1)[0] = 25.0
    bc_shape = (batch, dstate) if heads is None else (batch, groups, dstate)
    B, C = randn(*bc_shape).to(device, dtype), randn(*bc_shape).to(device, dtype)
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=skip if D else None, z=gate if z else None,
                dt_bias=bias if dt_bias else None, dt_softplus=dt_softplus)


def make_state(layout, dtype, device, batch=3):
    heads, head_dim, dstate, _ = layout
    shape = (batch, head_dim, dstate) if heads is None else (batch, heads, head_dim, dstate)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(device, dtype)


def naive_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """Float64, one (slot, head, row) at a time; returns (new state, y) and leaves the inputs alone."""
    if state.dim() == 3:  # Mamba-1: one head, one group
        state, x, dt, A, B, C = state[:, None], x[:, None], dt[:, None], A[None], B[:, None], C[:, None]
        D, z, dt_bias = (None if t is None else t[None] if t.dim() == 1 else t[:, None] for t in (D, z, dt_bias))
        new_state, y = naive_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
        return new_state[:, 0], y[:, 0]
    state = state.double().clone()
    batch, heads, head_dim, _ = state.shape
    y = torch.empty(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // B.shape[1])
            for p in range(head_dim):
                step = float(dt[b, h, p]) + (float(dt_bias[h, p]) if dt_bias is not None else 0.0)
                if dt_softplus:
                    step = math.log1p(math.exp(step)) if step <= 20 else step
                xv = float(x[b, h, p])
                state[b, h, p] = state[b, h, p] * torch.exp(A[h, p].double() * step) + step * B[b, g].double() * xv
                out = float((state[b, h, p] * C[b, g].double()).sum())
                if D is not None:
                    out += float(D[h, p]) * xv
                if z is not None:
                    gate = float(z[b, h, p])
                    out *= gate / (1 + math.exp(-gate))
                y[b, h, p] = out
    return state, y


def check(update, layout, dtype, device, options, state=None, **input_kwargs):
    inputs = make_inputs(layout, dtype, device, **options, **input_kwargs)
    state = make_state(layout, dtype, device) if state is None else state
    expected_state, expected_y = naive_update(state.cpu(), **{k: (v.cpu() if torch.is_tensor(v) else v)
                                                             for k, v in inputs.items()})
    y = update(state, **inputs)
    assert y.dtype == dtype and y.shape == inputs["x"].shape and state.dtype == dtype
    torch.testing.assert_close(y.cpu().double(), expected_y, **TOLERANCE[dtype])
    torch.testing.assert_close(state.cpu().double(), expected_state, **TOLERANCE[dtype])
    return state, y


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_reference_matches_float64_loop(layout, options):
    check(selective_state_update_ref, layout, torch.float32, "cpu", options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_triton_matches_reference_and_loop(force_triton, device, layout, options, dtype):
    state, y = check(selective_state_update_triton, layout, dtype, device, options)
    ref_state = make_state(layout, dtype, device)
    ref_y = selective_state_update_ref(ref_state, **make_inputs(layout, dtype, device, **options))
    torch.testing.assert_close(y, ref_y, **TOLERANCE[dtype])
    torch.testing.assert_close(state, ref_state, **TOLERANCE[dtype])


def cpu_kernel(state, **inputs):
    """The dispatcher on CPU tensors: the compiled kernel (kernels/cpu/selective_state_update.c)."""
    if not cpu_kernels_available():
        pytest.skip("no C compiler on this machine")
    return selective_state_update(state, **inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_cpu_kernel_matches_reference_and_loop(layout, options, dtype):
    state, y = check(cpu_kernel, layout, dtype, "cpu", options)
    ref_state = make_state(layout, dtype, "cpu")
    ref_y = selective_state_update_ref(ref_state, **make_inputs(layout, dtype, "cpu", **options))
    torch.testing.assert_close(y, ref_y, **TOLERANCE[dtype])
    torch.testing.assert_close(state, ref_state, **TOLERANCE[dtype])


def test_cpu_kernel_bf16_state():
    """A bf16 model keeps a bf16 state: read, updated in fp32, rounded back like the reference."""
    layout = LAYOUTS["mamba2_g2"]
    state, ref_state = make_state(layout, torch.bfloat16, "cpu"), make_state(layout, torch.bfloat16, "cpu")
    y = cpu_kernel(state, **make_inputs(layout, torch.bfloat16, "cpu", **OPTIONS["all"]))
    ref_y = selective_state_update_ref(ref_state, **make_inputs(layout, torch.bfloat16, "cpu", **OPTIONS["all"]))
    torch.testing.assert_close(y, ref_y, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=2e-2, rtol=2e-2)


UPDATES = [selective_state_update_ref, selective_state_update_triton, cpu_kernel]


@pytest.mark.parametrize("update", UPDATES, ids=["ref", "triton", "cpu"])
def test_dense_mamba2_inputs(monkeypatch, device, update):
    # per-element dt, A, D, dt_bias (no stride-0 broadcast): the general Mamba-2 form
    if update is selective_state_update_triton:
        pytest.importorskip("triton")
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    check(update, LAYOUTS["mamba2_g2"], torch.float32, device, OPTIONS["all"], dense=True)


@pytest.mark.parametrize("update", UPDATES, ids=["ref", "triton", "cpu"])
def test_state_is_a_strided_view_of_the_slot_pool(monkeypatch, device, update):
    # the engine passes the running slots' rows of its pool: here every other row of a 7-slot pool, with the
    # pool stored dstate-major (P and N strides swapped), so only the viewed rows may change
    if update is selective_state_update_triton:
        pytest.importorskip("triton")
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    layout = LAYOUTS["mamba2_g2"]
    heads, head_dim, dstate, _ = layout
    pool = torch.randn(7, heads, dstate, head_dim, generator=torch.Generator().manual_seed(3)).to(device)
    pool = pool.transpose(2, 3)  # [slots, H, P, N] with a non-unit N stride
    original = pool.clone()
    state = pool[1::2]
    assert not state.is_contiguous()
    check(update, layout, torch.float32, device, OPTIONS["all"], state=state)
    assert not torch.equal(pool[1::2], original[1::2])
    torch.testing.assert_close(pool[0::2], original[0::2], atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is broken in the Triton interpreter")
def test_triton_bf16_on_gpu():
    layout = (24, 64, 128, 1)  # a Mamba-2 2.7B-like head shape
    inputs = make_inputs(layout, torch.bfloat16, "cuda", **OPTIONS["all"], batch=16)
    state, ref_state = make_state(layout, torch.float32, "cuda", 16), make_state(layout, torch.float32, "cuda", 16)
    y = selective_state_update_triton(state, **inputs)
    torch.testing.assert_close(y, selective_state_update_ref(ref_state, **inputs), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


BAD_SHAPES = {
    # name: (state, x, dt, A, B, C, D, words in the message)
    "state_2d": ((3, 24), (3, 24), (3, 24), (24, 16), (3, 16), (3, 16), None, "(3, 24)"),
    "x_mismatch": ((3, 24, 16), (3, 20), (3, 24), (24, 16), (3, 16), (3, 16), None, "x has shape (3, 20)"),
    "A_mismatch": ((3, 4, 12, 16), (3, 4, 12), (3, 4, 12), (4, 12, 8), (3, 1, 16), (3, 1, 16), None, "A has shape"),
    "A_mamba1_rank": ((3, 24, 16), (3, 24), (3, 24), (1, 24, 16), (3, 16), (3, 16), None, "A has shape (1, 24, 16)"),
    "B_mamba2_rank": ((3, 4, 12, 16), (3, 4, 12), (3, 4, 12), (4, 12, 16), (3, 16), (3, 16), None, "[B, G, N]"),
    "B_dstate": ((3, 4, 12, 16), (3, 4, 12), (3, 4, 12), (4, 12, 16), (3, 1, 8), (3, 1, 8), None, "(3, 1, 8)"),
    "groups": ((3, 4, 12, 16), (3, 4, 12), (3, 4, 12), (4, 12, 16), (3, 3, 16), (3, 3, 16), None, "3 groups"),
    "D_mismatch": ((3, 4, 12, 16), (3, 4, 12), (3, 4, 12), (4, 12, 16), (3, 1, 16), (3, 1, 16), (4,), "D has shape"),
}


@pytest.mark.parametrize("update", [selective_state_update_ref, selective_state_update_triton], ids=["ref", "triton"])
@pytest.mark.parametrize("case", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_bad_shapes_raise(case, update):
    *shapes, D_shape, message = case
    state, x, dt, A, B, C = (torch.zeros(shape) for shape in shapes)
    D = None if D_shape is None else torch.zeros(D_shape)
    with pytest.raises(ValueError, match=re.escape(message)):
        update(state, x, dt, A, B, C, D=D)


@pytest.mark.parametrize("forced", [False, True])
def test_dispatcher_routes_by_use_triton(monkeypatch, forced):
    if forced and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if forced else "0")
    called = []
    monkeypatch.setattr(ssu_module, "selective_state_update_triton", lambda *a: called.append("triton"))
    monkeypatch.setattr(ssu_module, "selective_state_update_ref", lambda *a: called.append("ref"))
    monkeypatch.setattr(ssu_module.cpu_decode, "selective_state_update_cpu", lambda *a, **k: called.append("cpu") or a[1])
    layout = LAYOUTS["mamba1"]
    selective_state_update(make_state(layout, torch.float32, "cpu"), **make_inputs(layout, torch.float32, "cpu"))
    unforced = "cpu" if cpu_kernels_available() else "ref"
    assert called == ["triton" if forced else unforced]
