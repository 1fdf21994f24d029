"""benchmarks/roofline.py on the tiny preset: rows per cell, resume, table, chart, and arguments refused up front."""
import importlib.util
import json

import pytest

from tests.conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("roofline_benchmark", REPO_ROOT / "benchmarks" / "roofline.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def argv(tmp_path, *extra):
    return ["--preset", "tiny", "--archs", "gqa,mamba", "--batches", "1", "--contexts", "16", "--dtypes", "float32",
            "--steps", "2", "--out", str(tmp_path), "--figure", str(tmp_path / "roofline.png"), *extra]


def test_smoke_rows_table_chart_and_resume(tmp_path, capsys, monkeypatch):
    assert bench.main(argv(tmp_path)) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["arch"], r["kv_cache"]) for r in rows] == [("gqa", "contiguous"), ("gqa", "paged"),
                                                          ("mamba", "contiguous"), ("mamba", "paged")]
    for r in rows:
        assert r["step_ms_p50"] > 0 and r["floor_ms"] > 0 and r["bound"] in ("memory", "compute")
        assert r["fraction_of_floor"] == pytest.approx(r["step_ms_p50"] / r["floor_ms"])
        assert r["stream_gb_s"] > 0 and r["matmul_gflop_s"] > 0 and r["weight_mb"] > 0 and r["compile"] is False
    assert len({(r["read_gb_s"], r["gemv_gb_s"]) for r in rows}) == 1  # one machine measurement per dtype per run
    assert "| gqa | float32 | 1 | 16 | paged |" in out
    assert (tmp_path / "roofline.png").stat().st_size > 0
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("a finished cell was measured again"))
    assert bench.main(argv(tmp_path)) == 0


@pytest.mark.parametrize("extra, message", [
    (("--archs", "gqa,nope"), "unknown architecture 'nope'"),
    (("--archs", "diffusion"), "'diffusion' is not causal"),
    (("--dtypes", "float16"), "unknown dtype 'float16'; allowed: bfloat16, float32"),
    (("--layouts", "ragged"), "unknown layout 'ragged'; allowed: contiguous, paged"),
    (("--contexts", "600"), "max_seq_len=512"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, extra, message):
    assert bench.main(argv(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()
