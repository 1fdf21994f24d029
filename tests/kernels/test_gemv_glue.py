"""kernels/cpu/ops.cpp: the GEMV ops' CPU kernels in C++ call the same C kernels as the Python glue, so the two give
bit-identical outputs, and refuse what the kernels do not take with the same kind of error."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_decode, cpu_kernels_available
from zoo.quantize import quantize_int4, quantize_int8

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not cpu_kernels_available() or not cpu_decode.gemv_glue_available(),
                                reason="the C kernels or the C++ glue did not build here (a warning said why)")


def test_the_ops_cpu_kernels_are_the_glue():
    for op in ("dense_gemv", "quantized_gemv"):
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


def test_the_glue_refuses_what_the_kernels_do_not_take():
    with pytest.raises(ValueError, match="float16 is beyond the CPU kernel"):
        cpu_decode.dense_gemv(torch.randn(1, 64).half(), torch.randn(8, 64).half(), None)
    with pytest.raises(ValueError, match="float64 is beyond the CPU kernels"):
        cpu_decode.quantized_gemv(torch.randn(1, 64).double(), torch.zeros(8, 64, dtype=torch.int8),
                                  torch.ones(8), None, 0)
    q, scales, zeros = quantize_int4(torch.randn(8, 96), 32)
    with pytest.raises(ValueError, match="width 96 .* and group 64"):
        cpu_decode.quantized_gemv(torch.randn(1, 96), q, scales, zeros, 64)


def test_without_the_glue_the_python_glue_serves(tmp_path):
    """A machine where the C++ glue cannot build (here: a C++ compiler that fails) says so and runs the Python glue,
    with the same results. In a fresh process, with its own kernel cache, so this one keeps its registrations."""
    script = """
import warnings, torch
from kernels import cpu_decode
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert not cpu_decode.gemv_glue_available()
assert any("C++ GEMV glue" in str(w.message) for w in caught), [str(w.message) for w in caught]
cpu_line = next(l for l in torch._C._dispatch_dump("archzoo::dense_gemv").splitlines() if l.startswith("CPU:"))
assert "ops.cpp" not in cpu_line, cpu_line
x, w = torch.randn(3, 100), torch.randn(37, 100)
torch.testing.assert_close(cpu_decode.dense_gemv(x, w, None), torch.nn.functional.linear(x, w))
print("python glue ok")
"""
    env = {**os.environ, "CXX": "false", "XDG_CACHE_HOME": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "python glue ok" in result.stdout, result.stderr[-2000:]
