"""`zoo serve-bench`: the seeded workload and Poisson arrivals, TTFT from the scheduled arrival, every request served
and counted, goodput against its SLOs, resumable rows, and every bad option reported before any work."""
import json
import statistics
import time

import pytest

import zoo
from harness import Engine, SamplingParams, serve_bench
from harness.cli import main
from harness.serve_bench import (Request, ServeBenchSettings, length_range, poisson_arrivals, run_closed_loop,
                                 run_open_loop, run_serve_bench, workload)

FAST = {"archs": ["gqa"], "preset": "tiny", "request_rates": [400.0], "num_requests": 10, "input_len": 24,
        "output_len": 6}  # a few seconds at most: the tiny model serves hundreds of requests a second
CLI_FAST = ["serve-bench", "--archs", "gqa", "--preset", "tiny", "--request-rates", "400", "--num-requests", "6",
            "--input-len", "16", "--output-len", "4", "--quiet"]


def settings(tmp_path, **overrides) -> ServeBenchSettings:
    return ServeBenchSettings(**{**FAST, "out": tmp_path, **overrides})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_engine_model():
    return zoo.build("gqa", preset="tiny").eval()


# ---- workload and arrivals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("rate", [0.5, 4.0, 250.0])
def test_poisson_gaps_are_exponential_with_mean_one_over_rate(seed, rate):
    times = poisson_arrivals(20_000, rate, seed)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g > 0 for g in gaps)
    # the mean of 20,000 exponential gaps is within 3% of 1 / rate (over 4 standard errors), and so is their
    # standard deviation (an exponential's equals its mean)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.05)


def test_one_seed_draws_the_same_arrivals_at_every_rate_scaled():
    slow, fast = poisson_arrivals(50, 2.0, 3), poisson_arrivals(50, 8.0, 3)
    assert fast == pytest.approx([t / 4 for t in slow])
    assert poisson_arrivals(50, 2.0, 4) != slow


def test_random_workload_draws_lengths_and_ids_in_range(tmp_path):
    s = settings(tmp_path, num_requests=200, input_len=40, output_len=10, range_ratio=0.5)
    requests = workload(s, vocab_size=512)
    assert all(20 <= len(r.prompt) <= 60 and 5 <= r.output_len <= 15 for r in requests)
    assert all(0 <= t < 512 for r in requests for t in r.prompt)
    assert len({len(r.prompt) for r in requests}) > 10  # the lengths really vary
    assert workload(s, vocab_size=512) == requests  # seeded


def test_shared_prefix_prompts_share_their_prefixes(tmp_path):
    s = settings(tmp_path, num_requests=40, num_prefixes=3, prefix_len=20, suffix_len=5)
    requests = workload(s, vocab_size=512)
    assert all(len(r.prompt) == 25 for r in requests)
    prefixes = {tuple(r.prompt[:20]) for r in requests}
    assert len(prefixes) == 3  # each request uses one of the 3 system prompts, and all 3 are used
    assert len({tuple(r.prompt[20:]) for r in requests}) == 40  # each has its own suffix


# ---- arrival time and the drivers ------------------------------------------------------------------------------


def test_engine_counts_ttft_from_the_given_arrival(tiny_engine_model):
    engine = Engine(tiny_engine_model, max_batch=2, max_seq_len=32)
    engine.add_request([1, 2, 3], greedy(2), arrival=time.perf_counter() - 0.25)  # arrived a quarter second ago
    out = [e.finished for e in engine.stream() if e.finished][0]
    assert out.metrics.ttft >= 0.25 and out.metrics.e2e >= 0.25


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "now", True])
def test_engine_refuses_a_bad_arrival_and_queues_nothing(tiny_engine_model, bad):
    engine = Engine(tiny_engine_model, max_batch=2, max_seq_len=32)
    with pytest.raises(ValueError, match="arrival .* must be a finite number"):
        engine.add_request([1, 2, 3], greedy(2), arrival=bad)
    assert not engine.has_unfinished() and engine.requests_added == 0


def test_open_loop_gives_each_request_its_scheduled_arrival(tiny_engine_model, monkeypatch):
    engine = Engine(tiny_engine_model, max_batch=4, max_seq_len=32)
    given = []
    add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, arrival: given.append(arrival) or add(*a, arrival=arrival))
    arrivals = [0.0, 0.001, 0.004, 0.02]
    requests = [Request([5, 6, 7], 3)] * 4
    outputs, _ = run_open_loop(engine, requests, [greedy(3)] * 4, arrivals)
    assert len(outputs) == 4
    assert [g - given[0] for g in given] == pytest.approx(arrivals, abs=1e-9)


def test_a_request_added_late_counts_the_lag_in_its_ttft(tiny_engine_model, monkeypatch):
    """The first step takes 0.2 s; the second request, due at 0.01 s, is added after it, and its TTFT must include
    the 0.19 s it waited (a lower bound, whatever the machine's speed)."""
    engine = Engine(tiny_engine_model, max_batch=4, max_seq_len=32)
    step = engine.step_tokens

    def slow_first_step():
        if engine.requests_added == 1:
            time.sleep(0.2)
        return step()

    monkeypatch.setattr(engine, "step_tokens", slow_first_step)
    outputs, _ = run_open_loop(engine, [Request([1, 2], 2), Request([3, 4], 2)], [greedy(2)] * 2, [0.0, 0.01])
    late = next(o for o in outputs if o.request_id == 1)
    assert late.metrics.ttft >= 0.19


