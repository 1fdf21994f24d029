"""Every Triton kernel compiles for real GPUs (A100: sm_80, H100: sm_90) on this CPU-only machine, at the sizes the
models use, in fp32, fp16 and bf16, with no register spills: tests/kernels/gpu_compile.py does the compiling in a
process of its own (the interpreter the other kernel tests use must not be loaded there). The fp8 KV cases build for
sm_90 only: float8 e4m3 is native from sm_89 on, and Triton refuses it below."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("triton")
sys.path.insert(0, str(REPO_ROOT / "tests" / "kernels"))
from gpu_compile import CASES, DTYPES, targets  # noqa: E402


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "kernels" / "gpu_compile.py")], env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case,target", [(case, target) for case in CASES for target in targets(case)])
def test_kernel_compiles_for_the_gpu_without_spills(compiled, case, dtype, target):
    rows = [r for r in compiled if (r["case"], r["dtype"], r["target"]) == (case, dtype, target)]
    assert rows, f"{case} {dtype} {target}: nothing compiled"
    for row in rows:
        assert "error" not in row, f"{case} {dtype} {target}: {row['error']}"
        assert row["LOCAL"] == 0, f"{case} {dtype} {target}: {row['kernel']} spills to local memory: {row}"
        assert row["REG"] <= 255 and row["SHARED"] <= 227 * 1024, row
