"""One command for a GPU visit: everything a visit should record, each part time-boxed, written as it goes.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out DIR            # one H100 / H200: about 7.5 minutes
    PYTHONPATH=. python3 benchmarks/gpu_check.py --out DIR --smoke    # the same flow on the CPU, tiny, < 90 s

Sections, in order (a failing one records its error and the next runs; each stops starting work when its share of
--budget-s is spent, and hands what it did not use to the next):

  a. the CUDA-only tests: pytest tests/cuda in a subprocess, passed / failed counts and the failures;
  b. each Triton kernel's time and bandwidth against the measured copy bandwidth (benchmarks/kernels_gpu.py), with
     the paged decode kernel at batch 16 x 8k keys in bf16;
  c. the decode step of every compare-default architecture at the GPU default's preset, bf16, paged, CUDA graphs
     on and off, batches 1/16/64 x contexts 1k/8k, decoded at the context without a prefill
     (harness/decode_probe.py), against its floor (harness/roofline.py: max(bytes / the measured copy bandwidth,
     FLOPs / the measured matmul rate)); and the `small` preset's batch-1 graph speed-up;
  d. archzoo against transformers' `generate` on the same weights (benchmarks/decode_vs_hf.py), gqa and mamba;
  e. `zoo compare --device cuda`: the GPU default, in a subprocess, its table and two of its charts.

DIR gets at most MAX_FILES files: summary.md (every table, rewritten atomically after each section), results.jsonl
(one JSON row per measurement, each appended and flushed as it is made, tagged with its section) and PNG charts.
The summary is printed at the end. --smoke runs every section on the CPU at the `tiny` size (the Triton kernels in
triton's interpreter, fp32): what needs CUDA (graph capture) is marked "not run on cpu".
"""
import argparse
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the smoke's Triton kernels: triton reads this when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402
import triton  # noqa: E402

import kernels_gpu  # noqa: E402  (benchmarks/, beside this script)
import roofline as roofline_benchmark  # noqa: E402  (benchmarks/roofline.py: its decode-vs-floor chart)
import zoo  # noqa: E402
from decode_vs_hf import DTYPES, HfRun, build_pair, measure_batch  # noqa: E402
from harness import compare_device, roofline  # noqa: E402
from harness.charts import plt, write_charts  # noqa: E402
from harness.decode_probe import HEADROOM, decode_probe  # noqa: E402
from harness.results import write_atomic  # noqa: E402
from harness.table import markdown_table, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_FILES = 8
SUMMARY, RESULTS = "summary.md", "results.jsonl"
DEVICE_ENV = "ARCHZOO_TEST_DEVICE"  # tests/cuda/conftest.py: "cpu" runs the CUDA-only tests on the CPU
MIN_SECTION_S = 15  # a section that starts late still gets this long
BLOCK_SIZE = 16
PROBE_WARMUP = 2  # untimed steps: the first captures the batch's graph (and compiles the Triton kernels)
GRAPH_SPEEDUP_TARGET = 2.0
KERNEL_BANDWIDTH_TARGET = 70.0  # % of the copy bandwidth, paged decode attention at batch 16
HF_RATIO_TARGET = 2.0  # archzoo / transformers decode tokens/s, gqa, batch 1, bf16


