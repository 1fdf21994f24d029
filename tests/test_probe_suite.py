"""`zoo probe`: runs over task settings x sizes x lr x wd x seeds, written as they finish, resumable, the same rows on
Ray; iso-state / iso-parameter sizing; clear errors before any work."""
import json

import pytest

from harness import cli
from harness.probe import suite
from harness.probe.report import best_over_grid
from harness.probe.suite import ProbeSettings, model_sizes, run_probe, sized_width, task_variant
from harness.probe.tasks import BASELINES, make_examples
from harness.recall.data import IGNORE_INDEX


def tiny(tmp_path, **kw) -> ProbeSettings:
    kw = {"archs": ["gqa", "mamba2"], "tasks": ["in-context-recall:seq_len=16", "parity:max_len=8"],
          "d_models": [16], "lrs": [3e-3], "weight_decays": [0.0, 0.1], "train_examples": 64, "test_examples": 16,
          "max_steps": 3, "min_steps": None, "batch_size": 8, "workers": 1, "out": tmp_path, **kw}
    return ProbeSettings(**kw)


def key(row: dict) -> tuple:
    return tuple(row[f] for f in suite.RUN_KEY)


def test_rows_are_written_per_run_and_a_rerun_skips_them(tmp_path, monkeypatch):
    settings = tiny(tmp_path)
    rows = run_probe(settings, show_progress=False)
    assert len(rows) == 8  # 2 tasks x 2 architectures x 1 width x 1 lr x 2 weight decays
    on_disk = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(map(key, on_disk)) == sorted(map(key, rows))
    for row in on_disk:
        assert row["steps"] == 3 and 0 <= row["accuracy"] <= 1 and row["convergence"] == "not converged"
        assert row["stopped"] == "max_steps" and row["state_bytes"] > 0
        assert 0 < row["non_embedding_parameters"] < row["parameters"]
    parity = [row for row in on_disk if row["task"] == "parity"]
    assert all(set(row["accuracy_per_set"]) == {"parity", "parity-long"} and row["chance"] == 0.5 for row in parity)
    recall = [row for row in on_disk if row["task"] == "in-context-recall"]
    assert all(row["chance"] == 1 / 8 for row in recall)  # vocab 16: 8 value ids (MAD-Lab's split of the vocabulary)

    trained = []
    real = suite.train_recall
    monkeypatch.setattr(suite, "train_recall",
                        lambda config, *a, **k: trained.append(config.arch) or real(config, *a, **k))
    assert run_probe(settings, show_progress=False) == rows and trained == []
    run_probe(tiny(tmp_path, lrs=[3e-3, 1e-3]), show_progress=False)
    assert sorted(trained) == ["gqa"] * 4 + ["mamba2"] * 4  # only the new learning rate's runs


