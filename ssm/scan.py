"""Mamba's selective scan for training: the recurrence step by step, with a hand-written backward.

On CPU in fp32 both directions run the compiled kernel (kernels/cpu/selective_scan.c): one pass over the sequence
per (sequence, 8 channels), the backward replaying the forward's states instead of keeping them. Elsewhere, and as
the reference the kernel is tested against, the steps run as torch ops: autograd through a Python loop would record
~6 small ops per token and keep each one's inputs, and precomputing every step's decay as one [T, b, d, n] tensor
streams tensors far larger than cache, so this Function runs each step on [b, d, n] tensors that stay in cache,
saves only the states, and walks back through them in backward. Contractions are multiply-then-sum: CPU bmm on
[b, d, n] @ [b, n, 1] loops over b and is ~4x slower.
"""
import torch

from kernels import cpu_decode
from kernels.dispatch import use_cpu_kernel


def compiled_kernel_fits(dt: torch.Tensor, A: torch.Tensor) -> bool:
    return dt.dtype == torch.float32 and use_cpu_kernel(dt) and cpu_decode.selective_scan_fits(*A.shape)


def scan_forward(dt, A, dtx, B, C, h0, keep_states: bool):
    """h_t = exp(dt_t A) h_{t-1} + (dt_t x_t) B_t, y_t = h_t C_t over t = 0..T-1, in place on [b, d, n] buffers.

    dt, dtx: [b, T, d]; A: [d, n]; B, C: [b, T, n]; h0: [b, d, n] (not modified).
    Returns y [b, T, d], the final state [b, d, n], and every state [T, b, d, n] when keep_states (for backward).
    """
    t = dt.shape[1]
    dts, dtxs = dt.transpose(0, 1).unsqueeze(-1), dtx.transpose(0, 1).unsqueeze(-1)  # [T, b, d, 1]
    Bs, Cs = B.transpose(0, 1).unsqueeze(2), C.transpose(0, 1).unsqueeze(2)  # [T, b, 1, n]
    hs = h0.new_empty(t, *h0.shape) if keep_states else None
    ys = h0.new_empty(t, *h0.shape[:2])
    decay, product = torch.empty_like(h0), torch.empty_like(h0)
    h = h0.clone()
    for i in range(t):
        torch.exp(torch.mul(dts[i], A, out=decay), out=decay)
        h = torch.mul(decay, h, out=hs[i]) if keep_states else h.mul_(decay)
        h.addcmul_(dtxs[i], Bs[i])
        torch.sum(torch.mul(h, Cs[i], out=product), -1, out=ys[i])
    return ys.transpose(0, 1), h, hs


class SelectiveScan(torch.autograd.Function):
    """scan_forward with autograd: returns y [b, T, d] and the final state [b, d, n]."""

    @staticmethod
    def forward(ctx, dt, A, dtx, B, C, h0):
        ctx.compiled = compiled_kernel_fits(dt, A)
        if ctx.compiled:  # the backward replays the states: none kept
            ys, h = cpu_decode.selective_scan_cpu(dt, A, dtx, B, C, h0)
            ctx.save_for_backward(dt, A, dtx, B, C, h0)
            return ys, h
        ys, h, hs = scan_forward(dt, A, dtx, B, C, h0, keep_states=True)
        ctx.save_for_backward(dt, A, dtx, B, C, h0, hs)
        return ys, h.clone()

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        if ctx.compiled:
            return cpu_decode.selective_scan_backward_cpu(*ctx.saved_tensors, grad_y, grad_last)
        return scan_backward(*ctx.saved_tensors, grad_y, grad_last)


def scan_backward(dt, A, dtx, B, C, h0, hs, grad_y, grad_last):
    """SelectiveScan's gradients from the kept states hs [T, b, d, n], step by step backwards (the reference)."""
    t = dt.shape[1]
    dts, dtxs = dt.transpose(0, 1).unsqueeze(-1), dtx.transpose(0, 1).unsqueeze(-1)  # [T, b, d, 1]
    Bs, Cs = B.transpose(0, 1).unsqueeze(2), C.transpose(0, 1).unsqueeze(2)  # [T, b, 1, n]
    gys = grad_y.transpose(0, 1).unsqueeze(-1)  # [T, b, d, 1]
    grad_dt, grad_dtx = torch.empty_like(dts[..., 0]), torch.empty_like(dtxs[..., 0])  # [T, b, d]
    grad_B, grad_C = torch.empty_like(Bs[:, :, 0]), torch.empty_like(Cs[:, :, 0])  # [T, b, n]
    grad_A = torch.zeros_like(h0)  # summed over the batch at the end
    carry = torch.zeros_like(h0) if grad_last is None else grad_last.clone()  # dL/dh_t from later steps
    decay, grad_h, product = torch.empty_like(h0), torch.empty_like(h0), torch.empty_like(h0)
    for i in range(t - 1, -1, -1):
        previous = hs[i - 1] if i else h0
        torch.sum(torch.mul(hs[i], gys[i], out=product), 1, out=grad_C[i])  # y_t = h_t C_t
        torch.addcmul(carry, gys[i], Cs[i], out=grad_h)  # dL/dh_t
        torch.sum(torch.mul(grad_h, Bs[i], out=product), -1, out=grad_dtx[i])
        torch.sum(torch.mul(grad_h, dtxs[i], out=product), 1, out=grad_B[i])
        torch.exp(torch.mul(dts[i], A, out=decay), out=decay)
        torch.mul(grad_h, previous, out=product).mul_(decay)  # d/d(dt A) of exp(dt A) h_{t-1}
        grad_A.addcmul_(product, dts[i])
        torch.sum(product.mul_(A), -1, out=grad_dt[i])
        carry, grad_h = grad_h.mul_(decay), carry  # the two buffers swap roles each step
    return (grad_dt.transpose(0, 1), grad_A.sum(0), grad_dtx.transpose(0, 1), grad_B.transpose(0, 1),
            grad_C.transpose(0, 1), carry)