@dataclass(frozen=True)
class DecodeGrid:
    preset: str | None  # None: the preset of `zoo compare`'s default on the device
    archs: tuple[str, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: int  # timed decode steps per cell, median
    graph_preset: str  # a launch-bound size: where graphs must pay (acceptance: >= 2x at batch 1)
    graph_context: int


@dataclass(frozen=True)
class HfGrid:
    archs: tuple[str, ...]
    preset: str
    dtype: str
    batches: tuple[int, ...]
    run: HfRun


@dataclass(frozen=True)
class Budgets:
    """Each section's share of the run, in seconds (as planned: time a section leaves unused passes on)."""

    tests: float
    kernels: float
    decode: float
    hf: float
    compare: float


@dataclass(frozen=True)
class Plan:
    """What one run does: its device, each section's grid and its share of the time."""

    device: str
    budgets: Budgets
    pytest_args: tuple[str, ...]
    kernel_argv: tuple[str, ...]
    decode: DecodeGrid
    hf: HfGrid
    compare_argv: tuple[str, ...]
    copy_bytes: int  # the copy that measures the device's bandwidth
    threads: int | None  # torch threads here and in the subprocesses (None: torch's default)


def compare_archs_gqa_first() -> tuple[str, ...]:
    """The compare defaults with gqa first: it sets the matmul rate, and leads a run cut short by its time box."""
    archs = zoo.compare_defaults()
    return ("gqa", *(a for a in archs if a != "gqa"))


GPU_PLAN = Plan(
    device="cuda",
    # measured on one H100 (2026-11-26): tests 87-102 s (309 tests; 404 since RetNet, RWKV-7, MoE, dilated windows and
    # eviction, so ~130 s), kernels 15 s, decode 74-79 s, hf 47-56 s, compare 65 s; 425 s leaves 35 s of 7.7
    # minutes for imports, the copy measurement and the cell in flight when a time box runs out
    budgets=Budgets(tests=150, kernels=25, decode=95, hf=60, compare=95),
    pytest_args=(),
    kernel_argv=("--context", "8192", "--batches", "1", "16", "64", "--dtypes", "bf16"),
    decode=DecodeGrid(preset=None, archs=compare_archs_gqa_first(), batches=(1, 16, 64), contexts=(1024, 8192),
                      steps=5, graph_preset="small", graph_context=1024),
    hf=HfGrid(archs=("gqa", "mamba"), preset="base", dtype="bfloat16", batches=(1, 16),
              run=HfRun(prompt_len=512, new_tokens=64, repeats=2, kv_cache="paged", compile=False, device="cuda")),
    compare_argv=("--device", "cuda"),
    copy_bytes=2**30,
    threads=None,
)
SMOKE_PLAN = Plan(
    device="cpu",
    budgets=Budgets(tests=45, kernels=15, decode=10, hf=10, compare=15),
    pytest_args=("-k", "gqa or mamba2"),  # a few of each suite: every test module still imports and collects
    kernel_argv=("--dtypes", "fp32", "--batches", "1", "--context", "64", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "32", "--window", "32", "--mla-heads", "4", "--kv-lora-rank", "32", "--rope-dim", "16",
                 "--prefill-tokens", "64", "--mamba-inner", "64", "--mamba2-head-dim", "16", "--mamba2-state", "16",
                 "--linear-heads", "2", "--linear-dim", "16"),
    decode=DecodeGrid(preset="tiny", archs=("gqa", "mamba"), batches=(1, 2), contexts=(32, 64), steps=2,
                      graph_preset="tiny", graph_context=32),
    hf=HfGrid(archs=("gqa", "mamba"), preset="tiny", dtype="float32", batches=(1, 2),
              run=HfRun(prompt_len=16, new_tokens=8, repeats=1, kv_cache="paged", compile=False, device="cpu")),
    compare_argv=("--device", "cpu", "--preset", "tiny", "--archs", "gqa,mamba", "--contexts", "32", "--batches",
                  "1", "--new-tokens", "4"),
    copy_bytes=2**26,
    threads=1,  # tiny models on a shared 2-core machine: a second thread's spinning costs 10-50x (tests/conftest.py)
)


# ---- the record: summary.md, results.jsonl, charts ------------------------------------------------------------


@dataclass(frozen=True)
class Acceptance:
    check: str
    measured: str
    target: str
    passed: bool | None  # None: not measured, or a speed measured off the GPU (the smoke), where no target applies


def judged(device: str, passed: bool) -> bool | None:
    """A speed target applies on the GPU only."""
    return passed if device == "cuda" else None


@dataclass
class SectionResult:
    markdown: str
    acceptance: list[Acceptance] = field(default_factory=list)


class Report:
    """DIR/summary.md, rewritten atomically whenever a section ends; DIR/results.jsonl, one row appended and flushed
    per measurement; and the charts, each written under a temporary name and renamed."""

    def __init__(self, out: Path, heading: str):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.heading = out, heading
        self.sections: list[str] = []
        self.acceptance: list[Acceptance] = []
        self.footer = "The run is still going, or was killed before its end: the sections above are complete."
        self.files = {SUMMARY, RESULTS}
        (out / RESULTS).write_text("")  # a run's rows are its own: the summary describes exactly them
        self.write()

    def record(self, section: str, row: dict) -> None:
        with open(self.out / RESULTS, "a") as results:
            results.write(json.dumps({"section": section, **row}, default=str) + "\n")
            results.flush()
            os.fsync(results.fileno())

    @contextmanager
    def chart(self, name: str):
        """Yields a temporary path to save a PNG to; it becomes DIR/name when saved (at most MAX_FILES files)."""
        if name not in self.files and len(self.files) >= MAX_FILES:
            raise RuntimeError(f"{name}: DIR already holds {MAX_FILES} files ({', '.join(sorted(self.files))})")
        self.files.add(name)
        temporary = self.out / f".{name}"
        yield temporary
        os.replace(temporary, self.out / name)

    def add(self, title: str, wall_s: float, result: SectionResult | None, error: str) -> None:
        status = f"error\n\n```\n{error}```" if error else "ok"
        self.sections.append(f"## {title} ({wall_s:.1f} s): {status}\n\n{result.markdown if result else ''}")
        self.acceptance += result.acceptance if result else []
        self.write()

    def markdown(self) -> str:
        rows = [{"check": a.check, "measured": a.measured, "target": a.target,
                 "result": {True: "pass", False: "FAIL", None: "not judged"}[a.passed]} for a in self.acceptance]
        columns = [("check", "check", "{}"), ("measured", "measured", "{}"), ("target", "target", "{}"),
                   ("result", "result", "{}")]
        acceptance = "\n".join(table(rows, columns, lambda r: 0)) if rows else "(no section has reported yet)"
        return "\n\n".join([self.heading, "## Acceptance", acceptance, *self.sections, self.footer]) + "\n"

    def write(self) -> None:
        write_atomic(self.out / SUMMARY, self.markdown())

    def finish(self, wall_s: float) -> None:
        self.footer = f"Total wall time: {wall_s:.0f} s (imports excluded)."
        self.write()


@dataclass
class Context:
    """What every section reads: the plan, the record, the device's copy rate, and when the section must stop."""

    plan: Plan
    report: Report
    copy_gbs: float
    deadline: float = 0.0  # time.monotonic() after which the running section starts no new work
    # the decode floor's rates by preset, measured on its first model: the smoke's two grids share the tiny preset's
    rates: dict = field(default_factory=dict)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def out_of_time(self) -> bool:
        return self.time_left() <= 0


def markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    return "\n".join(table(rows, columns, lambda r: 0)) + "\n" if rows else "(no rows)\n"


def free_device_memory() -> None:
    """The previous section's models and caches: collected, and the allocator's cache handed back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- a. the CUDA-only tests ------------------------------------------------------------------------------------


def subprocess_env(plan: Plan) -> dict:
    """The checkout importable, the plan's torch threads, and on the CPU the CUDA-only tests' device
    (tests/cuda/conftest.py)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **({DEVICE_ENV: "cpu"} if plan.device == "cpu" else {}),
            **({"OMP_NUM_THREADS": str(plan.threads)} if plan.threads else {})}


