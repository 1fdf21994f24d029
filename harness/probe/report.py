"""The probe suite's rows as a report: the best learning rate x weight decay per model and task setting (MAD-Lab's
rule: the best run is kept, here the best mean over seeds), MAD-Lab's score per architecture (mean over each task's
settings, then over its six tasks, state tracking excluded) with its range over seeds, a markdown table, and three
charts: an accuracy heatmap (architectures x task settings), the score per architecture, and accuracy against state
bytes per task (a hollow marker: the run had not converged when its budget ended)."""
import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from harness.charts import DASHES, MARKERS  # noqa: E402
from harness.probe.tasks import BASELINES, CHANGES  # noqa: E402

# MAD-Lab's six tasks (Poli et al. 2024): the only ones its score averages over
MAD_TASKS = ("in-context-recall", "fuzzy-in-context-recall", "noisy-in-context-recall", "selective-copying",
             "compression", "memorization")
TASK_ORDER = tuple(BASELINES)  # tasks in the suite's order, unknown ones after them by name
MODEL_FIELDS = ("arch", "n_layers", "d_model", "mode", "target")
NOT_CONVERGED = "not converged"


def model_key(row: dict) -> tuple:
    """What identifies one model of the sweep: (arch, n_layers, d_model, mode, target)."""
    return tuple(row[field] for field in MODEL_FIELDS)


def model_order(key: tuple) -> tuple:
    arch, layers, d_model, mode, target = key
    return arch, layers, d_model, mode, target is not None, target or 0  # None (mode fixed) sorts before numbers


def setting_order(task: str, change: str) -> tuple:
    """Tasks in the suite's order; within one, the baseline first, then each changed field in CHANGES' order by
    value (numbers numerically)."""
    task_rank = TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER)
    if change == "baseline":
        return task_rank, task, -1, "", 0, 0.0, ""
    field, _, value = change.partition("=")
    fields = list(CHANGES.get(task, {}))
    field_rank = fields.index(field) if field in fields else len(fields)
    try:
        return task_rank, task, field_rank, field, 0, float(value), ""
    except ValueError:
        return task_rank, task, field_rank, field, 1, 0.0, value


def row_order(row: dict) -> tuple:
    return setting_order(row["task"], row["change"]) + model_order(model_key(row))


def require_rows(rows: list[dict], caller: str) -> None:
    if not rows:
        raise ValueError(f"{caller}: no rows; expected the probe suite's results (one dict per run, or "
                         f"best_over_grid's rows) — is results.jsonl empty?")


def merge_convergence(statuses) -> str:
    """"not converged" if any seed was, "solved" only if every seed was, else "plateau"."""
    statuses = set(statuses)
    return NOT_CONVERGED if NOT_CONVERGED in statuses else "solved" if statuses == {"solved"} else "plateau"


def over_seeds(runs: list[dict]) -> dict:
    """One (lr, weight decay) pair's runs over seeds as one row: mean accuracies with their (min, max)."""
    seeds = [run["seed"] for run in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{runs[0]['task']} {runs[0]['change']} {model_key(runs[0])} lr={runs[0]['lr']:g} "
                         f"wd={runs[0]['weight_decay']:g}: seeds {seeds} repeat; one row per seed expected")
    accs = [run["accuracy"] for run in runs]
    sets = {name: [run["accuracy_per_set"][name] for run in runs] for name in runs[0]["accuracy_per_set"]}
    row = {key: value for key, value in runs[0].items() if key != "seed"}  # seeds replaces the one seed
    row.update(
        seeds=sorted(seeds),
        accuracy=sum(accs) / len(accs),
        accuracy_range=(min(accs), max(accs)),
        accuracy_per_set={name: sum(values) / len(values) for name, values in sets.items()},
        accuracy_per_set_range={name: (min(values), max(values)) for name, values in sets.items()},
        per_seed_accuracy={run["seed"]: run["accuracy"] for run in runs},
        convergence=merge_convergence(run["convergence"] for run in runs),
        steps=max(run["steps"] for run in runs),
        stopped=", ".join(sorted({run.get("stopped", "") for run in runs} - {""})),  # why each seed ended
    )
    return row


