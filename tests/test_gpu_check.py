"""benchmarks/gpu_check.py --smoke, as the GPU runs it (a subprocess, ray not importable, as on the GPU image): under
90 s, at most 8 files, every section in the summary without an error, and results.jsonl rows carrying what the
tables show. Keeps the one GPU command from rotting between GPU visits."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # gpu_check imports the benchmarks beside it, as a script run does
spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

SMOKE_LIMIT_S = 90
# the fields each section's table reads from its rows
ROW_FIELDS = {
    "run": {"device", "torch", "cuda", "triton", "transformers", "copy_gb_s", "smoke"},
    "tests": {"passed", "failed", "errors", "skipped", "timed_out", "failures"},
    "kernels": {"bench", "table", "key", "dtype", "triton_us", "torch_us", "torch_over_triton", "triton_gb_s",
                "copy_bw_pct", "max_abs_diff"},
    "decode": {"preset", "arch", "batch", "context", "graphs"},
    "hf": {key for _, key, _ in gpu_check.HF_COLUMNS},
    "compare": {"arch", "context", "batch", "step_ms_p50", "floor_ms"},
}
TIMED_DECODE_FIELDS = {"step_ms", "floor_ms", "x_floor", "mbu", "graph_mb", "graphs_off_reason"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run: (wall seconds, stdout, the output folder)."""
    out = tmp_path_factory.mktemp("gpu_check")
    blocker = tmp_path_factory.mktemp("no_ray")
    (blocker / "ray.py").write_text('raise ImportError("ray is not on the GPU image")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO_ROOT)])}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(out)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    wall_s = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"gpu_check --smoke: {wall_s:.1f} s")
    return wall_s, done.stdout, out


def rows_by_section(out) -> dict[str, list[dict]]:
    sections = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        sections.setdefault(row["section"], []).append(row)
    return sections


def test_smoke_is_fast_and_writes_at_most_eight_files(smoke):
    wall_s, stdout, out = smoke
    assert wall_s < SMOKE_LIMIT_S, f"gpu_check --smoke took {wall_s:.0f} s"
    files = {path.name for path in out.iterdir()}
    assert {"summary.md", "results.jsonl"} <= files and len(files) <= gpu_check.MAX_FILES, files
    assert stdout.startswith("# archzoo GPU check")  # the summary, printed at the end


def test_every_section_in_the_summary_without_an_error(smoke):
    summary = (smoke[2] / "summary.md").read_text()
    for section in gpu_check.SECTIONS:
        heading = next((line for line in summary.splitlines() if line.startswith(f"## {section.title} (")), None)
        assert heading is not None and heading.endswith(": ok"), f"{section.title}: {heading}"
    assert "| CUDA-only tests (tests/cuda) |" in summary and "| FAIL |" not in summary


def test_results_rows_carry_what_the_tables_show(smoke):
    sections = rows_by_section(smoke[2])
    assert set(sections) == set(ROW_FIELDS)
    for section, rows in sections.items():
        for row in rows:
            assert ROW_FIELDS[section] <= set(row), f"{section} row lacks {ROW_FIELDS[section] - set(row)}"


def test_each_section_ran_its_cpu_part(smoke):
    sections = rows_by_section(smoke[2])
    [tests] = sections["tests"]
    assert tests["passed"] > 0 and tests["failed"] == tests["errors"] == 0 and not tests["timed_out"], tests
    assert {r["bench"] for r in sections["kernels"]} == {b.__name__ for b in gpu_check.kernels_gpu.BENCHES}
    for row in sections["decode"]:
        if row["graphs"]:  # capture needs CUDA
            assert row["skipped"].startswith("not run on cpu"), row
        else:
            assert TIMED_DECODE_FIELDS <= set(row) and row["step_ms"] > 0 and row["floor_ms"] > 0, row
    plan = gpu_check.SMOKE_PLAN
    assert len(sections["hf"]) == len(plan.hf.archs) * len(plan.hf.batches)
    assert all(not row["greedy"].startswith("FAIL") for row in sections["hf"])
    assert len(sections["compare"]) >= 1


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path):
    ctx = gpu_check.Context(gpu_check.SMOKE_PLAN, gpu_check.Report(tmp_path, "# heading"), copy_gbs=1.0,
                            deadline=time.monotonic() + 60)
    gpu_check.run_section(gpu_check.Section("broken", "x. broken", lambda ctx: 1 / 0), ctx)
    gpu_check.run_section(gpu_check.Section("fine", "y. fine", lambda ctx: gpu_check.SectionResult("fine rows")), ctx)
    summary = (tmp_path / "summary.md").read_text()
    assert "## x. broken (" in summary and "): error" in summary and "ZeroDivisionError" in summary
    assert "): ok\n\nfine rows" in summary


def test_a_section_past_its_deadline_starts_no_new_work(tmp_path):
    ctx = gpu_check.Context(gpu_check.SMOKE_PLAN, gpu_check.Report(tmp_path, "# heading"), copy_gbs=1.0,
                            deadline=time.monotonic() - 1)
    args = gpu_check.kernels_gpu.parse_args(["--device", "cpu"])
    assert gpu_check.kernel_table_rows(gpu_check.kernels_gpu.bench_write, args, ctx) == (
        [], "bench_write: not run (time box reached)")
    rows, how = gpu_check.run_preset_cells(ctx, "tiny", ("gqa",), (1,), (32,))
    assert [row["skipped"] for row in rows] == ["time box reached"] * 2 and how == "not measured"


def test_a_command_past_its_timeout_is_killed_with_its_output_kept():
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    start = time.monotonic()
    # 1 s: the child prints at once (no imports beyond time); its sleep outlasts the timeout 60-fold
    output, status = gpu_check.run_with_timeout(command, gpu_check.SMOKE_PLAN, timeout_s=1)
    assert status is None and "started" in output and time.monotonic() - start < 30


def test_pytest_counts_read_a_run_cut_short():
    output = ("tests/cuda/test_a.py::test_x[fp32] PASSED   [ 10%]\n"
              "tests/cuda/test_a.py::test_x[bf16] SKIPPED (bf16 runs on CUDA only)   [ 20%]\n"
              "tests/cuda/test_b.py::test_y[gqa-fp32] FAILED   [ 30%]\n"
              "tests/cuda/test_b.py::test_z ERROR   [ 40%]\n")
    counts = gpu_check.pytest_counts(output)
    assert (counts["passed"], counts["skipped"], counts["failed"], counts["errors"]) == (1, 1, 1, 1)
    assert counts["failures"] == ["FAILED tests/cuda/test_b.py::test_y[gqa-fp32]", "ERROR tests/cuda/test_b.py::test_z"]


def test_the_record_refuses_a_file_past_the_cap(tmp_path):
    report = gpu_check.Report(tmp_path, "# heading")
    for i in range(gpu_check.MAX_FILES - 2):  # summary.md and results.jsonl are two
        with report.chart(f"chart{i}.png") as path:
            path.write_bytes(b"png")
    with pytest.raises(RuntimeError, match="already holds 8 files"):
        with report.chart("one_more.png"):
            pass
    assert len(list(tmp_path.iterdir())) == gpu_check.MAX_FILES
