"""benchmarks/compile_vs_eager.py on the tiny preset: one row per cell with both medians, resume, bad arguments."""
import importlib.util
import json
import sys

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports roofline.py beside it, as a script run there would
spec = importlib.util.spec_from_file_location("compile_vs_eager", REPO_ROOT / "benchmarks" / "compile_vs_eager.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def argv(tmp_path, *extra):
    return ["--preset", "tiny", "--archs", "gqa", "--batches", "2", "--contexts", "12", "--layouts", "paged",
            "--steps", "2", "--out", str(tmp_path), *extra]


def test_a_cell_row_and_resume(tmp_path, capsys):
    assert bench.main(argv(tmp_path)) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["eager_ms_p50"] > 0 and row["compiled_ms_p50"] > 0
    assert row["compiled_over_eager"] == pytest.approx(row["compiled_ms_p50"] / row["eager_ms_p50"])
    assert "| gqa | float32 | 2 | 12 | paged |" in capsys.readouterr().out
    assert bench.main(argv(tmp_path)) == 0  # finished cells are not measured again
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("extra,message", [
    (["--archs", "diffusion"], "not causal"), (["--archs", "gpt5"], "gpt5"), (["--dtypes", "float8"], "float8"),
    (["--layouts", "ring"], "ring"), (["--steps", "0"], "steps must be >= 1"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, extra, message):
    assert bench.main(argv(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()
