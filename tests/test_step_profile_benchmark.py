"""benchmarks/step_profile.py on the tiny preset: the layout and dtype it was asked for, and the compiled step only
when asked."""
import importlib.util

from tests.conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("step_profile", REPO_ROOT / "benchmarks" / "step_profile.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_profiles_the_layout_and_dtype_asked_for(tmp_path, capsys):
    args = ["--device", "cpu", "--preset", "tiny", "--context", "12", "--steps", "2", "--out", str(tmp_path)]
    assert bench.main([*args, "--kv-cache", "paged", "--dtype", "bfloat16"]) == 0
    text = (tmp_path / "step_profile.md").read_text()
    assert "gqa `tiny`, batch 1, context 12, bfloat16, cpu" in text and "## eager, paged cache" in text
    assert "## compiled" not in text and text in capsys.readouterr().out  # printed too
    assert bench.main(args) == 0  # the CPU's compare defaults: float32 in a contiguous cache
    text = (tmp_path / "step_profile.md").read_text()
    assert "float32, cpu" in text and "## eager, contiguous cache" in text
