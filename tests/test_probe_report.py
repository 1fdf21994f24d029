"""The probe report (harness/probe/report.py) on hand-built rows: best (lr, wd) by seed mean, convergence merging,
MAD-Lab's score against a hand computation, the table, the heatmap's matrix and the three charts."""
import random

import matplotlib.image
import pytest

from harness.probe.report import (
    MAD_TASKS,
    best_over_grid,
    heatmap_chart,
    heatmap_matrix,
    mad_score,
    markdown_table,
    score_chart,
    state_chart,
    write_report,
)
from harness.probe.tasks import CHANGES


def run(task="in-context-recall", change="baseline", arch="mamba2", *, lr=1e-3, wd=0.0, seed=0, acc=0.5,
        convergence="solved", d_model=64, per_set=None, state_bytes=4096, steps=100) -> dict:
    """One training run's row, as the probe suite writes it."""
    return {
        "task": task, "change": change, "arch": arch, "n_layers": 2, "d_model": d_model, "mode": "fixed",
        "target": None, "lr": lr, "weight_decay": wd, "seed": seed, "accuracy": acc,
        "accuracy_per_set": per_set or {task: acc}, "chance": 1 / 16, "state_bytes": state_bytes,
        "parameters": 50_000, "non_embedding_parameters": 40_000, "steps": steps, "max_steps": 1000,
        "convergence": convergence, "stopped": "budget", "wall_s": 1.0,
        "history": [{"step": steps, "loss": 0.1, task: acc}],
    }


def grid_rows() -> list[dict]:
    """lr 1e-3 has the best single seed (0.9) but the worse mean (0.6); lr 3e-3, wd 0.1 has the better mean (0.7)."""
    return [run(lr=1e-3, wd=0.0, seed=0, acc=0.9), run(lr=1e-3, wd=0.0, seed=1, acc=0.3),
            run(lr=3e-3, wd=0.1, seed=0, acc=0.75, steps=300), run(lr=3e-3, wd=0.1, seed=1, acc=0.65, steps=200)]


def test_best_over_grid_keeps_the_best_seed_mean_not_the_best_run():
    [best] = best_over_grid(grid_rows())
    assert (best["lr"], best["weight_decay"]) == (3e-3, 0.1)
    assert best["accuracy"] == pytest.approx(0.7)
    assert best["accuracy_range"] == (0.65, 0.75)
    assert best["per_seed_accuracy"] == {0: 0.75, 1: 0.65}
    assert best["accuracy_per_set"] == {"in-context-recall": pytest.approx(0.7)}
    assert best["accuracy_per_set_range"] == {"in-context-recall": (0.65, 0.75)}
    assert best["seeds"] == [0, 1] and "seed" not in best
    assert best["grid_size"] == 2 and best["steps"] == 300
    assert best["state_bytes"] == 4096 and best["arch"] == "mamba2"


def test_best_over_grid_per_set_means_and_ranges():
    rows = [run("parity", seed=s, acc=a, per_set={"parity": a, "parity-long": long})
            for s, a, long in [(0, 1.0, 0.5), (1, 0.9, 0.7), (2, 0.8, 0.6)]]
    [best] = best_over_grid(rows)
    assert best["accuracy_per_set"] == {"parity": pytest.approx(0.9), "parity-long": pytest.approx(0.6)}
    assert best["accuracy_per_set_range"] == {"parity": (0.8, 1.0), "parity-long": (0.5, 0.7)}


@pytest.mark.parametrize("statuses, merged", [
    (["solved", "solved"], "solved"),
    (["solved", "plateau"], "plateau"),
    (["plateau", "plateau"], "plateau"),
    (["solved", "not converged"], "not converged"),
    (["plateau", "not converged"], "not converged"),
])
def test_convergence_merges_over_seeds(statuses, merged):
    [best] = best_over_grid([run(seed=s, convergence=c) for s, c in enumerate(statuses)])
    assert best["convergence"] == merged


def test_best_over_grid_groups_and_orders_deterministically():
    rows = [run(change=c, arch=a, d_model=d, lr=lr, acc=0.1 * i)
            for i, (c, a, d, lr) in enumerate([(c, a, d, lr) for c in ("baseline", "vocab_size=32", "vocab_size=128")
                                               for a in ("mamba2", "mha") for d in (32, 64) for lr in (1e-3, 3e-3)])]
    rows += [run("parity", acc=0.5), run("compression", acc=0.5)]
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    best = best_over_grid(shuffled)
    assert best == best_over_grid(rows)
    assert len(best) == 3 * 2 * 2 + 2
    keys = [(r["task"], r["change"], r["arch"], r["d_model"]) for r in best]
    # the suite's task order; baseline first, then values numerically (128 after 32)
    assert keys[:4] == [("in-context-recall", "baseline", a, d) for a in ("mamba2", "mha") for d in (32, 64)]
    assert [k[1] for k in keys[4:12:4]] == ["vocab_size=32", "vocab_size=128"]
    assert [k[0] for k in keys[-2:]] == ["compression", "parity"]
    assert all(r["lr"] == 3e-3 for r in best[:12])  # the later lr has the higher accuracy in every group


def test_repeated_seed_is_an_error():
    with pytest.raises(ValueError, match="repeat"):
        best_over_grid([run(seed=0), run(seed=0)])


@pytest.mark.parametrize("function", [best_over_grid, mad_score, markdown_table, heatmap_matrix])
def test_empty_rows_are_an_error(function):
    with pytest.raises(ValueError, match="no rows"):
        function([])


def test_write_report_of_no_rows_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        write_report([], tmp_path)


