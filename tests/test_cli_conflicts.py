"""Options that would be silently ignored are refused, naming both, and an output folder is proven writable by a
write: each before any model is built."""
import errno
import os
import tempfile
from pathlib import Path

import pytest

import zoo
from harness import cli, compare, serve_bench
from harness.results import check_output_folder
from harness.serve_bench import ServeBenchSettings

SERVE = ["serve-bench", "--archs", "gqa", "--preset", "tiny", "--num-requests", "6", "--output-len", "4", "--quiet"]
COMPARE = ["compare", "--archs", "gqa", "--preset", "tiny", "--contexts", "16", "--batches", "1", "--new-tokens", "3",
           "--quiet"]


def fail(*args, **kwargs):
    raise AssertionError("work started before the bad option was reported")


@pytest.fixture
def no_work(monkeypatch):
    for module, name in ((serve_bench, "build_model"), (serve_bench, "measure_cell"), (compare, "build_model"),
                         (compare, "measure_rates"), (zoo, "build")):
        monkeypatch.setattr(module, name, fail)


def error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"zoo {command}: error: ") and err.count("\n") == 1, err
    return err


# ---- serve-bench: options that leave another unused ------------------------------------------------------------


@pytest.mark.parametrize("options,message", [
    (["--concurrency", "2", "--request-rates", "4"],
     "--concurrency and --request-rates conflict: a closed loop of N requests in flight replaces the Poisson "
     "arrivals, so --request-rates would be ignored"),
    (["--shared-prefix", "2:16:4", "--input-len", "16"],
     "--shared-prefix and --input-len conflict: each prompt is PREFIX_LEN + SUFFIX_LEN tokens, so --input-len would "
     "be ignored"),
    (["--concurrency", "2", "--shared-prefix", "2:16:4", "--request-rates", "4"], "--request-rates would be ignored"),
    (["--shared-prefix", "0:16:4"], "--shared-prefix 0:16:4: N must be >= 1, got 0 (no system prompts would ignore "
                                    "PREFIX_LEN and SUFFIX_LEN"),
    (["--concurrency", "2,8"], "concurrency [8] exceeds num_requests=6: at most 6 requests are ever in flight"),
])
def test_serve_bench_refuses_an_option_it_would_ignore(tmp_path, capsys, no_work, options, message):
    assert cli.main(SERVE + options + ["--out", str(tmp_path / "out")]) == 2
    assert message in error_line(capsys, "serve-bench")
    assert not (tmp_path / "out").exists()


def test_settings_refuse_a_concurrency_no_cell_reaches(tmp_path, no_work):
    settings = ServeBenchSettings(archs=["gqa"], preset="tiny", concurrency=[41], out=tmp_path)
    with pytest.raises(ValueError, match=r"concurrency \[41\] exceeds num_requests=40"):
        serve_bench.run_serve_bench(settings, show_progress=False)


def test_serve_bench_shared_prefix_with_concurrency_serves_the_shared_prompts(tmp_path, capsys):
    """The combination the report named, given alone: it runs the shared-prefix workload closed-loop, and the
    requests after the first two find their system prompt cached."""
    assert cli.main(SERVE + ["--concurrency", "2", "--shared-prefix", "2:32:8", "--out", str(tmp_path)]) == 0
    [row] = serve_bench.ResultStore(tmp_path / "results.jsonl", serve_bench.CELL_KEY).rows
    assert (row["concurrency"], row["num_prefixes"], row["prefix_len"], row["input_len"]) == (2, 2, 32, None)
    assert row["request_rate"] is None and row["prefix_cache_hit_rate"] > 0


# ---- the output folder is proven writable by a write -----------------------------------------------------------


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (SERVE, "serve-bench")])
def test_out_under_proc_fails_before_work_even_as_root(capsys, monkeypatch, no_work, argv, command):
    monkeypatch.setattr(os, "access", lambda path, mode: True)  # what root's permission check says of /proc
    assert cli.main(argv + ["--out", "/proc/zoo-out"]) == 2
    assert "cannot write output folder '/proc/zoo-out': making a file in '/proc' failed" in error_line(capsys, command)


def test_out_on_a_read_only_mount_fails_before_work(tmp_path, capsys, monkeypatch, no_work):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert cli.main(COMPARE + ["--out", str(tmp_path / "new")]) == 2
    line = error_line(capsys, "compare")
    assert f"cannot write output folder '{tmp_path / 'new'}': making a file in '{tmp_path}' failed" in line
    assert os.strerror(errno.EROFS) in line


@pytest.mark.parametrize("exists", [True, False])
def test_the_write_probe_leaves_nothing_behind(tmp_path, exists):
    out = tmp_path / "out"
    if exists:
        out.mkdir()
    check_output_folder(out)
    assert list(tmp_path.iterdir()) == ([out] if exists else [])
    assert not exists or list(out.iterdir()) == []


# ---- compare: options the rest of the command leaves unused ----------------------------------------------------


@pytest.mark.parametrize("options,message", [
    (["--quant", "none,int8", "--quant-group", "32"], "--quant-group would be ignored: --quant none,int8 has no int4"),
    (["--quant-method", "awq"], "--quant-method would be ignored: --quant none quantizes nothing"),
    (["--kv-cache", "contiguous", "--block-size", "32"],
     "--block-size would be ignored: --kv-cache contiguous has no blocks"),
    (["--diffusion-steps", "3"], "--diffusion-steps would be ignored: --archs gqa has no masked diffusion LM"),
    (["--block-length", "3"], "--block-length would be ignored: --archs gqa has no masked diffusion LM"),
    (["--diffusion-caches", "dual"], "--diffusion-caches would be ignored: --archs gqa has no masked diffusion LM"),
])
def test_compare_refuses_an_option_it_would_ignore(tmp_path, capsys, no_work, options, message):
    assert cli.main(COMPARE + ["--out", str(tmp_path), *options]) == 2
    assert message in error_line(capsys, "compare")


def test_compare_takes_the_same_options_where_they_are_used(tmp_path, monkeypatch):
    """int4 with a group, a paged cache with a block size: the settings run_compare gets carry the typed values."""
    seen = []
    monkeypatch.setattr(cli, "run_compare", lambda settings, show_progress: seen.append(settings) or [])
    monkeypatch.setattr(cli, "write_charts", lambda rows, out: [])
    cli.main(COMPARE + ["--out", str(tmp_path), "--quant", "int4", "--quant-group", "32", "--quant-method", "awq",
                        "--kv-cache", "paged", "--block-size", "32"])
    (settings,) = seen
    assert (settings.quant_group, settings.quant_method, settings.block_size) == (32, "awq", 32)
