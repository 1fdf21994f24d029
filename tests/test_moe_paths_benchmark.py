"""benchmarks/moe_paths.py at small widths: each path checked against the dense one, one table row per token count
(the timings themselves are the script's to report, not a test's to assert)."""
import importlib.util
import sys

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports roofline.py beside it, as a script run there would
spec = importlib.util.spec_from_file_location("moe_paths", REPO_ROOT / "benchmarks" / "moe_paths.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_one_row_per_token_count(capsys):
    assert bench.main(["--tokens", "1,3", "--d-model", "32", "--expert-hidden", "48", "--reps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "tokens" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"top_k .* must be an integer in \[1, n_experts=4\], got 5"):
        bench.main(["--experts", "4", "--top-k", "5", "--d-model", "8", "--expert-hidden", "8"])