def best_over_grid(rows: list[dict]) -> list[dict]:
    """Per task setting and model: the (lr, weight_decay) pair with the best accuracy averaged over its seeds (ties:
    the smaller lr, then the smaller weight decay), as one row (see over_seeds) with grid_size, the pairs tried."""
    require_rows(rows, "best_over_grid")
    groups: dict[tuple, dict[tuple, list[dict]]] = {}
    for row in rows:
        group = (row["task"], row["change"]) + model_key(row)
        groups.setdefault(group, {}).setdefault((row["lr"], row["weight_decay"]), []).append(row)
    best = []
    for pairs in groups.values():
        candidates = [over_seeds(pairs[pair]) for pair in sorted(pairs)]
        kept = max(candidates, key=lambda row: row["accuracy"])  # max keeps the first of equals: the sorted order
        best.append({**kept, "grid_size": len(pairs)})
    return sorted(best, key=row_order)


def mad_score(best: list[dict]) -> dict[tuple, dict]:
    """Per model (arch, n_layers, d_model, mode, target): MAD-Lab's score, the mean over MAD_TASKS present of the
    mean accuracy over that task's settings; low and high, the same score per seed (over the seeds every setting
    has; None where there is none) at its min and max; tasks, the MAD tasks that entered."""
    require_rows(best, "mad_score")
    per_model: dict[tuple, dict[str, list[dict]]] = {}
    for row in best:
        if row["task"] in MAD_TASKS:
            per_model.setdefault(model_key(row), {}).setdefault(row["task"], []).append(row)
    scores = {}
    for key in sorted(per_model, key=model_order):
        tasks = [task for task in MAD_TASKS if task in per_model[key]]
        settings = [per_model[key][task] for task in tasks]
        seeds = set.intersection(*(set(row["per_seed_accuracy"]) for rows in settings for row in rows))
        per_seed = [two_level_mean(settings, lambda row, s=seed: row["per_seed_accuracy"][s]) for seed in seeds]
        scores[key] = {"score": two_level_mean(settings, lambda row: row["accuracy"]),
                       "low": min(per_seed, default=None), "high": max(per_seed, default=None),
                       "tasks": tasks, "seeds": sorted(seeds)}
    return scores


def two_level_mean(settings: list[list[dict]], value) -> float:
    """The mean over tasks of the mean over each task's settings (every task weighs the same, however many
    settings it has)."""
    return sum(sum(value(row) for row in rows) / len(rows) for rows in settings) / len(settings)


def compact(n: float) -> str:
    """8192 -> "8.19k": targets and sizes short enough for a label."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def mode_text(mode: str, target) -> str:
    return mode if target is None else f"{mode} {compact(target)}"


def model_labels(keys) -> dict[tuple, str]:
    """The architecture's name, with depth, width and mode where the architecture has several models."""
    keys = sorted(set(keys), key=model_order)
    counts = {arch: sum(key[0] == arch for key in keys) for arch, *_ in keys}
    return {key: key[0] if counts[key[0]] == 1 else f"{key[0]} L={key[1]} d={key[2]} {mode_text(*key[3:])}"
            for key in keys}


def sets_in_order(row: dict) -> list[str]:
    """The row's test sets, the trained setting's own (named after the task) first."""
    return sorted(row["accuracy_per_set"], key=lambda name: (name != row["task"], name))


def accuracy_text(value: float, span, seeds: int) -> str:
    return f"{value:.3f}" + (f" ({span[0]:.3f}–{span[1]:.3f})" if seeds > 1 else "")


def status_text(row: dict) -> str:
    """The verdict, with "at budget" where a plateau's run ended at its step budget (a run still at a pre-jump shelf
    reads the same as a plateau: the reader is told it was not stopped early)."""
    if row["convergence"] == NOT_CONVERGED:
        return f"**{NOT_CONVERGED}**"
    at_budget = row["convergence"] == "plateau" and "max_steps" in row.get("stopped", "")
    return row["convergence"] + (" (at budget)" if at_budget else "")


