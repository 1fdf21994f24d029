"""benchmarks/fused_halves.py on the tiny preset: one row per cell with both medians, the module path restored after,
resume, bad arguments."""
import importlib.util
import json
import sys

import pytest

import zoo
from attention.attention import Attention
from ssm.mamba2 import Mamba2
from tests.conftest import REPO_ROOT
from zoo.ffn.swiglu import SwiGLU

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports roofline.py beside it, as a script run there would
spec = importlib.util.spec_from_file_location("fused_halves", REPO_ROOT / "benchmarks" / "fused_halves.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def argv(tmp_path, *extra):
    return ["--preset", "tiny", "--archs", "gqa", "--batches", "2", "--contexts", "12", "--rounds", "1", "--steps",
            "2", "--out", str(tmp_path), *extra]


def test_a_cell_row_and_resume(tmp_path, capsys):
    methods = Attention.decode_half, SwiGLU.decode_half
    assert bench.main(argv(tmp_path)) == 0
    assert (Attention.decode_half, SwiGLU.decode_half) == methods  # the fused halves are back
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["fused_ms_p50"] > 0 and row["modules_ms_p50"] > 0
    assert row["fused_over_modules"] == pytest.approx(row["fused_ms_p50"] / row["modules_ms_p50"])
    assert row["classes"] == ["Attention", "SwiGLU"]
    assert "| gqa | float32 | 2 | 12 |" in capsys.readouterr().out
    assert bench.main(argv(tmp_path)) == 0  # finished cells are not measured again
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 1


def test_the_fused_classes_are_the_models_own():
    assert bench.fused_classes(zoo.build("mamba2", preset="tiny")) == {Mamba2, SwiGLU}


@pytest.mark.parametrize("extra,message", [
    (["--archs", "diffusion"], "not causal"), (["--archs", "gpt5"], "gpt5"), (["--dtypes", "float8"], "float8"),
    (["--rounds", "0"], "rounds and steps must be >= 1"), (["--contexts", "0"], "contexts"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, extra, message):
    assert bench.main(argv(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()
