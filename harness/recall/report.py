"""The recall sweep as a table (best over learning rates) and three charts: accuracy vs state bytes, accuracy vs width
(a hollow marker: the run had not converged when its budget ended), and every run's learning curve."""
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt  # noqa: E402

from matplotlib.ticker import NullFormatter  # noqa: E402

import zoo  # noqa: E402
from harness.charts import DASHES, MARKERS  # noqa: E402
from harness.recall.train import RECIPE_LAYERS, convergence, point_accuracy  # noqa: E402


def per_n(row: dict) -> dict[int, float]:
    """Accuracy per number of kv pairs (json keys come back as strings); the mean where the row has several seeds."""
    return {int(n): acc for n, acc in row["accuracy_per_kv_pairs"].items()}


def range_n(row: dict) -> dict[int, tuple[float, float]]:
    """(min, max) accuracy over seeds per number of kv pairs; empty for a one-seed row."""
    return {int(n): tuple(span) for n, span in row.get("accuracy_range_per_kv_pairs", {}).items()}


def held_out(rows: list[dict]) -> set[int]:
    """The N the models were tested on but never trained on."""
    return {int(n) for row in rows for n in str(row.get("held_out_kv_pairs", "")).split(",") if n}


def seed_count(row: dict) -> int:
    return len(row["seed"]) if isinstance(row.get("seed"), list) else 1


def accuracy_cell(row: dict, n: int) -> str:
    if n not in per_n(row):
        return ""
    low_high = range_n(row).get(n)
    return f"{per_n(row)[n]:.3f}" + (f" ({low_high[0]:.3f}–{low_high[1]:.3f})" if low_high else "")


def name(row: dict) -> str:
    """The architecture, and its depth where it is not the recipe's 2 layers ("cla, 4 layers")."""
    layers = row.get("n_layers", RECIPE_LAYERS)
    return row["arch"] if layers == RECIPE_LAYERS else f"{row['arch']}, {layers} layers"


def status(row: dict) -> str:
    """"solved", "plateau" or "not converged" (rows written before the field existed: from their history)."""
    return row.get("convergence") or convergence(row.get("history", []), row.get("solved", False),
                                                 row.get("chance", 0.0))


def converged(row: dict) -> bool:
    return status(row) != "not converged"


def markdown_table(best: list[dict]) -> str:
    ns = sorted({n for row in best for n in per_n(row)})
    unseen = held_out(best)
    header = (["arch", "layers", "d_model", "state (KiB, fp32)", "best lr", "seeds"]
              + [f"acc N={n}" + (" (held out)" if n in unseen else "") for n in ns]
              + ["acc (trained N)", "steps", "converged", "stopped", "wall (s)", "same model as"])
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in best:
        cells = [row["arch"], str(row.get("n_layers", RECIPE_LAYERS)), str(row["d_model"]),
                 f"{row['state_bytes'] / 1024:.1f}", f"{row['lr']:g}", str(seed_count(row))]
        cells += [accuracy_cell(row, n) for n in ns]
        verdict = status(row) if converged(row) else "**not converged**"
        cells += [f"{row['accuracy']:.3f}", str(row["steps"]), verdict, row.get("stopped", ""), f"{row['wall_s']:.0f}",
                  row.get("same_model_as", "")]
        lines.append("| " + " | ".join(cells) + " |")
    # why an architecture is also shown deeper than the recipe's 2 layers, one sentence each (its registry entry's)
    notes = [f"- {arch}: {zoo.registry.recall_note(arch)}." for arch in dict.fromkeys(r["arch"] for r in best)
             if zoo.registry.recall_note(arch)]
    if any(seed_count(row) > 1 for row in best):
        notes.insert(0, "- Rows of several seeds: mean accuracy (min–max over the seeds); steps: the most any seed "
                        "took; converged only if every seed did.")
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def lines(best: list[dict]) -> dict[str, list[dict]]:
    """One line per model: architectures whose rows are all the same models (e.g. mha, gqa and mqa with one head
    each) share a line labelled "mha = gqa = mqa" instead of hiding each other; a deeper run is a line of its own."""
    names = sorted({name(row) for row in best}, key=[name(r) for r in best].index)
    groups: dict[tuple, list[str]] = {}
    for series in names:
        rows = sorted((r for r in best if name(r) == series), key=lambda r: r["d_model"])
        groups.setdefault(tuple((r["d_model"], r.get("n_layers", RECIPE_LAYERS), r.get("same_model_as", r["arch"]))
                                for r in rows), []).append(series)
    return {" = ".join(members): [r for r in best if name(r) == members[0]] for members in groups.values()}