def markdown_table(best: list[dict]) -> str:
    """One line per task setting and model, then MAD-Lab's score per model."""
    require_rows(best, "markdown_table")
    multi_set = any(len(row["accuracy_per_set"]) > 1 for row in best)
    header = (["task", "setting", "arch", "layers", "d_model", "mode", "seeds", "accuracy"]
              + ["per test set"] * multi_set
              + ["chance", "lr", "wd", "state bytes", "non-emb params", "steps / max", "status"])
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|" + "---:|" * (len(header) - 4) + "---|"]
    for row in best:
        seeds = len(row["seeds"])
        cells = [row["task"], row["change"], row["arch"], str(row["n_layers"]), str(row["d_model"]),
                 mode_text(row["mode"], row["target"]), str(seeds),
                 accuracy_text(row["accuracy"], row["accuracy_range"], seeds)]
        if multi_set:
            per_set = [name + " " + accuracy_text(row["accuracy_per_set"][name], row["accuracy_per_set_range"][name],
                                                  seeds) for name in sets_in_order(row)]
            cells.append(", ".join(per_set) if len(per_set) > 1 else "")
        cells += [f"{row['chance']:.3f}", f"{row['lr']:g}", f"{row['weight_decay']:g}", f"{row['state_bytes']:,}",
                  f"{row['non_embedding_parameters']:,}", f"{row['steps']} / {row['max_steps']}", status_text(row)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["", "- lr, wd: the pair with the best accuracy averaged over seeds, of the grid tried (MAD-Lab keeps the "
                 "best run); accuracy: mean over seeds (min–max); steps: the most any seed took; status: not "
                 "converged if any seed was, solved only if every seed was."]
    scores = mad_score(best)
    if scores:
        labels = model_labels(scores)
        lines += notes + ["", "MAD-Lab score (mean accuracy over each task's settings, then over its six tasks; "
                              "range: the same score per seed):", "",
                          "| model | score | range over seeds | MAD tasks |", "|---|---:|---:|---|"]
        for key, score in sorted(scores.items(), key=lambda item: -item[1]["score"]):
            span = "—" if score["low"] is None else f"{score['low']:.3f}–{score['high']:.3f}"
            missing = [task for task in MAD_TASKS if task not in score["tasks"]]
            tasks = f"{len(score['tasks'])}/{len(MAD_TASKS)}" + (f" (missing: {', '.join(missing)})" if missing else "")
            lines.append(f"| {labels[key]} | {score['score']:.3f} | {span} | {tasks} |")
    else:
        lines += notes
    return "\n".join(lines) + "\n"


def heatmap_matrix(best: list[dict]) -> tuple[list[str], list[str], list[list], list[list[bool]]]:
    """(row labels: one per model, column labels: one per task setting and per extra test set such as parity-long,
    values: accuracy per cell or None where the model has no run, converged: False where the cell's run was not)."""
    require_rows(best, "heatmap_matrix")
    keys = sorted({model_key(row) for row in best}, key=model_order)
    columns: dict[tuple, str] = {}
    for row in sorted(best, key=row_order):
        for name in sets_in_order(row):
            label = name if row["change"] == "baseline" else f"{name} {row['change']}"
            columns.setdefault((row["task"], row["change"], name), label)
    rows = {key: i for i, key in enumerate(keys)}
    cols = {column: j for j, column in enumerate(columns)}
    values = [[None] * len(cols) for _ in keys]
    converged = [[True] * len(cols) for _ in keys]
    for row in best:
        for name, accuracy in row["accuracy_per_set"].items():
            i, j = rows[model_key(row)], cols[row["task"], row["change"], name]
            values[i][j] = accuracy
            converged[i][j] = row["convergence"] != NOT_CONVERGED
    labels = model_labels(keys)
    return [labels[key] for key in keys], list(columns.values()), values, converged


def save(fig, path: Path) -> Path:
    """Written to a temporary name and moved into place, so a reader never sees half a PNG."""
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def heatmap_chart(best: list[dict], out: Path) -> Path:
    row_labels, col_labels, values, converged = heatmap_matrix(best)
    grid = np.ma.masked_invalid(np.array([[np.nan if v is None else v for v in line] for line in values], float))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.5 + 0.55 * len(col_labels)), max(3.0, 1.8 + 0.42 * len(row_labels))),
                           dpi=110)
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")  # grey: no run for this model at this setting
    image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    size = 7 if len(col_labels) <= 20 else 5.5
    for i, line in enumerate(values):
        for j, value in enumerate(line):
            if value is not None:
                ax.text(j, i, f"{value:.2f}" + ("" if converged[i][j] else "*"), ha="center", va="center",
                        fontsize=size, color="white" if value < 0.5 else "black")  # legible on both ends of viridis
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02, label="test accuracy")
    note = "; * not converged when the step budget ended" if not all(map(all, converged)) else ""
    ax.set_title(f"Test accuracy per task setting (best lr x wd, mean over seeds{note})", fontsize=9)
    fig.tight_layout()
    return save(fig, out / "heatmap.png")


