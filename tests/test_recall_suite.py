"""`zoo recall`: the sweep writes a row per run as it goes, resumes without redoing finished runs, reports the
best learning rate per width, draws both charts, and rejects bad settings before any training."""
import json

import matplotlib.image
import pytest

from harness import cli
from harness.recall import report, suite
from harness.recall.train import convergence
from harness.recall.suite import RecallSettings, best_over_lr, run_recall


def tiny(tmp_path, **kw) -> RecallSettings:
    kw = {"archs": ["gqa", "mamba"], "seq_len": 16, "kv_pairs": [2, 4], "vocab_size": 64, "d_models": [16],
          "lrs": [1e-3, 3e-3], "train_examples": 64, "test_examples": 16, "max_steps": 2, "batch_size": 8,
          "workers": 1, "out": tmp_path, "held_out_kv_pairs": [], "state_d_models": [], "min_steps": None, **kw}
    return RecallSettings(**kw)


def test_rows_are_written_per_run_and_a_rerun_skips_them(tmp_path, monkeypatch):
    settings = tiny(tmp_path)
    rows = run_recall(settings, show_progress=False)
    assert len(rows) == 4  # 2 architectures x 1 width x 2 learning rates
    on_disk = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["arch"], r["lr"]) for r in on_disk] == [("gqa", 1e-3), ("gqa", 3e-3), ("mamba", 1e-3), ("mamba", 3e-3)]
    for row in on_disk:
        assert set(row["accuracy_per_kv_pairs"]) == {"2", "4"} and row["state_bytes"] > 0 and row["steps"] == 2
        assert 0.0 <= row["accuracy"] <= 1.0

    trained = []
    real = suite.train_recall
    monkeypatch.setattr(suite, "train_recall", lambda config, *a, **k: trained.append(config.arch) or real(config, *a, **k))
    again = run_recall(settings, show_progress=False)
    assert trained == [] and again == rows  # nothing re-trained
    wider = tiny(tmp_path, d_models=[16, 24])
    run_recall(wider, show_progress=False)
    assert trained == ["gqa", "gqa", "mamba", "mamba"]  # only the new width's runs


