"""`zoo compare` and `zoo generate` with a masked diffusion LM: rows in the autoregressive schema plus steps,
forwards per token and agreement with the no-cache sampler; the tokens/s-vs-steps chart; errors before work."""
import json

import matplotlib.image
import pytest

import zoo
from harness import cli
from harness.compare import CompareSettings, run_compare
from harness.compare_diffusion import default_block_length, default_steps


def settings(tmp_path, **kw) -> CompareSettings:
    kw = {"archs": ["gqa", "diffusion"], "preset": "tiny", "contexts": [12], "batches": [1, 2], "new_tokens": 8,
          "out": tmp_path, **kw}
    return CompareSettings(**kw)


def test_default_steps_follow_the_issue():
    assert default_steps(64, default_block_length(64)) == [64, 16, 4]  # gen, gen/4, gen/16 with two 32-token blocks
    assert default_block_length(16) == 16 and default_steps(16, 16) == [16, 4, 1]
    assert default_steps(8, 4) == [8, 2]  # 8/16 is not whole; every count is a multiple of the 2 blocks


@pytest.mark.usefixtures("machine_rates_once")
def test_diffusion_rows(tmp_path):
    rows = run_compare(settings(tmp_path), show_progress=False)
    ar = [r for r in rows if r["arch"] == "gqa"]
    diffusion = [r for r in rows if r["arch"] == "diffusion"]
    assert len(ar) == 2 and all(r["steps"] is None for r in ar)
    assert len(diffusion) == 2 * 2 * 3  # batches x steps {8, 2} x caches
    assert {(r["steps"], r["diffusion_cache"]) for r in diffusion} == {(s, c) for s in (8, 2) for c in ("none", "prefix", "dual")}
    model = zoo.build("diffusion", preset="tiny")
    for r in diffusion:
        assert r["block_length"] == 8 and r["forward_passes"] == r["steps"]
        assert r["forwards_per_token"] == r["steps"] / 8 and r["tokens_per_forward"] == 8 / r["steps"]
        assert r["ttft_ms"] > 0 and r["output_tok_s"] > 0
        if r["diffusion_cache"] == "none":
            assert r["analytic_cache_bytes"] == r["measured_cache_bytes"] == 0 and r["agreement_vs_no_cache"] is None
        else:  # every position's K/V of every row, as the analytic formula counts it
            assert r["analytic_cache_bytes"] == zoo.cache_bytes(model, seq_len=12 + 8, batch=r["batch"])
            assert r["measured_cache_bytes"] == r["analytic_cache_bytes"]  # equal lengths: no padding rows
            assert 0.0 <= r["agreement_vs_no_cache"] <= 1.0
    on_disk = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(on_disk) == len(rows)
    assert run_compare(settings(tmp_path), show_progress=False) == rows  # a re-run measures nothing new


@pytest.mark.usefixtures("machine_rates_once")
def test_cli_compare_writes_the_diffusion_table_and_chart(tmp_path, capsys):
    argv = ["compare", "--archs", "gqa,diffusion", "--preset", "tiny", "--contexts", "12,20", "--batches", "1",
            "--new-tokens", "8", "--block-length", "4", "--diffusion-steps", "8,2", "--diffusion-caches", "none,dual",
            "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    table = (tmp_path / "table.md").read_text()
    assert "Masked diffusion LM" in table and "| diffusion | 12 | 1 | 8 | 4 | dual |" in table
    image = matplotlib.image.imread(tmp_path / "diffusion_tok_s_vs_steps.png")
    assert image.shape[1] > 2 * image.shape[0]  # one panel per context, side by side
    assert "diffusion_tok_s_vs_steps.png" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--block-length", "3"], "block_length=3 must divide new_tokens=8"),
    (["--block-length", "4", "--diffusion-steps", "3"], "multiple of the block count"),
    (["--diffusion-caches", "none,full"], "unknown diffusion cache"),
])
def test_bad_diffusion_settings_fail_before_any_work(tmp_path, capsys, extra, message):
    argv = ["compare", "--archs", "gqa,diffusion", "--preset", "tiny", "--contexts", "12", "--batches", "1",
            "--new-tokens", "8", "--out", str(tmp_path), "--quiet", *extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()


def test_cli_generate_with_a_diffusion_lm(capsys):
    argv = ["generate", "--arch", "diffusion", "--preset", "tiny", "--prompt", "hello", "--max-new-tokens", "8",
            "--steps", "4", "--block-length", "4", "--diffusion-cache", "dual"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("hello")
    assert "8 tokens in 4 forward passes (2.00 tokens/forward)" in captured.err
    bad = argv[:-4] + ["--steps", "3", "--block-length", "4"]
    assert cli.main(bad) == 2 and "steps=3" in capsys.readouterr().err


def test_generate_without_a_prompt(capsys):
    """The issue's command has no --prompt: a diffusion LM fills the answer from nothing; an autoregressive
    model needs a first token and says so."""
    assert cli.main(["generate", "--arch", "diffusion", "--preset", "tiny", "--max-new-tokens", "4", "--steps", "4"]) == 0
    assert "4 tokens in 4 forward passes" in capsys.readouterr().err
    assert cli.main(["generate", "--arch", "gqa", "--preset", "tiny", "--max-new-tokens", "4"]) == 2
    assert "empty prompt" in capsys.readouterr().err