def score_rows() -> list[dict]:
    """Arch a: in-context recall at two settings, compression at one, parity (not a MAD task); arch b: parity only;
    arch c: one setting without seed 1."""
    per_seed = [("in-context-recall", "baseline", (0.8, 0.6)), ("in-context-recall", "vocab_size=32", (0.4, 0.2)),
                ("compression", "baseline", (1.0, 0.8)), ("parity", "baseline", (0.0, 0.0))]
    rows = [run(task, change, "a", seed=s, acc=accs[s]) for task, change, accs in per_seed for s in (0, 1)]
    rows += [run("parity", arch="b", seed=s, acc=1.0) for s in (0, 1)]
    rows += [run("memorization", arch="c", seed=s, acc=0.5 + 0.1 * s) for s in (0, 1)]
    rows += [run("memorization", "num_keys=512", arch="c", seed=0, acc=0.3)]
    return rows


def test_mad_score_is_mean_over_settings_then_tasks():
    assert MAD_TASKS == tuple(CHANGES)  # MAD-Lab's six are the tasks with difficulty changes
    scores = mad_score(best_over_grid(score_rows()))
    assert set(scores) == {("a", 2, 64, "fixed", None), ("c", 2, 64, "fixed", None)}  # b has no MAD task
    a = scores["a", 2, 64, "fixed", None]
    # recall: mean of 0.7 and 0.3 = 0.5; compression 0.9; score 0.7 (a flat mean over the three settings: 0.633)
    assert a["score"] == pytest.approx(0.7)
    # seed 0: (0.8 + 0.4) / 2 = 0.6 and 1.0 -> 0.8; seed 1: (0.6 + 0.2) / 2 = 0.4 and 0.8 -> 0.6
    assert (a["low"], a["high"]) == (pytest.approx(0.6), pytest.approx(0.8))
    assert a["tasks"] == ["in-context-recall", "compression"] and a["seeds"] == [0, 1]
    c = scores["c", 2, 64, "fixed", None]
    # settings 0.55 (seeds 0.5, 0.6) and 0.3 (seed 0 only): score 0.425; only seed 0 is in both: (0.5 + 0.3) / 2
    assert c["score"] == pytest.approx(0.425)
    assert c["seeds"] == [0] and c["low"] == c["high"] == pytest.approx(0.4)
    assert c["tasks"] == ["memorization"]


def test_mad_score_of_state_tracking_only_is_empty():
    assert mad_score(best_over_grid([run("parity"), run("s5")])) == {}


def test_markdown_table_names_the_choice_and_statuses():
    rows = grid_rows() + score_rows()
    rows += [run("parity", arch="d", seed=s, acc=1.0, per_set={"parity": 1.0, "parity-long": 0.51},
                 convergence=c) for s, c in ((0, "plateau"), (1, "solved"))]
    rows += [run("s5", arch="d", convergence="not converged")]
    text = markdown_table(best_over_grid(rows))
    recall = next(line for line in text.splitlines() if line.startswith("| in-context-recall | baseline | mamba2"))
    assert "| 0.003 | 0.1 |" in recall and "0.700 (0.650–0.750)" in recall and "| 300 / 1000 |" in recall
    assert "| 0.001 |" not in recall
    assert "parity-long 0.510" in text
    assert "| solved |" in text and "| plateau |" in text and "| **not converged** |" in text
    assert "| a | 0.700 | 0.600–0.800 | 2/6" in text
    assert "4,096" in text and "40,000" in text


def test_a_plateau_at_the_step_budget_says_so():
    """A flat run that trained to its budget (attention's pre-jump shelf looks the same) is not read as stopped
    early."""
    flat = run(convergence="plateau", acc=0.3)
    stopped_early = markdown_table(best_over_grid([{**flat, "stopped": "plateau"}]))
    at_budget = markdown_table(best_over_grid([{**flat, "stopped": "max_steps"}]))
    assert "| plateau |" in stopped_early and "| plateau (at budget) |" in at_budget


def heat_rows() -> list[dict]:
    return [run(arch="mamba2", d_model=32, acc=0.9), run(arch="mamba2", d_model=64, acc=1.0),
            run(change="vocab_size=32", arch="mamba2", d_model=64, acc=0.4, convergence="not converged"),
            run(arch="mha", acc=0.8),
            run("parity", arch="mha", acc=0.95, per_set={"parity": 0.95, "parity-long": 0.5})]


def test_heatmap_matrix_rows_columns_and_cells():
    rows, cols, values, converged = heatmap_matrix(best_over_grid(heat_rows()))
    assert rows == ["mamba2 L=2 d=32 fixed", "mamba2 L=2 d=64 fixed", "mha"]
    assert cols == ["in-context-recall", "in-context-recall vocab_size=32", "parity", "parity-long"]
    assert values == [[0.9, None, None, None], [1.0, 0.4, None, None], [0.8, None, 0.95, 0.5]]
    assert converged[1] == [True, False, True, True] and all(converged[0]) and all(converged[2])


def test_charts_are_readable_pngs(tmp_path):
    best = best_over_grid(heat_rows() + score_rows())
    paths = write_report(best, tmp_path / "report")
    assert [p.name for p in paths] == ["heatmap.png", "mad_score.png", "accuracy_vs_state.png"]
    for path in paths:
        assert path.stat().st_size > 0
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not list((tmp_path / "report").glob("*.tmp"))


def test_charts_of_state_tracking_only(tmp_path):
    best = best_over_grid([run("parity", per_set={"parity": 0.5, "parity-long": 0.5}), run("s5", arch="mha")])
    for chart in (heatmap_chart, score_chart, state_chart):
        assert matplotlib.image.imread(chart(best, tmp_path)).ndim == 3
