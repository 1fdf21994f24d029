"""The CPU prompt scan and its backward (kernels/cpu/selective_scan.c) against ssm/scan.py's loop and a float64 recurrence."""
import pytest
import torch

from kernels import cpu_decode
from ssm.mamba import selective_scan
from ssm.scan import SelectiveScan, scan_backward, scan_forward


def make_inputs(batch, length, channels, dstate, seed=0):
    """Inputs as Mamba makes them: dt after softplus (>= 0), A = -exp(A_log) < 0, a nonzero starting state."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.nn.functional.softplus(torch.randn(batch, length, channels, generator=g) - 1)
    A = -torch.exp(torch.randn(channels, dstate, generator=g))
    dtx = dt * torch.randn(batch, length, channels, generator=g)
    B, C = (torch.randn(batch, length, dstate, generator=g) for _ in range(2))
    h0 = torch.randn(batch, channels, dstate, generator=g)
    return dt, A, dtx, B, C, h0


def float64_scan(dt, A, dtx, B, C, h0):
    dt, A, dtx, B, C, h = (t.double() for t in (dt, A, dtx, B, C, h0))
    ys = []
    for t in range(dt.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + dtx[:, t, :, None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("batch,length,channels,dstate", [(1, 1, 8, 1), (2, 37, 64, 16), (3, 5, 24, 24), (1, 9, 16, 130)])
def test_matches_the_loop_and_float64(batch, length, channels, dstate):
    inputs = make_inputs(batch, length, channels, dstate)
    h0 = inputs[-1].clone()
    y, h = cpu_decode.selective_scan_cpu(*inputs)
    assert torch.equal(inputs[-1], h0)  # the starting state is read, not overwritten
    ref_y, ref_h, _ = scan_forward(*inputs, keep_states=False)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    exact_y, exact_h = float64_scan(*inputs)
    torch.testing.assert_close(y.double(), exact_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), exact_h, atol=1e-5, rtol=1e-5)


def test_decays_that_underflow_and_zero_steps():
    """exp of very negative dt*A is 0 to fp32 (the kernel clamps its argument); dt = 0 keeps the state as it is."""
    dt, A, dtx, B, C, h0 = make_inputs(1, 6, 8, 4)
    dt[0, 1] = 500.0  # dt * A far below -87: the state forgets everything before this step
    dt[0, 3:], dtx[0, 3:] = 0.0, 0.0  # a right-padded row's tail: the state stops changing
    y, h = cpu_decode.selective_scan_cpu(dt, A, dtx, B, C, h0)
    exact_y, exact_h = float64_scan(dt, A, dtx, B, C, h0)
    torch.testing.assert_close(y.double(), exact_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), exact_h, atol=1e-5, rtol=1e-5)


def test_mamba_prefill_runs_the_kernel(monkeypatch):
    """selective_scan (ssm/mamba.py) sends an inference scan on CPU to the kernel, and its result equals the loop's."""
    calls = []
    kernel = cpu_decode.selective_scan_cpu
    monkeypatch.setattr(cpu_decode, "selective_scan_cpu", lambda *args: calls.append(1) or kernel(*args))
    dt, A, dtx, B, C, h0 = make_inputs(2, 11, 16, 8)
    x, z, D = dtx / dt.clamp_min(1e-3), torch.randn(2, 11, 16), torch.randn(16)
    with torch.no_grad():
        y, h = selective_scan(x, dt, A, B, C, D, z, h0)
    assert calls
    monkeypatch.setattr(cpu_decode, "cpu_kernels_available", lambda: False)
    with torch.no_grad():
        ref_y, ref_h = selective_scan(x, dt, A, B, C, D, z, h0)
    assert len(calls) == 1
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)


def test_sizes_beyond_the_kernel_are_refused():
    assert not cpu_decode.selective_scan_fits(12, 16) and not cpu_decode.selective_scan_fits(16, 2000)
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_decode.selective_scan_cpu(*make_inputs(1, 2, 12, 4))


# ---- the backward, for training -------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch,length,channels,dstate", [(1, 1, 8, 1), (2, 37, 64, 16), (3, 5, 24, 24), (2, 9, 16, 130)])
@pytest.mark.parametrize("with_last", [False, True], ids=["no-final-grad", "final-grad"])
def test_backward_matches_the_loop_and_float64_autograd(batch, length, channels, dstate, with_last):
    inputs = make_inputs(batch, length, channels, dstate)
    g = torch.Generator().manual_seed(1)
    grad_y = torch.randn(batch, length, channels, generator=g)
    grad_last = torch.randn(batch, channels, dstate, generator=g) if with_last else None
    got = cpu_decode.selective_scan_backward_cpu(*inputs, grad_y, grad_last)
    _, _, states = scan_forward(*inputs, keep_states=True)
    loop = scan_backward(*inputs, states, grad_y, grad_last)
    # autograd through the plain float64 recurrence: an oracle neither backward shares code with
    exact_inputs = [t.double().requires_grad_() for t in inputs]
    y, h = float64_scan(*exact_inputs)
    loss = (y * grad_y.double()).sum() + (0 if grad_last is None else (h * grad_last.double()).sum())
    exact = torch.autograd.grad(loss, exact_inputs)
    for name, a, b, c in zip(("dt", "A", "dtx", "B", "C", "h0"), got, loop, exact):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name} vs the loop: {m}")
        torch.testing.assert_close(a.double(), c, atol=1e-4, rtol=1e-5, msg=lambda m: f"d{name} vs float64: {m}")


def test_training_scan_runs_the_kernel_both_ways(monkeypatch):
    """SelectiveScan (what Mamba trains through) takes the compiled kernel forward and backward on CPU fp32, and
    its gradients equal the step-by-step reference's."""
    inputs = make_inputs(2, 21, 32, 16)
    calls = []
    for name in ("selective_scan_cpu", "selective_scan_backward_cpu"):
        monkeypatch.setattr(cpu_decode, name, lambda *a, real=getattr(cpu_decode, name), name=name: calls.append(name) or real(*a))
    leaves = [t.clone().requires_grad_() for t in inputs]
    y, h = SelectiveScan.apply(*leaves)
    (y.square().sum() + h.sum()).backward()
    assert calls == ["selective_scan_cpu", "selective_scan_backward_cpu"]
    monkeypatch.setattr("ssm.scan.compiled_kernel_fits", lambda dt, A: False)  # the torch-op reference
    reference = [t.clone().requires_grad_() for t in inputs]
    y_ref, h_ref = SelectiveScan.apply(*reference)
    (y_ref.square().sum() + h_ref.sum()).backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(leaves, reference):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