def run_with_timeout(command: list[str], plan: Plan, timeout_s: float) -> tuple[str, int | None]:
    """(stdout and stderr, exit status, None where the command ran past timeout_s and was killed)."""
    try:
        done = subprocess.run(command, cwd=REPO, env=subprocess_env(plan), capture_output=True, text=True,
                              timeout=timeout_s)
        return done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        parts = (expired.stdout, expired.stderr)
        return "".join(p.decode(errors="replace") if isinstance(p, bytes) else p or "" for p in parts), None


# pytest -v's line per test: "tests/cuda/test_x.py::test_y[id] PASSED    [ 3%]"
TEST_STATUS = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)
# the suites whose failures say most run first, so a run cut short by its time box has them
FIRST_TEST_FILES = ("test_kernels_on_device.py", "test_engine_on_device.py", "test_hf_on_device.py")


def test_files() -> list[str]:
    folder = REPO / "tests" / "cuda"
    names = [n for n in FIRST_TEST_FILES if (folder / n).exists()]
    names += sorted(p.name for p in folder.glob("test_*.py") if p.name not in names)
    return [f"tests/cuda/{name}" for name in names]


def pytest_counts(output: str) -> dict:
    """Counts from pytest -v's per-test lines (a run killed at its time box has them too), and the failures: the
    short summary's lines with their messages, or the failed tests' ids where the run never reached it."""
    statuses = TEST_STATUS.findall(output)
    counts = {word: sum(status == word.upper() for _, status in statuses) for word in ("passed", "failed", "skipped")}
    counts["errors"] = sum(status == "ERROR" for _, status in statuses)
    summary = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    failed = [f"{status} {test}" for test, status in statuses if status in ("FAILED", "ERROR")]
    return {**counts, "failures": summary or failed}


