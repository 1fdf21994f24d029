"""kernels/cpu/ops.cpp: the hot ops' CPU kernels in C++ (the GEMVs, decode attention) call the same C kernels as the
Python glue, so the two give bit-identical outputs, and refuse what the kernels do not take with the same kind of
error. (Every test that calls these ops, here and in test_cpu_decode.py, runs the C++ glue where it built.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_decode, cpu_kernels_available
from zoo.quantize import quantize_int4, quantize_int8

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not cpu_kernels_available() or not cpu_decode.glue_available(),
                                reason="the C kernels or the C++ glue did not build here (a warning said why)")


def test_the_ops_cpu_kernels_are_the_glue():
    for op in ("dense_gemv", "quantized_gemv", "decode_attention", "rms_norm", "rotary", "swiglu_gemv"):
        cpu_line = next(line for line in torch._C._dispatch_dump(f"archzoo::{op}").splitlines()
                        if line.startswith("CPU:"))
        assert "ops.cpp" in cpu_line, cpu_line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 100), (3, 1, 256), (16, 1030)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_glue_equals_the_python_glue(dtype, shape, bias):
    generator = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=generator).to(dtype)
    weight = torch.randn(37, shape[-1], generator=generator).to(dtype)
    b = torch.randn(37, generator=generator).to(dtype) if bias else None
    got, want = cpu_decode.dense_gemv(x, weight, b), cpu_decode.dense_gemv_eager(x, weight, b)
    assert got.shape == (*shape[:-1], 37) and got.dtype == dtype
    assert torch.equal(got, want)


def test_dense_glue_takes_strided_rows():
    x = torch.randn(5, 200)[:, 7:107]  # rows 200 apart
    weight = torch.randn(37, 100)
    assert torch.equal(cpu_decode.dense_gemv(x, weight, None), cpu_decode.dense_gemv_eager(x, weight, None))
    columns = torch.randn(5, 200)[:, ::2]  # a column stride: copied
    assert torch.equal(cpu_decode.dense_gemv(columns, weight, None), cpu_decode.dense_gemv_eager(columns, weight, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [0, 32])
def test_quantized_glue_equals_the_python_glue(dtype, group):
    generator = torch.Generator().manual_seed(group)
    weight = torch.randn(40, 128, generator=generator)
    x = torch.randn(2, 1, 128, generator=generator).to(dtype)
    if group:
        q, scales, zeros = quantize_int4(weight, group)
        args = (q, scales.to(dtype), zeros, group)  # zeros in fp32: both glues cast them to the scales' dtype
    else:
        q, scales = quantize_int8(weight)
        args = (q, scales.to(dtype), None, 0)
    got, want = cpu_decode.quantized_gemv(x, *args), cpu_decode.quantized_gemv_eager(x, *args)
    assert got.shape == (2, 1, 40) and got.dtype == dtype
    assert torch.equal(got, want)


def attention_cases():
    """(args, kwargs) of decode_attention for each layout and option its glue maps: a paged pool (int64 table and
    lengths, a window with sinks), contiguous rows (a ring with a dilated span), an MLA latent pool, int8 rows."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 32, generator=generator)
    pool = torch.randn(2, 10, 16, 2, 32, generator=generator)  # [K|V, blocks, block size, KV heads, dim]
    table = torch.tensor([[0, 3, 5], [1, 2, 4], [6, 7, 8]])
    lengths = torch.tensor([40, 17, 33])
    yield (q, pool[0], pool[1], table, lengths, "blocks", 0.2, 32), {}
    yield (q, pool[0], pool[1], table, lengths, "blocks", 0.2, 32, torch.tensor([20, 3, 30]), 4, 0, 3), {}
    rows = torch.randn(2, 4, 2, 16, 32, generator=generator)  # [K|V, slots, KV heads, rows, dim]
    slots = torch.tensor([[2], [0], [3]], dtype=torch.int32)
    yield (q, rows[0], rows[1], slots, lengths, "rows", 0.2, 32, torch.tensor([10, 1, 5])), dict(stride=3, ring=16)
    latent = torch.randn(10, 16, 1, 48, generator=generator)
    yield (torch.randn(3, 8, 48, generator=generator), latent, None, table, lengths, "blocks", 0.15, 32), {}
    codes = torch.randint(-127, 128, (10, 16, 2, 32), dtype=torch.int8, generator=generator)
    scales = torch.rand(10, 16, 2, 1, generator=generator)
    yield (q, codes, codes, table, lengths, "blocks", 0.2, 32), dict(k_scales=scales, v_scales=scales * 2)


