"""`zoo compare` and the CLI: rows written per cell, resume after an interruption, charts, help text."""
import json

import pytest

import zoo
from harness import Engine, cli, compare, roofline
from harness.compare import CompareSettings, run_compare
from helpers import spread_weights  # tests/ is on sys.path under pytest


def tiny_settings(tmp_path, **kw) -> CompareSettings:
    return CompareSettings(archs=["mha", "mqa"], preset="tiny", contexts=[16, 32], batches=[1, 2], new_tokens=3, out=tmp_path, **kw)


def test_rows_have_measured_and_analytic_bytes(tmp_path):
    rows = run_compare(tiny_settings(tmp_path), show_progress=False)
    assert len(rows) == 8
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8
    for row in rows:
        model = zoo.build(row["arch"], preset="tiny")
        # contiguous layout: allocated bytes are exactly the analytic bytes of batch rows at max_seq_len
        assert row["measured_cache_bytes"] == row["analytic_cache_bytes"]
        assert row["analytic_cache_bytes"] == zoo.cache_bytes(model, seq_len=row["context"] + 3, batch=row["batch"])
        assert row["ttft_ms"] > 0 and row["tpot_ms"] > 0 and row["decode_tok_s"] > 0 and row["mbu"] > 0
        assert row["step_ms_p50"] > 0 and row["floor_ms"] > 0 and row["prefill_floor_ms"] > 0
        assert row["fraction_of_floor"] == pytest.approx(row["step_ms_p50"] / row["floor_ms"])
        assert row["bound"] in ("memory", "compute") and 0 < row["mfu"]
        assert row["floor_context"] == row["context"] + 0  # 3 new tokens: decode steps from context and context + 1
        assert row["stream_gb_s"] > 0 and row["matmul_gflop_s"] > 0
        # the floor: the step's bytes at the read rate recorded for them, never torch's GEMV rate
        rates = roofline.MachineRates(row["stream_gb_s"] * 1e9, row["matmul_gflop_s"] * 1e9, "float32", "cpu", "")
        step = roofline.decode_step_cost(model, row["batch"], row["context"])
        assert row["floor_ms"] == pytest.approx(1000 * roofline.floor_seconds(step, rates))
        assert row["gemv_gb_s"] > 0 and row["read_gb_s"] > 0 and row["run_read_gb_s"] > 0
        # a CPU cell's floor: the faster of the read sweeps just before and after its steps, both recorded
        assert row["stream_gb_s"] == pytest.approx(max(row["read_before_gb_s"], row["read_after_gb_s"]))
        assert row["read_moved"] == (abs(row["read_before_gb_s"] - row["read_after_gb_s"])
                                     > 0.15 * row["stream_gb_s"])
    # one measurement of the library's and the matmul's rates per run: every row carries the same
    assert len({(r["run_read_gb_s"], r["gemv_gb_s"], r["matmul_gflop_s"]) for r in rows}) == 1
    # the read sweeps are each cell's own: no two cells' sweeps read identically to the last bit
    assert len({(r["read_before_gb_s"], r["read_after_gb_s"]) for r in rows}) == len(rows)
    mha = next(r for r in rows if r["arch"] == "mha")
    mqa = next(r for r in rows if r["arch"] == "mqa" and r["context"] == mha["context"] and r["batch"] == mha["batch"])
    assert mha["analytic_cache_bytes"] == 4 * mqa["analytic_cache_bytes"]  # tiny: 4 heads vs 1 KV head


@pytest.mark.usefixtures("machine_rates_once")
def test_each_cpu_cell_is_priced_at_the_read_sweeps_around_its_steps(tmp_path, monkeypatch):
    """Not the run's start-of-run rate: the faster of the sweeps just before and after the cell's steps, each cell its
    own, and a cell whose sweeps differ by more than 15% is marked as run across a change."""
    sizes = tuple(2**k for k in range(20, 31))  # measure_read_rates' sizes: 1 MiB to 1 GiB
    sweeps = iter([10e9, 40e9, 20e9, 21e9])  # cell 1: before, after; cell 2: before, after (bytes/s at every size)
    monkeypatch.setattr(compare, "cell_read_rates",
                        lambda buffer, step_bytes: roofline.ReadRates(sizes, (next(sweeps),) * len(sizes)))
    settings = CompareSettings(archs=["gqa"], preset="tiny", contexts=[16], batches=[1, 2], new_tokens=3, out=tmp_path)
    rows = run_compare(settings, show_progress=False)
    assert [(r["read_before_gb_s"], r["read_after_gb_s"], r["read_moved"]) for r in rows] == [
        (10.0, 40.0, True), (20.0, 21.0, False)]
    for row, rate in zip(rows, (40e9, 21e9)):
        step = roofline.decode_step_cost(zoo.build("gqa", preset="tiny"), row["batch"], row["floor_context"])
        assert row["stream_gb_s"] == pytest.approx(rate / 1e9) and row["read_gb_s"] == pytest.approx(rate / 1e9)
        floor = roofline.floor_seconds(step, roofline.MachineRates(rate, row["matmul_gflop_s"] * 1e9, "float32",
                                                                     "cpu", ""))
        assert row["floor_ms"] == pytest.approx(1000 * floor)
        assert row["run_read_gb_s"] != pytest.approx(rate / 1e9)  # the run's own sweep: a real machine's rate