def score_chart(best: list[dict], out: Path) -> Path:
    """MAD-Lab's score per model, best at the top; bars: the score's range over seeds."""
    scores = mad_score(best)
    ranked = sorted(scores.items(), key=lambda item: item[1]["score"])
    labels = model_labels(scores)
    fig, ax = plt.subplots(figsize=(7.2, max(2.6, 1.4 + 0.38 * len(ranked))), dpi=110)
    for y, (key, score) in enumerate(ranked):
        # the range drawn as its own segment, not as error bars: over the seeds every setting has, it may miss the
        # score itself where some setting has more seeds than others
        if score["low"] is not None:
            ax.plot([score["low"], score["high"]], [y, y], color="C0", marker="|", markersize=9)
        ax.plot([score["score"]], [y], marker="o", color="C0")
    ax.set_yticks(range(len(ranked)), [labels[key] + ("" if len(s["tasks"]) == len(MAD_TASKS)
                                                      else f" ({len(s['tasks'])}/{len(MAD_TASKS)} tasks)")
                                       for key, s in ranked], fontsize=8)
    ax.set_xlim(-0.02, 1.02)
    ax.set(xlabel="MAD score (mean accuracy over each task's settings, then over tasks)",
           title="MAD-Lab score per architecture (bars: range over seeds)" if ranked
           else "MAD-Lab score: no MAD-Lab task in these runs")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return save(fig, out / "mad_score.png")


def state_chart(best: list[dict], out: Path) -> Path:
    """One panel per task at its baseline setting (else its first setting run): accuracy against state bytes, one
    line per architecture through its models; hollow: not converged; vertical bar: range over seeds."""
    require_rows(best, "state_chart")
    tasks = sorted({row["task"] for row in best}, key=lambda task: setting_order(task, "baseline"))
    archs = sorted({row["arch"] for row in best})
    colors = plt.get_cmap("tab10" if len(archs) <= 10 else "tab20").colors
    style = {arch: (colors[i % len(colors)], MARKERS[i % len(MARKERS)], DASHES[i % len(DASHES)])
             for i, arch in enumerate(archs)}
    cols = min(4, len(tasks))
    fig, axes = plt.subplots(math.ceil(len(tasks) / cols), cols, figsize=(3.6 * cols + 2.2, 3.0 * math.ceil(
        len(tasks) / cols) + 0.4), dpi=110, sharey=True, squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        change = min((row["change"] for row in best if row["task"] == task), key=lambda c: setting_order(task, c))
        panel = [row for row in best if row["task"] == task and row["change"] == change]
        for arch in archs:
            color, marker, dash = style[arch]
            points = sorted((row for row in panel if row["arch"] == arch), key=lambda row: row["state_bytes"])
            ax.plot([row["state_bytes"] for row in points], [row["accuracy"] for row in points], color=color,
                    linestyle=dash)
            for row in points:
                ax.plot([row["state_bytes"]], [row["accuracy"]], marker=marker, color=color, linestyle="none",
                        markerfacecolor=color if row["convergence"] != NOT_CONVERGED else "none")
                if row["accuracy_range"][0] < row["accuracy_range"][1]:
                    ax.vlines(row["state_bytes"], *row["accuracy_range"], color=color, linewidth=1.2)
        ax.axhline(panel[0]["chance"], color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        # labels at 1, 2 and 5 per decade: a panel whose points span less than a decade still reads
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: compact(value)))
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor-tick labels ran into each other
        ax.set_title(task if change == "baseline" else f"{task} ({change})", fontsize=9)
        ax.set(ylim=(-0.02, 1.02), xlabel="state / KV bytes per sequence (log)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy")
    handles = [Line2D([], [], color=style[arch][0], marker=style[arch][1], linestyle=style[arch][2], label=arch)
               for arch in archs]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # never over a line
    fig.text(0.99, 0.01, "hollow marker: not converged when the step budget ended; vertical bar: range over seeds; "
                         "dotted: chance", ha="right", fontsize=7)
    fig.suptitle("Accuracy vs state size per task (best lr x wd, mean over seeds)")
    fig.tight_layout(rect=(0, 0.03, 1, 1))  # the bottom strip holds the footnote
    return save(fig, out / "accuracy_vs_state.png")


def write_report(best: list[dict], out: Path) -> list[Path]:
    require_rows(best, "write_report")
    out.mkdir(parents=True, exist_ok=True)
    return [heatmap_chart(best, out), score_chart(best, out), state_chart(best, out)]
