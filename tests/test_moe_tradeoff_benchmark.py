"""benchmarks/moe_tradeoff.py on the tiny preset: a row per model x batch, the parameter equalities, experts read
within their bounds, the table and chart, resume, and bad options refused before any work (the timings are the
script's to report, not a test's to assert)."""
import importlib.util
import json
import sys

import pytest

import zoo
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports roofline.py beside it, as a script run there would
spec = importlib.util.spec_from_file_location("moe_tradeoff", REPO_ROOT / "benchmarks" / "moe_tradeoff.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = zoo.PRESETS["tiny"]
EXPERTS, TOP_K = 8, 2  # the registry's moe defaults


def argv(tmp_path, *extra):
    return ["--preset", "tiny", "--batches", "1,2", "--context", "16", "--steps", "2", "--out", str(tmp_path), *extra]


def test_rows_equalities_table_chart_and_resume(tmp_path, capsys, monkeypatch):
    assert bench.main(argv(tmp_path)) == 0
    out = capsys.readouterr().out
    rows = {(r["model"], r["batch"]): r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert sorted(rows) == sorted((m, b) for m in ("moe", "dense-active", "dense-total") for b in (1, 2))
    moe, active, total = rows["moe", 1], rows["dense-active", 1], rows["dense-total", 1]
    routers = TINY.n_layers * TINY.d_model * EXPERTS  # the MoE's only weights without a dense counterpart
    assert (active["ffn_hidden"], total["ffn_hidden"]) == (TOP_K * TINY.mlp_hidden, EXPERTS * TINY.mlp_hidden)
    assert active["params_total"] == active["params_active"] == moe["params_active"] - routers
    assert total["params_total"] == total["params_active"] == moe["params_total"] - routers
    for batch in (1, 2):
        r = rows["moe", batch]
        assert TOP_K <= r["experts_read"] <= min(EXPERTS, TOP_K * batch)
        assert r["experts_read_uniform"] == pytest.approx(zoo.expected_experts_read(EXPERTS, TOP_K, batch))
        assert rows["dense-total", batch]["experts_read"] is None
    for r in rows.values():
        assert r["step_ms_p50"] > 0 and r["floor_ms"] > 0 and 0 < r["mbu"] and r["weight_bytes"] > 0
    assert moe["step_weight_bytes"] < total["step_weight_bytes"]  # batch 1 reads 2 of the 8 experts
    assert "| moe | 2 |" in out and "at batch 9" in out  # the analytic one: 8 (1 - 0.75^9) >= 7.2 > 8 (1 - 0.75^8)
    assert "analytic: " in (tmp_path / "table.md").read_text()
    assert (tmp_path / "tradeoff.png").stat().st_size > 0
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("a finished row was measured again"))
    monkeypatch.setattr(bench, "measure_rates", lambda *a: pytest.fail("the rates were measured with nothing to do"))
    assert bench.main(argv(tmp_path)) == 0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("extra, message", [
    (("--preset", "huge"), "unknown preset 'huge'"),
    (("--batches", "0,2"), "batches must be >= 1, got 0"),
    (("--batches", "2,2"), "batches must be distinct, got 2,2"),
    (("--context", "600"), "max_seq_len=512"),
])
def test_bad_options_are_refused_before_any_work(tmp_path, capsys, extra, message):
    assert bench.main(argv(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()


def test_a_batch_list_that_is_not_integers_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv(tmp_path, "--batches", "1,two"))
    assert exit_.value.code == 2 and "expected comma-separated integers, got '1,two'" in capsys.readouterr().err