@pytest.mark.parametrize("case", range(5), ids=["paged", "paged-sinks", "rows-ring", "mla", "int8-rows"])
def test_attention_glue_equals_the_python_glue(case):
    args, kwargs = list(attention_cases())[case]
    got, want = cpu_decode.decode_attention(*args, **kwargs), cpu_decode.decode_attention_eager(*args, **kwargs)
    assert got.shape == want.shape and not got.isnan().any()
    assert torch.equal(got, want)


def test_the_glue_refuses_what_the_kernels_do_not_take():
    with pytest.raises(ValueError, match="float16 is beyond the CPU kernel"):
        cpu_decode.dense_gemv(torch.randn(1, 64).half(), torch.randn(8, 64).half(), None)
    with pytest.raises(ValueError, match="float64 is beyond the CPU kernels"):
        cpu_decode.quantized_gemv(torch.randn(1, 64).double(), torch.zeros(8, 64, dtype=torch.int8),
                                  torch.ones(8), None, 0)
    q, scales, zeros = quantize_int4(torch.randn(8, 96), 32)
    with pytest.raises(ValueError, match="width 96 .* and group 64"):
        cpu_decode.quantized_gemv(torch.randn(1, 96), q, scales, zeros, 64)
    cache, table, lengths = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1)
    with pytest.raises(ValueError, match="unknown cache layout 'columns'; allowed: blocks, rows"):
        cpu_decode.decode_attention(torch.zeros(1, 2, 8), cache, None, table, lengths, "columns", 1.0, 8)
    with pytest.raises(ValueError, match="stride 0 >= 1"):
        cpu_decode.decode_attention(torch.zeros(1, 2, 8), cache, cache, table, lengths, "rows", 1.0, 8, stride=0)


def test_without_the_glue_the_python_glue_serves(tmp_path):
    """A machine where the C++ glue cannot build (here: a C++ compiler that fails) says so and runs the Python glue,
    with the same results. In a fresh process, with its own kernel cache, so this one keeps its registrations."""
    script = """
import warnings, torch
from kernels import cpu_decode
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert not cpu_decode.glue_available()
assert any("C++ glue" in str(w.message) for w in caught), [str(w.message) for w in caught]
for op in ("dense_gemv", "quantized_gemv", "decode_attention"):
    cpu_line = next(l for l in torch._C._dispatch_dump(f"archzoo::{op}").splitlines() if l.startswith("CPU:"))
    assert "ops.cpp" not in cpu_line, cpu_line
x, w = torch.randn(3, 100), torch.randn(37, 100)
torch.testing.assert_close(cpu_decode.dense_gemv(x, w, None), torch.nn.functional.linear(x, w))
q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
got = cpu_decode.decode_attention(q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([8]), "rows", 0.25, 16)
want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=0.25, enable_gqa=True)[:, :, 0]
torch.testing.assert_close(got, want)
from kernels import cpu_fused
x, weight = torch.randn(2, 64), torch.randn(64)
want = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
torch.testing.assert_close(cpu_fused.rms_norm(x, weight, 1e-5), want)  # the plain function: no op without the glue
torch.testing.assert_close(torch.ops.archzoo.rms_norm(x, weight, 1e-5), want)
gate, up, down = torch.randn(96, 64), torch.randn(96, 64), torch.randn(64, 96)
x64 = x.double()  # float64: an fp32 matmul sums in another order than the GEMV (3.6e-5 apart seen, outputs ~4)
want = (torch.nn.functional.silu(x64 @ gate.double().T) * (x64 @ up.double().T)) @ down.double().T
torch.testing.assert_close(cpu_fused.swiglu_gemv(x, gate, up, down).double(), want, rtol=1e-4, atol=1e-4)
print("python glue ok")
"""
    env = {**os.environ, "CXX": "false", "XDG_CACHE_HOME": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "python glue ok" in result.stdout, result.stderr[-2000:]
