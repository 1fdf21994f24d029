"""`zoo compare --ray`: each model's cells a Ray task on a local 2-CPU instance; the driver alone writes
results.jsonl; the same rows as the local path, resumable, and bad settings refused before any work."""
import importlib.util
import json

import pytest

from harness import compare, compare_ray
from harness.compare import CompareSettings, run_compare
from harness.results import ResultStore

# Left out of the comparison: what a clock or the machine's measured rates decide (the floor is priced by them).
TIMED = {"ttft_ms", "tpot_ms", "itl_p99_ms", "step_ms_p50", "decode_tok_s", "output_tok_s", "wall_s",
         "floor_ms", "bound", "fraction_of_floor", "mbu", "mfu", "prefill_floor_ms",
         "stream_gb_s", "read_gb_s", "matmul_gflop_s", "gemv_gb_s", "copy_gb_s", "rates_how",
         "run_read_gb_s", "read_before_gb_s", "read_after_gb_s", "read_moved"}


def tiny_settings(out, **kw) -> CompareSettings:
    """tests/test_compare.py's grid: 2 architectures x 2 contexts x 2 batches."""
    return CompareSettings(archs=["mha", "mqa"], preset="tiny", contexts=[16, 32], batches=[1, 2], new_tokens=3,
                           out=out, **kw)


def untimed(rows: list[dict]) -> dict[tuple, dict]:
    """Each row's deterministic fields (cache and analytic bytes, parameters, step bytes and FLOPs, ...) by cell."""
    return {tuple(row[f] for f in compare.CELL_KEY): {k: v for k, v in row.items() if k not in TIMED} for row in rows}


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory, share_machine_measurements) -> dict[tuple, dict]:
    with pytest.MonkeyPatch.context() as patch:
        share_machine_measurements(patch)  # the rates are TIMED fields: left out of the comparison
        return untimed(run_compare(tiny_settings(tmp_path_factory.mktemp("local")), show_progress=False))


def test_ray_gives_the_local_rows(tmp_path, local_ray, local_rows):
    """Every cell once, with the local path's values in every field a clock or rate does not decide."""
    rows = run_compare(tiny_settings(tmp_path, ray="local"), show_progress=False)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(rows) == 8
    assert untimed(rows) == local_rows
    assert all(row["step_ms_p50"] > 0 and row["floor_ms"] > 0 and row["stream_gb_s"] > 0 for row in rows)
    assert compare_ray.task_resources("cpu") == {"num_cpus": 2}  # a task holds the whole (2-CPU) machine


def test_ray_resumes_where_the_driver_stopped(tmp_path, local_ray, local_rows, monkeypatch):
    """A driver stopped after writing 3 rows cancels the tasks in flight; the re-run sends only the 5 missing
    cells, keeps the 3 rows written, and ends with the complete run's rows."""
    real_append = ResultStore.append

    def stops_after_three(store, row):
        if len(store.rows) == 3:
            raise KeyboardInterrupt
        real_append(store, row)

    monkeypatch.setattr(ResultStore, "append", stops_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_compare(tiny_settings(tmp_path, ray="local"), show_progress=False)
    monkeypatch.setattr(ResultStore, "append", real_append)
    kept = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(kept) == 3

    sent = []
    real_measure = compare_ray.measure_on_ray
    monkeypatch.setattr(compare_ray, "measure_on_ray",
                        lambda groups, *a: sent.extend(c for g in groups for c in g) or real_measure(groups, *a))
    rows = run_compare(tiny_settings(tmp_path, ray="local"), show_progress=False)
    assert len(sent) == 5 and not set(untimed(sent)) & set(untimed(kept))
    assert untimed(rows) == local_rows and all(row in rows for row in kept)  # kept rows untouched, timings too
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 8


@pytest.mark.parametrize("address", ["", 7])
def test_ray_needs_an_address_string(tmp_path, monkeypatch, address):
    monkeypatch.setattr(compare, "measure_cell", lambda *a: pytest.fail("measured a cell"))
    with pytest.raises(ValueError, match="ray must be a cluster address"):
        run_compare(tiny_settings(tmp_path, ray=address), show_progress=False)
    assert not (tmp_path / "results.jsonl").exists()


def test_ray_without_ray_installed_fails_before_any_work(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    monkeypatch.setattr(compare, "measure_cell", lambda *a: pytest.fail("measured a cell"))
    with pytest.raises(ValueError, match="needs Ray installed"):
        run_compare(tiny_settings(tmp_path, ray="local"), show_progress=False)
    assert not (tmp_path / "results.jsonl").exists()


def test_ray_on_cuda_takes_the_gpu_a_task_holds(tmp_path, monkeypatch):
    """A task sees only its own GPU, as cuda:0: cuda:1 is refused before any work (CUDA faked on this CPU machine)."""
    monkeypatch.setattr(compare.checks, "device", lambda name, value: value)
    with pytest.raises(ValueError, match="sees as cuda:0"):
        tiny_settings(tmp_path, ray="local", device="cuda:1").validate()


def test_cli_compare_takes_ray_like_recall(tmp_path, monkeypatch):
    """--ray alone: a new local instance; --ray ADDRESS: that cluster; without it: no Ray."""
    seen = []
    monkeypatch.setattr("harness.cli.run_compare", lambda settings, show_progress: seen.append(settings.ray) or [])
    monkeypatch.setattr("harness.cli.write_atomic", lambda *a: None)
    from harness import cli

    for argv, ray in ((["--ray"], "local"), (["--ray", "auto"], "auto"), ([], None)):
        assert cli.main(["compare", "--preset", "tiny", "--out", str(tmp_path), *argv]) == 0
        assert seen.pop() == ray
