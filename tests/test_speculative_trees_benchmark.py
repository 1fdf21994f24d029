"""benchmarks/speculative_trees.py on tiny random models: every shape's row (chains, branches, a budget tree, two
drafts, prompt lookup, lookahead), each with the target alone's greedy outputs, the chart, and resume (the timings
are the script's to report, not a test's to assert)."""
import importlib.util
import json
import sys

import zoo
from helpers import random_model
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports speculative_drafts.py beside it, as a script would
spec = importlib.util.spec_from_file_location("speculative_trees", REPO_ROOT / "benchmarks" / "speculative_trees.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_every_shape_keeps_greedy_output_and_a_rerun_adds_nothing(tmp_path, capsys):
    target = zoo.save(random_model("gqa"), tmp_path / "target")
    drafts = [zoo.save(random_model("gqa", seed=s, n_layers=1), tmp_path / f"draft{s}") for s in (3, 4)]
    argv = ["--target", str(target), "--drafts", f"a={drafts[0]},b={drafts[1]}", "--widths", "4", "--batches", "1",
            "--requests", "1", "--new-tokens", "6", "--prompt-len", "8", "--out", str(tmp_path / "out")]
    bench.main(argv)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    cells = {(r["proposer"], r["shape"]) for r in rows}
    assert {("a", "chain"), ("a", "2 branches"), ("a", "4 branches"), ("a", "budget tree"), ("b", "chain"),
            ("two drafts", "2 drafts x 1 chain"), ("prompt lookup", "4 branches"), ("lookahead", "2 branches"),
            ("(target alone)", "")} <= cells
    alone = next(r for r in rows if r["proposer"] == "(target alone)")["outputs"]
    assert all(r["outputs"] == alone for r in rows)
    assert (tmp_path / "out" / "trees_vs_width.png").stat().st_size > 0
    assert "| a | 2 branches | 4 | 1 |" in capsys.readouterr().out
    bench.main(argv)
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == len(rows)