def test_closed_loop_keeps_at_most_n_in_flight_and_serves_all(tiny_engine_model, monkeypatch):
    engine = Engine(tiny_engine_model, max_batch=8, max_seq_len=32)
    in_flight = []
    add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a: in_flight.append(len(engine.unfinished) + 1) or add(*a))
    requests = [Request([i + 1, i + 2], 2 + i % 3) for i in range(7)]
    outputs, _ = run_closed_loop(engine, requests, [greedy(r.output_len) for r in requests], 2)
    assert len(in_flight) == 7 and max(in_flight) <= 2
    assert sorted(len(o.token_ids) for o in outputs) == sorted(r.output_len for r in requests)


# ---- rows ------------------------------------------------------------------------------------------------------


def test_every_request_finishes_and_the_row_counts_match(tmp_path):
    s = settings(tmp_path)
    [row] = run_serve_bench(s, show_progress=False)
    requests = workload(s, zoo.PRESETS["tiny"].vocab_size)
    assert row["completed"] == s.num_requests and row["failed"] == 0
    assert row["total_input_tokens"] == sum(len(r.prompt) for r in requests)
    assert row["total_output_tokens"] == sum(r.output_len for r in requests)
    assert row["request_throughput"] == pytest.approx(s.num_requests / row["duration"])
    assert row["output_throughput"] == pytest.approx(row["total_output_tokens"] / row["duration"])
    assert row["request_goodput"] <= row["request_throughput"]
    for name in ("ttft", "tpot", "itl", "e2el"):  # vLLM's field names, percentiles in order
        assert 0 < row[f"median_{name}_ms"] <= row[f"p90_{name}_ms"] <= row[f"p99_{name}_ms"]
    assert row["preemptions"] == 0 and row["prefix_caching_off"] == ""
    assert json.loads((tmp_path / "results.jsonl").read_text()) == row


def test_goodput_equals_throughput_under_a_huge_slo_and_is_zero_under_an_impossible_one(tmp_path):
    [loose] = run_serve_bench(settings(tmp_path, ttft_slo_ms=1e9, tpot_slo_ms=1e9), show_progress=False)
    assert loose["request_goodput"] == loose["request_throughput"]
    [none] = run_serve_bench(settings(tmp_path, ttft_slo_ms=None, tpot_slo_ms=None), show_progress=False)
    assert none["request_goodput"] == none["request_throughput"]
    [strict] = run_serve_bench(settings(tmp_path, ttft_slo_ms=1e-6), show_progress=False)  # one nanosecond
    assert strict["request_goodput"] == 0


def test_shared_prefix_hits_the_prefix_cache_where_the_model_allows(tmp_path):
    """One request at a time: every request after the first with its system prompt finds that prompt's 2 full
    blocks (32 tokens of the 40-token prompt, at the engine's 16-token blocks) cached."""
    s = settings(tmp_path, archs=["gqa", "mamba"], concurrency=[1], num_requests=12, num_prefixes=2, prefix_len=32,
                 suffix_len=8)
    gqa, mamba = run_serve_bench(s, show_progress=False)
    repeats = s.num_requests - len({tuple(r.prompt[:32]) for r in workload(s, 512)})
    assert gqa["prefix_cache_hit_rate"] == pytest.approx(32 * repeats / (40 * s.num_requests))
    assert mamba["prefix_cache_hit_rate"] == 0 and "recurrent state" in mamba["prefix_caching_off"]
    assert gqa["completed"] == mamba["completed"] == 12


def test_a_rerun_skips_done_cells_and_runs_only_new_ones(tmp_path, monkeypatch):
    first = run_serve_bench(settings(tmp_path), show_progress=False)
    measured = []
    measure = serve_bench.measure_cell
    monkeypatch.setattr(serve_bench, "measure_cell", lambda *a: measured.append(a[1]) or measure(*a))
    assert run_serve_bench(settings(tmp_path), show_progress=False) == first
    assert measured == []
    rows = run_serve_bench(settings(tmp_path, request_rates=[400.0, 800.0]), show_progress=False)
    assert [c["request_rate"] for c in measured] == [800.0]
    assert rows[0] == first[0] and len(rows) == 2


def test_cli_prints_the_table_and_writes_rows_and_charts(tmp_path, capsys):
    assert main(CLI_FAST + ["--out", str(tmp_path)]) == 0
    assert "| gqa | 400 |" in capsys.readouterr().out
    for name in ("results.jsonl", "table.md", "latency_vs_request_rate.png", "throughput_vs_request_rate.png"):
        assert (tmp_path / name).stat().st_size > 0
    closed_loop = [a for a in CLI_FAST if a not in ("--request-rates", "400", "--input-len", "16")]  # unused there
    assert main(closed_loop + ["--concurrency", "2", "--shared-prefix", "2:16:4", "--out", str(tmp_path)]) == 0
    assert "| gqa | 2 |" in capsys.readouterr().out
    assert (tmp_path / "latency_vs_concurrency.png").stat().st_size > 0