def test_interrupted_sweep_keeps_finished_runs(tmp_path, monkeypatch):
    settings = tiny(tmp_path, tasks=["parity:max_len=8"])
    real, calls = suite.train_recall, []

    def dies_on_third(config, *a, **k):
        calls.append((config.arch, config.weight_decay))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(config, *a, **k)

    monkeypatch.setattr(suite, "train_recall", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_probe(settings, show_progress=False)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2
    calls.clear()
    monkeypatch.setattr(suite, "train_recall",
                        lambda config, *a, **k: calls.append(config.arch) or real(config, *a, **k))
    assert len(run_probe(settings, show_progress=False)) == 4 and len(calls) == 2


def test_training_and_test_data_follow_the_split_semantics():
    """Training labels every next token of an in-context recall sequence, the test set only the queries; test sets
    are the same draw for every seed, training sets are not."""
    run = {"task": "in-context-recall", "change": "seq_len=16", "seed": 0, "train_examples": 32, "test_examples": 8}
    (x, y), tests = suite.make_data(run)
    (x1, _), tests1 = suite.make_data({**run, "seed": 1})
    tx, ty = tests["in-context-recall"]
    assert (y != IGNORE_INDEX).sum() > (ty != IGNORE_INDEX).sum() * 32 / 8  # dense training targets
    assert not (x == x1).all() and (tx == tests1["in-context-recall"][0]).all()
    setting = task_variant("in-context-recall:seq_len=16").setting
    assert (ty == make_examples(setting, 8, suite.TEST_SEED, split="test")[1]).all()


def test_task_specs_and_bad_settings_fail_before_any_work(tmp_path, monkeypatch):
    assert task_variant("in-context-recall:vocab_size=64").setting.vocab_size == 64
    assert task_variant("memorization").num_train_examples == 256  # MAD-Lab's
    assert task_variant("compression:num_train_examples=800").num_train_examples == 800
    assert task_variant("compression", train_examples=100).num_train_examples == 100
    monkeypatch.setattr(suite, "train_recall", lambda *a, **k: pytest.fail("trained despite bad settings"))
    bad = [
        ({"tasks": ["in-context-recal"]}, "unknown task 'in-context-recal'; allowed: in-context-recall"),
        ({"tasks": ["parity-long"]}, "unknown task 'parity-long'"),  # a test set, not a task
        ({"tasks": []}, "no tasks"),
        ({"tasks": ["in-context-recall:vocab_size=1"]}, "vocab_size=1"),  # out of the generator's range
        ({"tasks": ["in-context-recall:colour=3"]}, "field one of vocab_size"),
        ({"tasks": ["in-context-recall:vocab_size"]}, "a change is field=value"),
        ({"archs": []}, "no architectures"),
        ({"archs": ["gqa", "nope"]}, "nope"),
        ({"archs": ["diffusion"]}, "not causal"),
        ({"d_models": []}, "an empty grid"),
        ({"lrs": []}, "lrs must be a non-empty list"),
        ({"lrs": [0.0]}, "learning rate"),
        ({"weight_decays": [-0.1]}, "weight decay"),
        ({"mlp": "moe"}, "mlp"),
        ({"max_steps": 0}, "max_steps"),
        ({"ray": ""}, "ray must be a cluster address"),
        ({"train_examples": 10**9}, "GiB of token tensors"),
        ({"d_models": [], "iso_state": [10**12]}, "iso-state target 1000000000000 for gqa"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            run_probe(tiny(tmp_path, **change), show_progress=False)
    assert not (tmp_path / "results.jsonl").exists()


def test_iso_modes_size_each_architecture_to_its_target():
    """The width chosen is the candidate closest to the target on a log scale: no other candidate is closer, and
    the rows carry the target and the width."""
    variant = task_variant("in-context-recall:vocab_size=64")
    for arch in ("gqa", "mamba2", "gdn"):
        for mode, target, index in (("iso-state", 65536, 0), ("iso-params", 50000, 1)):
            d = sized_width(arch, mode, target, variant, 2, "swiglu")
            gap = abs(model_sizes(arch, d, variant, 2, "swiglu")[index] / target - 1)
            assert gap < 1.0
            for other in (d - 8, d + 8):
                if other >= 8:
                    value = model_sizes(arch, other, variant, 2, "swiglu")[index]
                    assert abs(value / target - 1) >= gap * 0.9 or value / target > 1
    settings = ProbeSettings(archs=["gqa", "mamba2"], tasks=["in-context-recall:vocab_size=64"], d_models=[],
                             iso_state=[65536], iso_params=[50000], lrs=[1e-3], weight_decays=[0.1])
    runs = settings.runs()
    assert {(r["arch"], r["mode"], r["target"]) for r in runs} == {
        (a, m, t) for a in ("gqa", "mamba2") for m, t in (("iso-state", 65536), ("iso-params", 50000))}
    gqa = {r["mode"]: r["d_model"] for r in runs if r["arch"] == "gqa"}
    assert model_sizes("gqa", gqa["iso-state"], task_variant("in-context-recall:vocab_size=64"), 2, "swiglu")[0] \
        <= 2 * 65536


def test_attention_state_grows_with_the_sequence_and_fixed_state_does_not():
    short, long_ = task_variant("in-context-recall:seq_len=64"), task_variant("in-context-recall:seq_len=256")
    assert model_sizes("gqa", 32, long_, 2, "swiglu")[0] > 3 * model_sizes("gqa", 32, short, 2, "swiglu")[0]
    assert model_sizes("mamba2", 32, long_, 2, "swiglu")[0] == model_sizes("mamba2", 32, short, 2, "swiglu")[0]


def test_the_command_writes_the_table_and_charts(tmp_path, capsys):
    args = cli.parser().parse_args([
        "probe", "--archs", "gqa", "--tasks", "parity:max_len=8,memorization:num_keys=8", "--d-model", "16",
        "--lrs", "3e-3", "--weight-decays", "0,0.1", "--train-examples", "32", "--test-examples", "8",
        "--max-steps", "2", "--batch-size", "8", "--workers", "1", "--out", str(tmp_path), "--quiet"])
    args.func(args)
    printed = capsys.readouterr().out
    assert "| parity |" in printed and "| memorization | num_keys=8 |" in printed
    for name in ("results.jsonl", "table.md", "heatmap.png", "mad_score.png", "accuracy_vs_state.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and len(best_over_grid(rows)) == 2  # the preset's two sweeps share these runs


def test_task_all_expands_to_every_mad_setting():
    from harness.probe.cli import expand_tasks
    specs = expand_tasks(["compression:all", "parity"])
    assert specs[0] == "compression:baseline" and "compression:seq_len=256" in specs and specs[-1] == "parity"
    assert all(task_variant(spec) for spec in specs)
    assert set(BASELINES) >= {spec.partition(":")[0] for spec in specs}


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "wall_s"}


def test_ray_tasks_write_the_same_rows_as_one_process(tmp_path, local_ray):
    """Each run a Ray task on a local 2-CPU instance, one thread each as a local run; the driver alone writes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the Ray tasks train on one thread; the same arithmetic gives the same rows
    try:
        serial = run_probe(tiny(tmp_path / "serial"), show_progress=False)
    finally:
        torch.set_num_threads(threads)
    on_ray = run_probe(tiny(tmp_path / "ray", ray="local"), show_progress=False)
    assert len((tmp_path / "ray" / "results.jsonl").read_text().splitlines()) == 8
    assert sorted(map(deterministic, serial), key=key) == sorted(map(deterministic, on_ray), key=key)


def test_ray_sweep_resumes_after_the_driver_is_stopped(tmp_path, local_ray, monkeypatch):
    """A driver stopped after writing two rows (pending tasks cancelled): the re-run trains only the rest."""
    settings = tiny(tmp_path, ray="local")
    appended = []
    real_append = suite.ResultStore.append

    def append_then_stop(store, row):
        real_append(store, row)
        appended.append(key(row))
        if len(appended) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(suite.ResultStore, "append", append_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run_probe(settings, show_progress=False)
    monkeypatch.setattr(suite.ResultStore, "append", real_append)
    kept = {json.loads(line)["wall_s"] for line in (tmp_path / "results.jsonl").read_text().splitlines()}
    assert len(kept) == 2
    again = run_probe(settings, show_progress=False)
    assert len(again) == 8 and sum(row["wall_s"] in kept for row in again) == 2


def test_a_presets_sweeps_share_one_pool_and_folder(tmp_path):
    """Sweeps with different grids run together, each run once; sweeps that disagree on where or how they run are
    refused before any work."""
    recall = tiny(tmp_path, tasks=["in-context-recall:seq_len=16"])
    parity = tiny(tmp_path, archs=["gqa"], tasks=["parity:max_len=8", "in-context-recall:seq_len=16"])
    rows = run_probe([recall, parity], show_progress=False)
    assert len(rows) == 6  # recall x 2 archs x 2 wd, parity x gqa x 2 wd; gqa's recall runs shared
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 6
    with pytest.raises(ValueError, match="share out, device, workers, ray"):
        run_probe([recall, tiny(tmp_path / "elsewhere")], show_progress=False)