def panels(best: list[dict], x_of, xlabel: str, title: str, path: Path, logx: bool) -> Path:
    """One panel per number of kv pairs; in each, accuracy against x, one line per model; a run that had not
    converged when its budget ended is a hollow marker, so its point reads as a lower bound."""
    ns = sorted({n for row in best for n in per_n(row)})
    unseen = held_out(best)
    series = lines(best)
    colors = plt.get_cmap("tab10" if len(series) <= 10 else "tab20").colors
    fig, axes = plt.subplots(1, len(ns), figsize=(4.6 * len(ns) + 2.4, 4.4), dpi=110, sharey=True, squeeze=False)
    for ax, n in zip(axes[0], ns):
        for i, (label, rows) in enumerate(series.items()):
            rows = sorted((r for r in rows if n in per_n(r)), key=x_of)
            color, marker = colors[i % len(colors)], MARKERS[i % len(MARKERS)]
            ax.plot([x_of(r) for r in rows], [per_n(r)[n] for r in rows], linestyle=DASHES[i % len(DASHES)],
                    color=color, label=label, marker=marker, markevery=[])  # markers drawn per point below
            for r in rows:
                ax.plot([x_of(r)], [per_n(r)[n]], marker=marker, color=color, linestyle="none",
                        markerfacecolor=color if converged(r) else "none")
                if n in range_n(r):  # the spread over seeds
                    low, high = range_n(r)[n]
                    ax.vlines(x_of(r), low, high, color=color, linewidth=1.2)
        if logx:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # minor-tick labels (3x10^4, 4x10^4) ran into each other
        ax.set(title=f"L={best[0]['seq_len']}, N={n}" + (" (held out: not trained on)" if n in unseen else ""),
               xlabel=xlabel, ylim=(-0.02, 1.02))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("MQAR test accuracy")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside: never over a line
    legend = (["hollow marker: not converged when the step budget ended"] if not all(converged(r) for r in best)
              else []) + (["bar: range over seeds"] if any(range_n(r) for r in best) else [])
    if legend:
        fig.text(0.99, 0.01, "; ".join(legend), ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def learning_curves(best: list[dict], path: Path) -> Path:
    """Small multiples, one panel per architecture (and depth): mean test accuracy at every evaluation, one line per
    width."""
    archs = sorted({name(row) for row in best}, key=[name(r) for r in best].index)
    cols = min(4, len(archs))
    grid_rows = math.ceil(len(archs) / cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(3.4 * cols, 2.8 * grid_rows), dpi=110, sharex=True,
                             sharey=True, squeeze=False)
    widths = sorted({row["d_model"] for row in best})
    colors = plt.get_cmap("viridis")([i / max(1, len(widths) - 1) * 0.85 for i in range(len(widths))])
    for ax, arch in zip(axes.flat, archs):
        for row in sorted((r for r in best if name(r) == arch), key=lambda r: r["d_model"]):
            color = colors[widths.index(row["d_model"])]
            for i, history in enumerate(row.get("histories") or [row.get("history", [])]):  # one line per seed
                steps = [point["step"] for point in history]
                means = [point_accuracy(point) for point in history]
                ax.plot(steps, means, color=color, label=None if i else f"d={row['d_model']} ({status(row)})")
                if steps:
                    ax.plot(steps[-1:], means[-1:], marker="o", color=color,
                            markerfacecolor=color if converged(row) else "none")
        ax.set_title(arch, fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(archs):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (mean over trained N)")
    fig.suptitle("MQAR learning curves (best learning rate per width, one line per seed; hollow end: not converged)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(best: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [
        panels(best, lambda r: r["state_bytes"], "state / KV-cache bytes at the test length (fp32, log)",
               "Recall vs state size (best over learning rates)", out / "accuracy_vs_state_bytes.png", logx=True),
        panels(best, lambda r: r["d_model"], "d_model", "Recall vs model width (best over learning rates)",
               out / "accuracy_vs_d_model.png", logx=False),
        learning_curves(best, out / "learning_curves.png"),
    ]
