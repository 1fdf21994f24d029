"""benchmarks/step_split.py on the tiny preset: a row per cell whose parts add up to its step, a plan where every
block has halves and none where one has not (MoE), the patched calls restored after, resume, bad arguments."""
import importlib.util
import json
import sys

import pytest
import torch

from harness import roofline
from kernels import cpu_blocks, cpu_kernels_available
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports roofline.py beside it, as a script run there would
spec = importlib.util.spec_from_file_location("step_split", REPO_ROOT / "benchmarks" / "step_split.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

RATES = roofline.MachineRates(30e9, 1e11, "float32", "cpu", "fixed for the test")  # the split, not the machine


def argv(tmp_path, *extra):
    return ["--preset", "tiny", "--archs", "gqa,moe", "--batches", "2", "--contexts", "12", "--steps", "3", "--out",
            str(tmp_path), *extra]


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C kernels did not build here (a warning said why)")
def test_rows_whose_parts_add_up_and_resume(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(roofline, "measure_machine", lambda model: RATES)
    # each cell's floor at the faster of the sweeps just before and after its steps: 20 then 30 GB/s here
    sweeps = iter([20e9, 30e9] * 2)
    monkeypatch.setattr(roofline, "read_buffer", lambda: torch.empty(0))
    monkeypatch.setattr(roofline, "measure_read_rates",
                        lambda repeats, buffer, also: roofline.ReadRates((2**30,), (next(sweeps),)))
    served, op = dict(cpu_blocks.SERVED), cpu_blocks.decode_blocks_op
    assert bench.main(argv(tmp_path)) == 0
    assert cpu_blocks.SERVED == served and cpu_blocks.decode_blocks_op is op  # the timers are gone
    rows = {row["arch"]: row for row in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert set(rows) == {"gqa", "moe"}
    for row in rows.values():
        parts = sum(row[f"{part}_ms"] for part in bench.PARTS)
        assert parts == pytest.approx(row["step_ms_mean"], rel=1e-6)
        assert row["floor_ms"] == pytest.approx((row["blocks_mb"] + row["between_mb"]) / 30e3 * 1e3, rel=0.05)
        assert row["fraction_of_floor"] == pytest.approx(row["step_ms_mean"] / row["floor_ms"])
        assert (row["read_before_gb_s"], row["read_after_gb_s"], row["read_gb_s"]) == (20, 30, 30)
        assert row["largest_excess"] in bench.PARTS
    assert rows["gqa"]["planned"] and rows["gqa"]["blocks_ms"] > 0 and rows["gqa"]["blocks_gb_s"] > 0
    assert rows["gqa"]["plan_ends_at"] == "head" and rows["gqa"]["between_mb"] == 0  # the norm and head: in the plan
    assert rows["gqa"]["mixer_gb_s"] > 0 and rows["gqa"]["ffn_gb_s"] > 0  # the halves timed without the plan
    assert not rows["moe"]["planned"] and rows["moe"]["blocks_ms"] == 0  # its feed-forward has no half
    assert rows["moe"]["mixer_gb_s"] > 0 and rows["moe"]["ffn_gb_s"] is None
    assert "| gqa | float32 | 2 | 12 |" in capsys.readouterr().out
    assert bench.main(argv(tmp_path)) == 0  # finished cells are not measured again
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("extra,message", [
    (["--archs", "diffusion"], "not causal"), (["--archs", "gpt5"], "gpt5"), (["--dtypes", "float8"], "float8"),
    (["--steps", "0"], "steps must be >= 1"), (["--contexts", "0"], "contexts"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, extra, message):
    assert bench.main(argv(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()
