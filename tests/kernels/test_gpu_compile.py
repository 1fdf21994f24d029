"""Every Triton kernel compiles for real GPUs (A100: sm_80, H100: sm_90) on this CPU-only machine, at the sizes the
models use, in fp32, fp16 and bf16, with no register spills, under two triton releases:

- the triton installed here (CI's, with its torch), and
- GPU_TRITON, the GPU machines' triton (their torch 2.11 pins it), which pip installs once into
  ~/.cache/archzoo/triton-3.6.0 (tests/kernels/pip_triton.py; PyPI must be reachable the first time, and a failed
  install fails these tests) and which is put first on the compiling process's sys.path, torch staying the
  installed one.

tests/kernels/gpu_compile.py does the compiling, once per release, each in a process of its own (the interpreter
the other kernel tests use must not be loaded there); the two start together, each on one core. Only compiling is
checked with GPU_TRITON: its interpreter cannot run the other kernel tests, which run on the installed triton. The
fp8 KV cases build for sm_90 only: float8 e4m3 is native from sm_89 on, and Triton refuses it below."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("triton")
sys.path.insert(0, str(REPO_ROOT / "tests" / "kernels"))
from gpu_compile import CASES, DTYPES, targets  # noqa: E402
from pip_triton import InstallError, triton_folder  # noqa: E402

GPU_TRITON = "3.6.0"  # torch 2.11.0 requires triton==3.6.0 exactly; also the newest 3.6.x on PyPI
INSTALLED = "installed"
COMPILE_TIMEOUT_S = 1800


class CompileRun:
    """gpu_compile.py in a process of its own; its output goes to files, so two runs at once never block on a pipe."""

    def __init__(self, folder: Path, triton_path: Path | None = None, triton_version: str | None = None):
        folder.mkdir()
        self.stdout, self.stderr = folder / "stdout", folder / "stderr"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        paths = [str(triton_path)] if triton_path else []
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO_ROOT), env.get("PYTHONPATH", "")])
        command = [sys.executable, str(REPO_ROOT / "tests" / "kernels" / "gpu_compile.py")]
        command += ["--triton", triton_version] if triton_version else []
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=err)

    def lines(self) -> list[dict]:
        returncode = self.process.wait(timeout=COMPILE_TIMEOUT_S)
        assert returncode == 0, self.stderr.read_text()[-2000:]
        return [json.loads(line) for line in self.stdout.read_text().splitlines()]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    """Both runs, started together; a failed install is kept as the GPU_TRITON run, so only its tests fail."""
    folder = tmp_path_factory.mktemp("gpu_compile")
    runs = {INSTALLED: CompileRun(folder / INSTALLED)}
    try:
        runs[GPU_TRITON] = CompileRun(folder / GPU_TRITON, triton_folder(GPU_TRITON), GPU_TRITON)
    except (InstallError, OSError) as error:  # OSError: the cache folder cannot be written
        runs[GPU_TRITON] = error
    yield runs
    for run in runs.values():
        if isinstance(run, CompileRun):
            run.stop()


@pytest.fixture(scope="module", params=[INSTALLED, GPU_TRITON], ids=lambda release: f"triton-{release}")
def compiled(request, compile_runs) -> list[dict]:
    run = compile_runs[request.param]
    if isinstance(run, Exception):
        pytest.fail(f"triton {request.param} for the GPU machines' compile check: {run}")
    return run.lines()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case,target", [(case, target) for case in CASES for target in targets(case)])
def test_kernel_compiles_for_the_gpu_without_spills(compiled, case, dtype, target):
    rows = [r for r in compiled if (r["case"], r["dtype"], r["target"]) == (case, dtype, target)]
    assert rows, f"{case} {dtype} {target}: nothing compiled"
    for row in rows:
        assert "error" not in row, f"{case} {dtype} {target}: {row['error']}"
        assert row["LOCAL"] == 0, f"{case} {dtype} {target}: {row['kernel']} spills to local memory: {row}"
        assert row["REG"] <= 255 and row["SHARED"] <= 227 * 1024, row