def run_tests(ctx: Context) -> SectionResult:
    timeout = max(ctx.time_left(), MIN_SECTION_S)
    # addopts emptied: the project's "-q" would cancel this "-v", whose per-test lines the counts come from
    command = [sys.executable, "-m", "pytest", *test_files(), "-o", "addopts=", "-v", "-p", "no:cacheprovider",
               "-rfE", "--durations=5", *ctx.plan.pytest_args]
    start = time.monotonic()
    output, status = run_with_timeout(command, ctx.plan, timeout)
    row = {**pytest_counts(output), "returncode": status, "timed_out": status is None,
           "wall_s": time.monotonic() - start}
    ctx.report.record("tests", row)
    verdict = (f"stopped at its time box ({timeout:.0f} s): the counts are of the tests that ran" if status is None
               else f"pytest exit status {status}")
    slowest = re.search(r"slowest 5 durations =+\n(.*?)\n\n", output, re.S)
    failures = row["failures"]
    text = (f"`pytest tests/cuda {' '.join(ctx.plan.pytest_args)}`: {verdict}.\n\n"
            f"{row['passed']} passed, {row['failed']} failed, {row['errors']} errors, {row['skipped']} skipped "
            f"in {row['wall_s']:.1f} s.\n\n"
            + ("Failures:\n\n" + "\n".join(f"- `{line[:300]}`" for line in failures) + "\n\n" if failures else "")
            + (f"Slowest:\n\n```\n{slowest.group(1)}\n```\n" if slowest else "")
            + (f"Output tail:\n\n```\n{output[-1500:]}\n```\n" if status not in (0, 1) else ""))
    passed = row["passed"] > 0 and not (row["failed"] or row["errors"] or status is None)
    measured = f"{row['passed']} passed, {row['failed'] + row['errors']} failed" + (", timed out" * (status is None))
    return SectionResult(text, [Acceptance("CUDA-only tests (tests/cuda)", measured, "all pass", passed)])


# ---- b. kernel bandwidth ---------------------------------------------------------------------------------------


def kernel_table_rows(bench: Callable, args, ctx: Context) -> tuple[list[dict], str]:
    """One kernels_gpu table's rows until the section's time is up; a note where it stopped early or failed."""
    rows = []
    if ctx.out_of_time():
        return rows, f"{bench.__name__}: not run (time box reached)"
    try:
        for row in bench(args, ctx.copy_gbs):
            rows.append({"bench": bench.__name__, **row})
            ctx.report.record("kernels", rows[-1])
            if ctx.out_of_time():
                return rows, f"{bench.__name__}: stopped after {len(rows)} rows (time box reached)"
    except Exception as error:  # a mismatch or a failing kernel ends its table only
        return rows, f"{bench.__name__}: {type(error).__name__}: {error}"
    return rows, ""