# ---- bad input: one clear error before any work ----------------------------------------------------------------


def fail(*args, **kwargs):
    raise AssertionError("work started before the bad option was reported")


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(serve_bench, "build_model", fail)
    monkeypatch.setattr(serve_bench, "measure_cell", fail)
    monkeypatch.setattr(zoo, "build", fail)


@pytest.mark.parametrize("options,message", [
    (["--request-rates", "0"], "request rate (req/s) must be a finite number > 0, got 0.0"),
    (["--request-rates=-2"], "request rate (req/s) must be a finite number > 0, got -2.0"),
    (["--request-rates", "4,inf"], "request rate (req/s) must be a finite number > 0, got inf"),
    (["--request-rates", "nan"], "request rate (req/s) must be a finite number > 0, got nan"),
    (["--concurrency", "0"], "concurrency (requests in flight) must be >= 1, got 0"),
    (["--num-requests", "0"], "num_requests must be >= 1, got 0"),
    (["--range-ratio", "1"], "range_ratio must be a finite number in [0, 1), got 1.0"),
    (["--range-ratio=-0.1"], "range_ratio must be a finite number in [0, 1), got -0.1"),
    (["--input-len", "0"], "input_len must be >= 1, got 0"),
    (["--output-len", "0"], "output_len must be >= 1, got 0"),
    (["--input-len", "1", "--range-ratio", "0.5"], "input_len=1 with range_ratio=0.5 draws lengths from [0, 1]"),
    (["--input-len", "400", "--output-len", "100", "--range-ratio", "0.2"],
     "the longest prompt (480 tokens) + the longest output (120) exceeds the 'tiny' preset's max_seq_len=512"),
    (["--shared-prefix", "2:500:20"], "the longest prompt (520 tokens) + the longest output (6) exceeds"),
    (["--shared-prefix", "2:0:4"], "prefix_len must be >= 1, got 0"),
    (["--shared-prefix", "2:16:0"], "suffix_len must be >= 1, got 0"),
    (["--ttft-slo-ms", "0"], "ttft_slo_ms must be a finite number > 0, got 0.0"),
    (["--tpot-slo-ms=-5"], "tpot_slo_ms must be a finite number > 0, got -5.0"),
    (["--tpot-slo-ms", "inf"], "tpot_slo_ms must be a finite number > 0, got inf"),
    (["--archs", "gqa,nope"], "unknown architecture 'nope'; allowed: "),
    (["--archs", "diffusion"], "'diffusion' is a masked diffusion LM, which the engine cannot serve; allowed: mha"),
    (["--max-batch", "0"], "max_batch must be >= 1, got 0"),
    (["--num-blocks", "0"], "num_blocks must be >= 1, got 0"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1, got 0"),
])
def test_bad_option_is_one_error_line_before_any_work(tmp_path, capsys, no_work, options, message):
    assert main(CLI_FAST + ["--out", str(tmp_path / "out")] + options) == 2
    err = capsys.readouterr().err
    assert err.startswith("zoo serve-bench: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options,message", [
    (["--request-rates", "fast"], "argument --request-rates: expected comma-separated numbers, got 'fast'"),
    (["--shared-prefix", "2:16"], "--shared-prefix: expected N:PREFIX_LEN:SUFFIX_LEN (three integers), got '2:16'"),
    (["--ttft-slo-ms", "soon"], "argument --ttft-slo-ms: expected milliseconds or 'none', got 'soon'"),
])
def test_unparseable_option_is_an_argparse_error(capsys, no_work, options, message):
    with pytest.raises(SystemExit) as exit_:
        main(CLI_FAST + options)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_out_that_is_a_file_fails_before_work(tmp_path, capsys, no_work):
    (tmp_path / "results").write_text("not a folder")
    assert main(CLI_FAST + ["--out", str(tmp_path / "results")]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,message", [
    ({"archs": []}, "no architectures to serve"),
    ({"request_rates": []}, "request_rates must be a non-empty list"),
    ({"request_rates": ["2"]}, "request rate (req/s) must be a finite number > 0, got '2' (str)"),
    ({"range_ratio": 0.5, "input_len": 1}, "draws lengths from [0, 1]"),
    ({"prefix_caching": "yes"}, "prefix_caching must be True or False"),
    ({"admission": "greedy"}, "unknown admission 'greedy'; allowed: reserve, optimistic"),
])
def test_bad_settings_raise_before_any_work(tmp_path, no_work, overrides, message):
    with pytest.raises(ValueError) as error:
        run_serve_bench(settings(tmp_path, **overrides), show_progress=False)
    assert message in str(error.value)


def test_length_range_is_both_ends_of_the_draw():
    assert length_range("input_len", 100, 0.5) == (50, 150)
    assert length_range("input_len", 7, 0.0) == (7, 7)
