"""benchmarks/quant_quality.py's AWQ-against-RTN summary: differences by file, with the most drawn file apart."""
import importlib.util

import pytest

from harness.paired_stats import paired_difference
from tests.conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("quant_quality_benchmark", REPO_ROOT / "benchmarks" / "quant_quality.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_awq_against_rtn_clusters_by_file_and_splits_off_the_most_drawn_file():
    files = ["big.py"] * 5 + ["a.py", "a.py", "b.py", "c.py"]
    awq = {"agreement": [0.1, 0.2, 0.1, 0.3, 0.2, 0.9, 0.8, 0.5, 0.6], "first_difference": [3, 4, 5, 6, 7, 9, 9, 1, 2]}
    rtn = {"agreement": [0.3, 0.3, 0.2, 0.4, 0.4, 0.5, 0.6, 0.5, 0.4], "first_difference": [3, 3, 3, 3, 3, 3, 3, 3, 3]}
    row = bench.awq_against_rtn(awq, rtn, files)
    assert (row["agreement_files"], row["top_file"], row["top_file_prompts"]) == (4, "big.py", 5)
    for measure in awq:
        d = [x - y for x, y in zip(awq[measure], rtn[measure])]
        assert row[f"{measure}_vs_rtn"] == pytest.approx(sum(d) / len(d))
        assert row[f"{measure}_vs_rtn_se"] == pytest.approx(paired_difference(awq[measure], rtn[measure], files)[1])
        assert row[f"{measure}_vs_rtn_top_file"] == pytest.approx(sum(d[:5]) / 5)  # within big.py, prompt by prompt
        assert row[f"{measure}_vs_rtn_top_file_se"] == pytest.approx(paired_difference(awq[measure][:5], rtn[measure][:5])[1])
        assert row[f"{measure}_vs_rtn_other_files"] == pytest.approx(sum(d[5:]) / 4)
        assert row[f"{measure}_vs_rtn_other_files_se"] == pytest.approx(
            paired_difference(awq[measure][5:], rtn[measure][5:], files[5:])[1])


def test_awq_against_rtn_on_a_single_file_corpus_counts_prompts():
    awq, rtn = {"agreement": [0.5, 0.7, 0.6]}, {"agreement": [0.4, 0.4, 0.7]}
    row = bench.awq_against_rtn(awq, rtn, ["one.txt"] * 3)
    assert row["agreement_vs_rtn_se"] == pytest.approx(paired_difference(awq["agreement"], rtn["agreement"])[1])
    assert row["agreement_vs_rtn_top_file"] == pytest.approx(row["agreement_vs_rtn"])
    assert "agreement_vs_rtn_other_files" not in row
