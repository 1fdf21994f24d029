"""benchmarks/moe_quality.py in a smoke run (a few steps): a language-model and an MQAR row per model, the parameter
equalities, the MoE's routing statistics, the table, resume, and bad options refused before any work (the
qualities are the script's to report, not a test's to assert)."""
import importlib.util
import json
import sys

import pytest

import zoo
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports moe_tradeoff.py beside it, as a script run there would
spec = importlib.util.spec_from_file_location("moe_quality", REPO_ROOT / "benchmarks" / "moe_quality.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = zoo.PRESETS["tiny"]


def argv(tmp_path, *extra):
    corpus = tmp_path / "corpus.txt"  # a small corpus: the standard library takes seconds to read
    corpus.write_text(REPO_ROOT.joinpath("zoo", "registry.py").read_text() * 4)
    return ["--lm-steps", "2", "--mqar-steps", "2", "--mqar-examples", "64", "--mqar-test-examples", "32",
            "--eval-windows", "8", "--corpus", str(corpus), "--out", str(tmp_path / "out"), *extra]


def test_rows_equalities_routing_table_and_resume(tmp_path, capsys):
    assert bench.main(argv(tmp_path)) == 0
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    rows = {(r["model"], r["task"]): r for r in map(json.loads, lines)}
    assert sorted(rows) == sorted((m, t) for m in ("moe", "dense-active", "dense-total") for t in ("lm", "mqar"))
    routers = TINY.n_layers * TINY.d_model * 8  # 8 experts: the MoE's only weights without a dense counterpart
    moe = zoo.parameter_counts(zoo.build("moe", preset="tiny"))
    assert rows["dense-total", "lm"]["params_total"] == moe.total - routers
    assert rows["dense-active", "lm"]["params_total"] == moe.active - routers
    for model in ("moe", "dense-active", "dense-total"):
        assert 0 < rows[model, "lm"]["val_bpb"] < 9 and 0 <= rows[model, "mqar"]["mqar_accuracy"] <= 1
    assert 1 <= rows["moe", "lm"]["load_max_over_mean"] <= 8 / 2  # top 2 of 8: at most 4x the mean
    assert rows["dense-total", "lm"]["load_max_over_mean"] is None
    table = (tmp_path / "out" / "table.md").read_text()
    assert table.count("\n") == 2 + 3 and "val bpb" in table
    capsys.readouterr()
    assert bench.main(argv(tmp_path)) == 0  # resumed: nothing trains again
    assert "moe lm:" not in capsys.readouterr().out
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("bad", [["--lm-steps", "0"], ["--mqar-examples", "-1"], ["--seed", "-2"]])
def test_bad_options_are_refused_before_work(tmp_path, capsys, bad):
    assert bench.main(argv(tmp_path) + bad) == 2
    assert "error" in capsys.readouterr().err and not (tmp_path / "out" / "results.jsonl").exists()