def test_interrupted_sweep_keeps_finished_runs(tmp_path, monkeypatch):
    settings = tiny(tmp_path)
    real, calls = suite.train_recall, []

    def dies_on_third(config, *a, **k):
        calls.append(config.arch)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(config, *a, **k)

    monkeypatch.setattr(suite, "train_recall", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_recall(settings, show_progress=False)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2
    calls.clear()
    monkeypatch.setattr(suite, "train_recall", lambda config, *a, **k: calls.append(config.arch) or real(config, *a, **k))
    assert len(run_recall(settings, show_progress=False)) == 4
    assert calls == ["mamba", "mamba"]  # the two finished gqa runs were not redone


def test_workers_write_the_same_rows_as_one_process(tmp_path):
    """Two worker processes train the runs (longest first) and the parent alone writes results.jsonl."""
    serial = run_recall(tiny(tmp_path / "serial"), show_progress=False)
    parallel = run_recall(tiny(tmp_path / "parallel", workers=2), show_progress=False)
    assert len((tmp_path / "parallel" / "results.jsonl").read_text().splitlines()) == 4
    key = lambda r: (r["arch"], r["lr"])  # noqa: E731
    for a, b in zip(sorted(serial, key=key), sorted(parallel, key=key)):
        assert key(a) == key(b) and a["steps"] == b["steps"] and a["state_bytes"] == b["state_bytes"]
        assert abs(a["accuracy"] - b["accuracy"]) < 1e-6  # same seeds, one thread each


def test_best_over_learning_rates():
    rows = [{"arch": "gqa", "d_model": 64, "lr": lr, "accuracy": acc} for lr, acc in ((1e-3, 0.4), (3e-3, 0.9), (1e-2, 0.2))]
    rows.append({"arch": "gqa", "d_model": 128, "lr": 1e-3, "accuracy": 0.5})
    best = best_over_lr(rows)
    assert [(r["d_model"], r["lr"]) for r in best] == [(64, 3e-3), (128, 1e-3)]


def test_cli_writes_table_and_charts(tmp_path, capsys):
    argv = ["recall", "--archs", "gqa,mqa", "--seq-len", "16", "--kv-pairs", "2,4", "--held-out-kv-pairs", "", "--vocab-size", "64",
            "--d-model", "16,24", "--lrs", "3e-3", "--train-examples", "64", "--test-examples", "16",
            "--max-steps", "2", "--batch-size", "8", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    table = (tmp_path / "table.md").read_text()
    assert "acc N=2" in table and "acc N=4" in table and sum(line.startswith("| gqa |") for line in table.splitlines()) == 2
    for name in ("accuracy_vs_state_bytes.png", "accuracy_vs_d_model.png"):
        image = matplotlib.image.imread(tmp_path / name)
        assert image.shape[0] > 200 and image.shape[1] > 600  # one panel per N, side by side
    curves = matplotlib.image.imread(tmp_path / "learning_curves.png")
    assert curves.shape[1] > 600  # a panel per architecture, side by side
    # 2 steps cannot converge: every row says so, in the table and in results.jsonl
    assert table.count("**not converged**") == 4
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {row["convergence"] for row in rows} == {"not converged"} and all(row["history"] for row in rows)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("option,value,message", [
    ("--kv-pairs", "4,5", "too large"),  # 4 * 5 > 16
    ("--seq-len", "15", "odd|even"),
    ("--vocab-size", "16", "vocab"),
    ("--archs", "gqa,nope", "unknown architecture 'nope'"),
])
def test_bad_settings_fail_before_training(tmp_path, capsys, option, value, message):
    argv = ["recall", "--archs", "gqa", "--seq-len", "16", "--kv-pairs", "2", "--held-out-kv-pairs", "4", "--vocab-size", "64",
            "--max-steps", "1", "--out", str(tmp_path), "--quiet", option, value]
    assert cli.main(argv) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "results.jsonl").exists()


def test_identical_models_train_once(tmp_path, monkeypatch):
    """mha, gqa and mqa with one head are one model (as are the hybrids tiled to 2 layers): trained once, each
    architecture still gets its row, marked with the run it copies; a re-run copies from the file."""
    real, trained = suite.train_recall, []
    monkeypatch.setattr(suite, "train_recall", lambda config, *a, **k: trained.append(config.arch) or real(config, *a, **k))
    rows = run_recall(tiny(tmp_path, archs=["mha", "gqa", "mla"], d_models=[16], lrs=[3e-3]), show_progress=False)
    assert trained == ["mha", "mla"]  # d_model 16: one head, so gqa's KV heads = 1 = mha's
    by_arch = {r["arch"]: r for r in rows}
    assert by_arch["gqa"]["same_model_as"] == "mha" and "same_model_as" not in by_arch["mha"]
    assert by_arch["gqa"]["accuracy"] == by_arch["mha"]["accuracy"]
    trained.clear()
    more = run_recall(tiny(tmp_path, archs=["mha", "gqa", "mqa", "mla"], d_models=[16], lrs=[3e-3]), show_progress=False)
    assert trained == [] and {r["arch"]: r.get("same_model_as") for r in more}["mqa"] == "mha"


HISTORY = [{"step": 100 * (i + 1), "L=64,N=4": a, "L=64,N=8": b}
           for i, (a, b) in enumerate([(0.1, 0.0), (0.5, 0.2), (0.8, 0.6), (0.81, 0.6), (0.81, 0.603), (0.8, 0.6)])]


@pytest.mark.parametrize("history,solved,expected", [
    (HISTORY, True, "solved"),
    (HISTORY, False, "plateau"),  # the last 3 evaluations beat the best before them by 0.0065 < 0.01
    (HISTORY[:4], False, "not converged"),  # still rising: the last 3 reach 0.705, the first was 0.05
    (HISTORY[:3], False, "not converged"),  # too few evaluations to call a plateau
    ([{"step": s, "a": 0.01} for s in range(100, 900, 100)], False, "plateau"),  # flat at chance: a plateau too
    # polishing near the top: +0.006 is under 0.01 but over a tenth of the 0.025 error left, so still learning
    ([{"step": 100 * i, "a": a} for i, a in enumerate([0.9, 0.975, 0.977, 0.979, 0.981], 1)], False, "not converged"),
    ([{"step": 100 * i, "a": a} for i, a in enumerate([0.9, 0.975, 0.976, 0.977, 0.976], 1)], False, "plateau"),
])
def test_convergence_is_solved_plateau_or_not(history, solved, expected):
    assert convergence(history, solved) == expected


def flat(accuracy: float, losses: list[float]) -> list[dict]:
    return [{"step": 100 * (i + 1), "loss": loss, "a": accuracy} for i, loss in enumerate(losses)]


@pytest.mark.parametrize("history,chance,expected", [
    (flat(0.01, [2.0] * 8), 0.0, "plateau"),  # flat, loss flat, no chance given
    (flat(0.01, [2.0] * 8), 0.005, "not converged"),  # at 2x chance: recall has not started
    (flat(0.011, [2.0] * 8), 0.005, "plateau"),  # just above 2x chance, loss flat
    # the flat stretch before the induction jump: accuracy still, loss still falling 5% over the window
    (flat(0.2, [3.0, 2.9, 2.8, 2.7, 2.6, 2.5]), 0.001, "not converged"),
    (flat(0.2, [2.6, 2.6, 2.6, 2.595, 2.594, 2.592]), 0.001, "plateau"),  # a fall of 0.3%: noise, not learning
    (flat(0.2, [2.6, 2.6, 2.59, 2.59, 2.58, 2.57]), 0.001, "not converged"),  # 0.8%: mamba2's pace before its jump
    (flat(0.2, [2.0] * 3 + [2.0, 1.99, 2.01]), 0.001, "plateau"),
    # near a solved loss the window means wander (mha seed 1): a 3.6% drop end to end, but no trend beyond the noise
    (flat(0.98, [0.16, 0.16, 0.157, 0.153, 0.140, 0.152]), 0.001, "plateau"),
    # a 13% fall in a window whose means scatter (a drop, then flat): learning, whatever the slope's standard error
    (flat(0.31, [2.3, 2.3, 2.22, 1.95, 1.94, 1.93]), 0.0625, "not converged"),
    # a loss still at a uniform guess's among 1,000 values (ln 1000 = 6.91): nothing learned yet, however flat
    (flat(0.003, [6.95] * 8), 0.001, "not converged"),
    (flat(0.003, [6.85] * 8), 0.001, "plateau"),
    ([{"step": 100 * i, "a": 0.2} for i in range(1, 7)], 0.001, "plateau"),  # rows from before the loss was kept
])
def test_no_plateau_at_chance_or_while_the_loss_falls(history, chance, expected):
    assert convergence(history, False, chance) == expected


def test_charts_mark_runs_that_did_not_converge(tmp_path):
    """A not-converged run is a hollow marker (a lower bound); a converged one is filled."""
    rows = [{"arch": "gqa", "d_model": d, "lr": 1e-3, "seq_len": 64, "state_bytes": 1024 * d, "accuracy": acc,
             "accuracy_per_kv_pairs": {"4": acc}, "steps": 800, "solved": solved, "wall_s": 1.0,
             "history": HISTORY[:4] if not solved else HISTORY}
            for d, acc, solved in ((32, 0.4, False), (64, 0.99, True))]
    drawn = []
    original = report.plt.Axes.plot

    def spy(ax, *args, **kwargs):
        if "markerfacecolor" in kwargs:
            drawn.append(kwargs["markerfacecolor"] == "none")
        return original(ax, *args, **kwargs)

    report.plt.Axes.plot = spy
    try:
        report.panels(rows, lambda r: r["d_model"], "d_model", "t", tmp_path / "p.png", logx=False)
    finally:
        report.plt.Axes.plot = original
    assert drawn == [True, False]  # d=32 hollow, d=64 filled
    assert "**not converged**" in report.markdown_table(rows).splitlines()[2]


def test_architectures_that_need_depth_are_also_trained_deeper(tmp_path):
    """cla's entry asks for 2 and 4 layers: both are runs, with their own rows, table lines and a note saying why."""
    settings = tiny(tmp_path, archs=["gqa", "cla"], lrs=[3e-3])
    depths = [(r["arch"], r["n_layers"]) for r in settings.runs()]
    assert depths == [("gqa", 2), ("cla", 2), ("cla", 4)]
    rows = run_recall(settings, show_progress=False)
    assert sorted((r["arch"], r["n_layers"]) for r in rows) == [("cla", 2), ("cla", 4), ("gqa", 2)]
    best = best_over_lr(rows)
    table = report.markdown_table(best)
    assert "| cla | 4 |" in table and "| cla | 2 |" in table and "- cla: at 2 layers" in table
    assert "cla, 4 layers" in report.lines(best)


def test_rows_written_before_depths_existed_still_count(tmp_path):
    """A results.jsonl from before runs had n_layers: its rows were 2-layer runs, so a re-run skips them."""
    settings = tiny(tmp_path, archs=["gqa"], lrs=[3e-3], d_models=[16])
    (row,) = run_recall(settings, show_progress=False)
    del row["n_layers"]
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    again = run_recall(settings, show_progress=False)
    assert len(again) == 1 and again[0]["n_layers"] == 2 and again[0]["wall_s"] == row["wall_s"]


def test_ray_tasks_write_the_same_rows_as_one_process(tmp_path, local_ray):
    """Each run a Ray task on a local 2-CPU instance; the driver alone writes results.jsonl; same seeds, same rows."""
    serial = run_recall(tiny(tmp_path / "serial"), show_progress=False)
    on_ray = run_recall(tiny(tmp_path / "ray", ray="local"), show_progress=False)
    assert len((tmp_path / "ray" / "results.jsonl").read_text().splitlines()) == 4
    key = lambda r: (r["arch"], r["lr"])  # noqa: E731
    for a, b in zip(sorted(serial, key=key), sorted(on_ray, key=key)):
        assert key(a) == key(b) and a["steps"] == b["steps"] and a["history"] == b["history"]
        assert abs(a["accuracy"] - b["accuracy"]) < 1e-6


def test_ray_sweep_resumes_where_the_driver_stopped(tmp_path, local_ray):
    """A driver killed after writing two rows: the re-run trains only the two runs it had not written."""
    settings = tiny(tmp_path, ray="local")
    rows = run_recall(settings, show_progress=False)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:2]) + "\n")  # what a driver killed then leaves
    kept = {json.loads(line)["wall_s"] for line in lines[:2]}
    again = run_recall(settings, show_progress=False)
    assert len(again) == 4 and sum(row["wall_s"] in kept for row in again) == 2
    assert sorted(map(key_of, again)) == sorted(map(key_of, rows))