def kernel_chart(rows: list[dict], path: Path) -> None:
    labels = [f"{r['bench'].removeprefix('bench_')} {r['key']} {r['dtype']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 0.22 * len(rows) + 1.2), dpi=120)
    ax.barh(range(len(rows)), [r["copy_bw_pct"] for r in rows], color="tab:blue")
    ax.axvline(KERNEL_BANDWIDTH_TARGET, color="black", linestyle="--", linewidth=1, label="acceptance (paged, b16)")
    ax.set_yticks(range(len(rows)), labels, fontsize=6.5)
    ax.invert_yaxis()
    ax.set_xlabel("Triton kernel: bytes it must move / time, % of the measured copy bandwidth")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def kernel_acceptance(rows: list[dict], args) -> Acceptance:
    check = f"paged decode attention, batch 16 x {args.context} keys, bf16: % of copy bandwidth"
    target = f">= {KERNEL_BANDWIDTH_TARGET:.0f}%"
    row = next((r for r in rows if (r["bench"], r["key"], r["dtype"]) == ("bench_attention", "16", "bf16")), None)
    if row is None:
        return Acceptance(check, "not run", target, None)
    return Acceptance(check, f"{row['copy_bw_pct']:.0f}%", target,
                      judged(args.device, row["copy_bw_pct"] >= KERNEL_BANDWIDTH_TARGET))


def run_kernels(ctx: Context) -> SectionResult:
    args = kernels_gpu.parse_args([*ctx.plan.kernel_argv, "--device", ctx.plan.device])
    rows, notes = [], []
    for bench in kernels_gpu.BENCHES:
        table_rows, note = kernel_table_rows(bench, args, ctx)
        rows += table_rows
        notes += [note] if note else []
        free_device_memory()
    if rows:
        with ctx.report.chart("kernels_copy_bandwidth.png") as path:
            kernel_chart(rows, path)
    text = (f"`benchmarks/kernels_gpu.py {' '.join(ctx.plan.kernel_argv)}`; times are medians of "
            f"{'triton.testing.do_bench' if ctx.plan.device == 'cuda' else 'the wall clock (interpreter)'}.\n\n"
            + kernels_gpu.markdown(rows) + "".join(f"\n- {note}" for note in notes) + "\n")
    return SectionResult(text, [kernel_acceptance(rows, args)])


# ---- c. the decode step against its floor, CUDA graphs on and off -----------------------------------------------


def build_on_device(arch: str, preset: str, device: str) -> torch.nn.Module:
    """bf16, initialised on the device: a 2B model initialised on the CPU and copied takes seconds per model."""
    torch.manual_seed(0)
    with torch.device(device):
        model = zoo.build(arch, preset=preset)
    return model.to(torch.bfloat16).eval()


def copy_floor_rates(model, ctx: Context) -> roofline.MachineRates:
    """The floor's two rates: the device's measured copy bandwidth for bytes, the measured matmul rate for FLOPs."""
    measured = roofline.measure_machine(model, ctx.plan.device, matmul_size=8192)
    return replace(measured, stream_bytes_per_s=ctx.copy_gbs * 1e9,
                   how=f"bytes: the measured device copy ({ctx.copy_gbs:.0f} GB/s, read + write); FLOPs: "
                       f"{measured.matmul_flops_per_s / 1e12:.1f} TFLOP/s measured ({measured.how})")


def fit_shortfall(model, batch: int, context: int, device: str) -> str:
    """Why the cell's engine would not fit in free device memory ("" when it fits), before it allocates anything."""
    cell = {"context": context, "new_tokens": HEADROOM, "kv_cache": "paged", "block_size": BLOCK_SIZE,
            "batch": batch, "kv_dtype": "auto"}
    return compare_device.memory_shortfall(compare_device.cell_cache_bytes(model, cell),
                                           compare_device.free_device_bytes(device))


def decode_row(model, cell: dict, rates: roofline.MachineRates, steps: int) -> dict:
    """One probe: `steps` decode steps at the cell's batch and context (median), beside the step's floor."""
    probe = decode_probe(model, cell["batch"], cell["context"], "paged", BLOCK_SIZE, cuda_graphs=cell["graphs"])
    seconds = probe.median_step(steps, warmup=PROBE_WARMUP)
    cost = roofline.decode_step_cost(model, cell["batch"], cell["context"])
    floor_s = roofline.floor_seconds(cost, rates)
    engine = probe.engine
    return {**cell, "step_ms": 1e3 * seconds, "floor_ms": 1e3 * floor_s, "x_floor": seconds / floor_s,
            "mbu": roofline.mbu(cost, seconds, rates), "bound": roofline.bound(cost, rates),
            "cache_gb": engine.cache_bytes_allocated / 1e9, "graphs_replayed": engine.cuda_graphs,
            "graphs_off_reason": engine.cuda_graphs_off, "graph_mb": engine.graph_bytes / 1e6,
            "stream_gb_s": rates.stream_bytes_per_s / 1e9, "matmul_gflop_s": rates.matmul_flops_per_s / 1e9}


def measured_or_error(measure: Callable[[], dict], cell: dict) -> dict:
    """The cell's row, or the cell with the error that stopped it: one failing cell does not end its section."""
    try:
        return measure()
    except Exception as error:  # out of memory, a capture refused, a kernel failing: the row says which
        return {**cell, "error": f"{type(error).__name__}: {str(error)[:300]}"}


def grid_cells(preset: str, arch: str, batches, contexts) -> list[dict]:
    """Every (batch, context) cell of one architecture, graphs on then off."""
    return [{"preset": preset, "arch": arch, "batch": batch, "context": context, "graphs": graphs}
            for batch in batches for context in contexts for graphs in (True, False)]


def decode_cell(model, cell: dict, rates, ctx: Context) -> dict:
    """The cell's row: measured, or skipped with the reason (before its engine allocates anything)."""
    if cell["graphs"] and ctx.plan.device != "cuda":
        return {**cell, "skipped": "not run on cpu (CUDA graphs capture CUDA work)"}
    if ctx.out_of_time():
        return {**cell, "skipped": "time box reached"}
    shortfall = fit_shortfall(model, cell["batch"], cell["context"], ctx.plan.device)
    if shortfall:
        return {**cell, "skipped": shortfall}
    return measured_or_error(lambda: decode_row(model, cell, rates, ctx.plan.decode.steps), cell)


def graph_pairs(rows: list[dict]) -> list[dict]:
    """Each (preset, arch, batch, context) once: its eager and graph steps, the graph step's floor and speed-up."""
    cells = {}
    for row in rows:
        cells.setdefault((row["preset"], row["arch"], row["batch"], row["context"]), {})[row["graphs"]] = row
    pairs = []
    for (preset, arch, batch, context), by_mode in cells.items():
        on, off = by_mode.get(True, {}), by_mode.get(False, {})
        timed = on if "step_ms" in on else off
        pairs.append({"preset": preset, "arch": arch, "batch": batch, "context": context,
                      "eager_ms": off.get("step_ms"), "graphs_ms": on.get("step_ms"), "floor_ms": timed.get("floor_ms"),
                      "x_floor": timed.get("x_floor"), "mbu": timed.get("mbu"), "graph_mb": on.get("graph_mb"),
                      "speedup": off["step_ms"] / on["step_ms"] if "step_ms" in on and "step_ms" in off else None,
                      "note": "; ".join(sorted({r.get(key, "") for r in (on, off)
                                                for key in ("skipped", "error")} | {on.get("graphs_off_reason", "")}
                                               - {""}))})
    return pairs


PAIR_COLUMNS = [("arch", "arch", "{}"), ("batch", "batch", "{}"), ("context", "context", "{}"),
                ("eager (ms)", "eager_ms", "{:.2f}"), ("graphs (ms)", "graphs_ms", "{:.2f}"),
                ("floor (ms)", "floor_ms", "{:.2f}"), ("x floor", "x_floor", "{:.2f}"), ("MBU", "mbu", "{:.0%}"),
                ("graph speed-up", "speedup", "{:.2f}x"), ("graph MB", "graph_mb", "{:.0f}"), ("note", "note", "{}")]


def graph_acceptance(pairs: list[dict], preset: str, device: str) -> Acceptance:
    check = f"CUDA graphs speed-up, `{preset}` preset, batch 1 (slowest architecture)"
    measured = [p for p in pairs if p["speedup"] is not None]
    if not measured:
        return Acceptance(check, "not run" + " on cpu" * (device != "cuda"), f">= {GRAPH_SPEEDUP_TARGET:.0f}x", None)
    worst = min(measured, key=lambda p: p["speedup"])
    return Acceptance(check, f"{worst['speedup']:.1f}x ({worst['arch']})", f">= {GRAPH_SPEEDUP_TARGET:.0f}x",
                      judged(device, worst["speedup"] >= GRAPH_SPEEDUP_TARGET))


def decode_chart(rows: list[dict], path: Path) -> None:
    """benchmarks/roofline.py's panels (one per batch x context, a bar per mode, the floor over it)."""
    timed = [{**r, "kv_cache": "graphs" if r["graphs"] else "eager", "step_ms_p50": r["step_ms"], "dtype": "bfloat16",
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "compile": False}
             for r in rows if "step_ms" in r]
    roofline_benchmark.chart(timed, path)


def built(ctx: Context, preset: str, arch: str, rates):
    """(the arch's model on the device, the run's rates, measured on its first model; {}), or (None, rates, why
    there is no model: the time box, or the error that stopped its build)."""
    if ctx.out_of_time():
        return None, rates, {"skipped": "time box reached"}
    try:
        model = build_on_device(arch, preset, ctx.plan.device)
        return model, rates or copy_floor_rates(model, ctx), {}
    except Exception as error:  # its cells say why; the next architecture runs
        return None, rates, {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def run_preset_cells(ctx: Context, preset: str, archs, batches, contexts) -> tuple[list[dict], str]:
    """Every arch's cells at `preset`, each row recorded as it is made; the rows, and the rates' account."""
    rows, rates = [], ctx.rates.get(preset)
    for arch in archs:
        model, rates, failure = built(ctx, preset, arch, rates)
        for cell in grid_cells(preset, arch, batches, contexts):
            rows.append({**cell, **failure} if failure else decode_cell(model, cell, rates, ctx))
            ctx.report.record("decode", rows[-1])
        model = None
        free_device_memory()
    if rates:
        ctx.rates[preset] = rates
    return rows, rates.how if rates else "not measured"


def run_decode(ctx: Context) -> SectionResult:
    grid = ctx.plan.decode
    preset = grid.preset or compare_device.device_defaults(ctx.plan.device).preset
    small_rows, small_how = run_preset_cells(ctx, grid.graph_preset, grid.archs, (1,), (grid.graph_context,))
    rows, how = run_preset_cells(ctx, preset, grid.archs, grid.batches, grid.contexts)
    if any("step_ms" in r for r in rows):
        with ctx.report.chart("decode_vs_floor.png") as path:
            decode_chart(rows, path)
    small_pairs = graph_pairs(small_rows)
    text = (f"bf16, paged (block {BLOCK_SIZE}), each step decoded at its context without a prefill "
            f"(harness/decode_probe.py), median of {grid.steps} steps after {PROBE_WARMUP} untimed; floor = "
            f"max(bytes / copy bandwidth, FLOPs / matmul rate) (harness/roofline.py); x floor and MBU (against the "
            f"copy bandwidth) are the graph step's, or the eager step's where no graph ran.\n\n### `{grid.graph_preset}` preset, batch 1, context {grid.graph_context}: graph speed-up\n\n"
            f"Rates: {small_how}\n\n" + markdown(small_pairs, PAIR_COLUMNS)
            + f"\n### `{preset}` preset (`zoo compare`'s GPU default size)\n\nRates: {how}\n\n"
            + markdown(graph_pairs(rows), PAIR_COLUMNS))
    return SectionResult(text, [graph_acceptance(small_pairs, grid.graph_preset, ctx.plan.device)])


# ---- d. archzoo against transformers ---------------------------------------------------------------------------

HF_COLUMNS = [("arch", "arch", "{}"), ("dtype", "dtype", "{}"), ("batch", "batch", "{}"),
              ("transformers tok/s", "hf_tok_s", "{:.1f}"), ("archzoo tok/s", "zoo_tok_s", "{:.1f}"),
              ("ratio", "ratio", "{:.2f}x"), ("archzoo MBU", "mbu", "{:.0%}"), ("graphs", "cuda_graphs", "{}"),
              ("greedy tokens vs transformers", "greedy", "{}")]


def hf_acceptance(rows: list[dict], dtype: str, device: str) -> Acceptance:
    check = f"archzoo / transformers decode tokens/s, gqa, batch 1, {dtype}"
    row = next((r for r in rows if (r["arch"], r["batch"]) == ("gqa", 1)), None)
    target = f">= {HF_RATIO_TARGET:.0f}x"
    if row is None:
        return Acceptance(check, "not run", target, None)
    return Acceptance(check, f"{row['ratio']:.2f}x", target, judged(device, row["ratio"] >= HF_RATIO_TARGET))


def run_hf(ctx: Context) -> SectionResult:
    grid = ctx.plan.hf
    rows, notes = [], []
    for arch in grid.archs:
        model, hf = build_pair(arch, grid.preset, DTYPES[grid.dtype], ctx.plan.device)
        for batch in grid.batches:
            if ctx.out_of_time():
                notes.append(f"{arch} batch {batch}: not run (time box reached)")
                continue
            row = measured_or_error(lambda: measure_batch(model, hf, batch, grid.run, ctx.copy_gbs * 1e9),
                                    {"arch": arch, "batch": batch})
            if "error" in row:
                notes.append(f"{arch} batch {batch}: {row['error']}")
            else:
                rows.append(row)
            ctx.report.record("hf", row)
        del model, hf
        free_device_memory()
    run = grid.run
    text = (f"`{grid.preset}` size, {grid.dtype}, prompt {run.prompt_len}, {run.new_tokens} new tokens, greedy, "
            f"{run.kv_cache}, median of {run.repeats} runs alternating sides; decode rate = batch x (N - 1) / "
            f"(time(N tokens) - time(1 token)) (benchmarks/decode_vs_hf.py).\n\n" + markdown(rows, HF_COLUMNS)
            + "".join(f"\n- {note}" for note in notes))
    return SectionResult(text, [hf_acceptance(rows, grid.dtype, ctx.plan.device)])


# ---- e. zoo compare's GPU default --------------------------------------------------------------------------------

COMPARE_CHARTS = ("step_vs_floor.png", "cache_bytes_vs_context.png")  # the two the summary keeps


def compare_rows(folder: Path) -> list[dict]:
    path = folder / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def partial_charts(rows: list[dict], folder: Path) -> str:
    """A run cut short by its time box never drew its charts: draw them from its rows; what went wrong, or ""."""
    try:
        write_charts(rows, folder)
        return ""
    except Exception as error:  # the rows and their table stand without the charts
        return f"its charts could not be drawn from the rows it wrote: {type(error).__name__}: {error}"


def run_compare(ctx: Context) -> SectionResult:
    timeout = max(ctx.time_left(), MIN_SECTION_S)
    with tempfile.TemporaryDirectory(prefix="gpu_check_compare_") as folder:
        folder = Path(folder)
        command = [sys.executable, "-m", "harness.cli", "compare", *ctx.plan.compare_argv, "--out", str(folder),
                   "--quiet"]
        start = time.monotonic()
        output, status = run_with_timeout(command, ctx.plan, timeout)
        wall_s = time.monotonic() - start
        rows = compare_rows(folder)
        for row in rows:
            ctx.report.record("compare", row)
        chart_note = partial_charts(rows, folder) if status is None and rows else ""
        kept = [name for name in COMPARE_CHARTS if (folder / name).exists()]
        for name in kept:
            with ctx.report.chart(f"compare_{name}") as path:
                shutil.copyfile(folder / name, path)
    verdict = (f"stopped at its time box ({timeout:.0f} s) after {len(rows)} rows" if status is None
               else f"finished with exit status {status} in {wall_s:.0f} s")
    ceilings = [line for line in output.splitlines() if line.startswith("roofline ceilings")]
    text = (f"`python -m harness.cli compare {' '.join(ctx.plan.compare_argv)}`: {verdict}. Charts kept: "
            f"{', '.join(f'compare_{name}' for name in kept) or 'none'}{'; ' + chart_note if chart_note else ''}.\n\n"
            + (markdown_table(rows) if rows else "(no rows)\n") + "".join(f"\n{line}\n" for line in ceilings)
            + (f"\nOutput tail:\n\n```\n{output[-1500:]}\n```\n" if status != 0 else ""))
    return SectionResult(text)


# ---- the run ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    run: Callable[[Context], SectionResult]


SECTIONS = [Section("tests", "a. CUDA-only tests", run_tests),
            Section("kernels", "b. Triton kernels against the copy bandwidth", run_kernels),
            Section("decode", "c. Decode step against its floor, CUDA graphs on and off", run_decode),
            Section("hf", "d. archzoo against transformers generate", run_hf),
            Section("compare", "e. zoo compare: the GPU default", run_compare)]


def machine(plan: Plan, copy_gbs: float) -> dict:
    """The run's device and versions, as the first results row."""
    return {"device": torch.cuda.get_device_name() if plan.device == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "copy_gb_s": copy_gbs}


def heading(plan: Plan, copy_gbs: float, smoke: bool, budget_s: float) -> str:
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        device = (f"{torch.cuda.get_device_name()} (compute capability {props.major}.{props.minor}, "
                  f"{props.total_memory / 2**30:.1f} GiB)")
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    mode = "smoke (CPU, tiny sizes: a test of this script, not a measurement)" if smoke else "GPU"
    return (f"# archzoo GPU check\n\n- device: {device}\n- torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"triton {triton.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}"
            f"\n- measured copy bandwidth: {copy_gbs:.0f} GB/s ({plan.copy_bytes / 2**20:.0f} MiB device-to-device "
            f"copy, bytes read + written)\n- mode: {mode}; time budget {budget_s:.0f} s")


def run_section(section: Section, ctx: Context) -> None:
    free_device_memory()  # what the run held before (the copy's buffers, the previous section's models)
    start = time.monotonic()
    try:
        result, error = section.run(ctx), ""
    except Exception:  # recorded in the summary; the next section runs
        result, error = None, traceback.format_exc(limit=-4)
    ctx.report.add(section.title, time.monotonic() - start, result, error)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help=f"folder for summary.md, results.jsonl and charts "
                                                           f"(at most {MAX_FILES} files)")
    p.add_argument("--smoke", action="store_true", help="the same flow on the CPU at tiny sizes, in under 90 s")
    p.add_argument("--budget-s", type=float, help="seconds for all sections, shared in the plan's proportions "
                                                  "(default: 425 on a GPU, 95 for --smoke)")
    p.add_argument("--sections", default=",".join(s.key for s in SECTIONS),
                   help=f"comma-separated subset of {','.join(s.key for s in SECTIONS)} (default: all)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    if plan.threads:
        torch.set_num_threads(plan.threads)
    wanted = args.sections.split(",")
    unknown = sorted(set(wanted) - {s.key for s in SECTIONS})
    if unknown or (plan.device == "cuda" and not torch.cuda.is_available()):
        print(f"gpu_check: error: {f'unknown sections {unknown}' if unknown else 'no CUDA device: run --smoke'}",
              file=sys.stderr)
        return 2
    sections = [s for s in SECTIONS if s.key in wanted]
    shares = {s.key: getattr(plan.budgets, s.key) for s in sections}
    budget_s = args.budget_s or sum(shares.values())
    start = time.monotonic()
    copy_gbs = kernels_gpu.copy_bandwidth_gbs(plan.device, plan.copy_bytes)
    report = Report(args.out, heading(plan, copy_gbs, args.smoke, budget_s))
    report.record("run", {**machine(plan, copy_gbs), "smoke": args.smoke, "budget_s": budget_s})
    ctx = Context(plan, report, copy_gbs)
    spent_share = 0.0
    for section in sections:
        spent_share += shares[section.key] / sum(shares.values())
        # the plan's cumulative schedule: time a section leaves unused passes to the next
        ctx.deadline = max(start + budget_s * spent_share, time.monotonic() + MIN_SECTION_S)
        run_section(section, ctx)
    report.finish(time.monotonic() - start)
    print(report.markdown())
    print(f"gpu_check: {time.monotonic() - start:.0f} s; wrote {', '.join(sorted(report.files))} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