@pytest.mark.usefixtures("machine_rates_once")
def test_interrupted_run_resumes_without_redoing_cells(tmp_path, monkeypatch):
    real = compare.measure_cell
    calls = []

    def dies_on_third(model, cell, peak, seed, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(cell)
        return real(model, cell, peak, seed, **kwargs)

    monkeypatch.setattr(compare, "measure_cell", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_compare(tiny_settings(tmp_path), show_progress=False)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2

    redone = []
    monkeypatch.setattr(compare, "measure_cell", lambda *a, **k: redone.append(a[1]) or real(*a, **k))
    rows = run_compare(tiny_settings(tmp_path), show_progress=False)
    assert len(rows) == 8 and len(redone) == 6
    assert not any(c in calls for c in redone)
    # a third run has nothing left to do
    redone.clear()
    run_compare(tiny_settings(tmp_path), show_progress=False)
    assert redone == []


@pytest.mark.usefixtures("machine_rates_once")
def test_cli_compare_writes_table_and_charts(tmp_path, capsys):
    argv = ["compare", "--archs", "gqa", "--preset", "tiny", "--contexts", "16", "--batches", "1,2",
            "--new-tokens", "3", "--kv-cache", "paged", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| gqa | 16 | 2 |" in out and "TPOT (ms)" in out
    assert "step p50 / floor (ms)" in out and "GB/s (past any cache)" in out and "torch's GEMV reaches" in out
    for name in ("results.jsonl", "table.md", "cache_bytes_vs_context.png", "decode_throughput_vs_batch.png",
                 "latency_vs_context.png", "step_vs_floor.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert {json.loads(line)["kv_cache"] for line in (tmp_path / "results.jsonl").read_text().splitlines()} == {"paged"}


def test_compare_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = capsys.readouterr().out
    for option in ("--archs", "--preset", "--contexts", "--batches", "--new-tokens", "--dtype", "--kv-cache",
                   "--block-size", "--device", "--seed", "--out", "--quiet"):
        assert option in text


def test_bad_compare_settings_fail_before_any_work(tmp_path, capsys):
    assert cli.main(["compare", "--archs", "gqa,nope", "--preset", "tiny", "--out", str(tmp_path)]) == 2
    assert "unknown architecture 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()
    with pytest.raises(ValueError, match="max_seq_len"):
        run_compare(CompareSettings(preset="tiny", contexts=[100000], out=tmp_path), show_progress=False)


def test_cli_list_and_generate(capsys):
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == zoo.architectures()
    assert cli.main(["generate", "--arch", "mqa", "--preset", "tiny", "--prompt", "hello", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("hello") and "5 tokens" in captured.err


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_cli_generate_loads_weights(tmp_path, capsys, suffix):
    import torch
    from safetensors.torch import save_model

    trained = spread_weights(zoo.build("gqa", preset="tiny"), seed=123)  # a "trained" model: varied output
    path = tmp_path / f"weights{suffix}"
    save_model(trained, str(path)) if suffix == ".safetensors" else torch.save(trained.state_dict(), path)
    argv = ["generate", "--arch", "gqa", "--preset", "tiny", "--prompt", "hi", "--max-new-tokens", "6"]
    assert cli.main(argv + ["--weights", str(path)]) == 0
    with_weights = capsys.readouterr().out
    expected = harness_generate(trained, "hi", 6)
    assert with_weights.strip() == ("hi" + expected).strip()
    assert cli.main(argv) == 0
    assert capsys.readouterr().out != with_weights  # random weights give another text: the file was really used


def harness_generate(model, prompt: str, n: int) -> str:
    from harness import Engine, SamplingParams

    tok = zoo.ByteTokenizer()
    out = Engine(model, max_batch=1, max_seq_len=64).generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=(tok.eos_id,)))[0]
    return tok.decode(out.token_ids)


def test_a_cells_clock_starts_after_its_shapes_are_warm():
    """The first call of every shape (a compiled step's compile, the CPU kernels' load) lands in a warm-up at the
    cell's batch size, and the cell's decode statistics hold its own timed steps only."""
    from harness.compare import WARMUP_TOKENS, timed_generate

    model = zoo.build("gqa", preset="tiny").eval()
    cell = {"arch": "gqa", "context": 16, "batch": 2, "new_tokens": 5}
    engine = Engine(model, max_batch=2, max_seq_len=21)
    batches = []
    real_decode = engine.runner.decode
    engine.runner.decode = lambda seqs: batches.append(len(seqs)) or real_decode(seqs)
    fields, step_s = timed_generate(engine, cell, model.config.vocab_size, seed=0)
    assert batches == [2] * (WARMUP_TOKENS - 1 + cell["new_tokens"] - 1)  # warm-up steps, then the timed ones
    assert engine.decode_stats.steps == cell["new_tokens"] - 1 and step_s > 0 and fields["tpot_ms"] > 0