def key_of(row: dict) -> tuple:
    return row["arch"], row["lr"]


def test_ray_needs_an_address_string(tmp_path):
    with pytest.raises(ValueError, match="ray must be a cluster address"):
        tiny(tmp_path, ray="").validate()


def test_runs_take_each_architectures_learning_rate_and_state_widths(tmp_path):
    """Without lrs, each architecture trains at its registry recall_lr; state_d_models add widths to the fixed-state
    architectures only; every run is repeated per seed."""
    settings = tiny(tmp_path, archs=["gqa", "mla", "linear", "mamba"], lrs=None, d_models=[64], state_d_models=[32],
                    seeds=[0, 1])
    runs = {(r["arch"], r["d_model"], r["lr"], r["seed"]) for r in settings.runs()}
    import zoo
    expected = {(a, d, zoo.registry.recall_lr(a), s) for a, widths in (("gqa", [64]), ("mla", [64]), ("linear", [32, 64]),
                                                                        ("mamba", [32, 64])) for d in widths for s in (0, 1)}
    assert runs == expected and zoo.registry.recall_lr("mla") != zoo.registry.recall_lr("gqa")


def test_seeds_are_reported_as_mean_and_range(tmp_path):
    """Several seeds of one run: the table shows the mean with (min–max), the chart a bar over the range, and the
    row is not converged if any seed was not."""
    rows = [{"arch": "gqa", "d_model": 64, "lr": 1e-3, "seed": seed, "seq_len": 64, "state_bytes": 1024,
             "accuracy": acc, "token_accuracy": acc, "accuracy_per_kv_pairs": {"4": acc, "16": acc / 2}, "steps": steps,
             "solved": acc > 0.99, "convergence": status, "wall_s": 10.0, "history": HISTORY, "held_out_kv_pairs": "16"}
            for seed, acc, steps, status in ((0, 1.0, 500, "solved"), (1, 0.8, 800, "not converged"),
                                             (2, 0.9, 700, "plateau"))]
    (row,) = best_over_lr(rows)
    assert abs(row["accuracy"] - 0.9) < 1e-12 and row["accuracy_range_per_kv_pairs"]["4"] == (0.8, 1.0)
    assert (row["seed"], row["steps"], row["wall_s"], row["convergence"]) == ([0, 1, 2], 800, 30.0, "not converged")
    table = report.markdown_table([row])
    assert "acc N=16 (held out)" in table and "| 3 | 0.900 (0.800–1.000) | 0.450 (0.400–0.500) |" in table
    bars = []
    original = report.plt.Axes.vlines
    report.plt.Axes.vlines = lambda ax, x, low, high, **k: bars.append((x, low, high)) or original(ax, x, low, high, **k)
    try:
        report.panels([row], lambda r: r["d_model"], "d_model", "t", tmp_path / "p.png", logx=False)
        report.learning_curves([row], tmp_path / "c.png")
    finally:
        report.plt.Axes.vlines = original
    assert bars == [(64, 0.8, 1.0), (64, 0.4, 0.5)]  # one bar per panel: N = 4, then N = 16
