"""PNG charts of a comparison: cache bytes vs context, decode throughput vs batch, per-token latency vs context,
and for masked diffusion LMs tokens/s vs sampler steps beside autoregressive decode."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402


MARKERS = "os^vDP*X"
DASHES = ("-", "--", "-.", ":")


def by_arch(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["arch"], []).append(row)
    return groups


def line_chart(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
               markers: dict[str, tuple[list, list]] | None = None, logx: bool = True, logy: bool = False) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for i, (name, (xs, ys)) in enumerate(series.items()):
        # marker and dash vary too: lines that coincide (e.g. mqa and cla caches) stay distinguishable
        line, = ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], linestyle=DASHES[i % len(DASHES)], label=name)
        if markers and name in markers:
            ax.scatter(*markers[name], marker="x", s=60, color=line.get_color(), zorder=3)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for xs, _ in series.values() for x in xs}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    if logy:
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def sorted_xy(rows: list[dict], x: str, y) -> tuple[list, list]:
    rows = sorted(rows, key=lambda r: r[x])
    return [r[x] for r in rows], [y(r) for r in rows]


def write_charts(rows: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    autoregressive = [r for r in rows if not r.get("steps")]
    diffusion = [r for r in rows if r.get("steps")]
    charts = autoregressive_charts(autoregressive, out) if autoregressive else []
    if diffusion:
        charts.append(diffusion_chart(diffusion, autoregressive, out))
    return charts


def diffusion_chart(diffusion: list[dict], autoregressive: list[dict], out: Path) -> Path:
    """One panel per context at the smallest batch: a line per diffusion arch and cache mode over steps, and each
    autoregressive arch's output tokens/s at the same context and batch as a flat line (it takes no steps)."""
    batch = min(r["batch"] for r in diffusion)
    contexts = sorted({r["context"] for r in diffusion})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.2 * len(contexts), 4.2), dpi=120, squeeze=False)
    for ax, context in zip(axes[0], contexts):
        cell = [r for r in diffusion if r["context"] == context and r["batch"] == batch]
        steps = sorted({r["steps"] for r in cell})
        series = {}
        for r in cell:
            series.setdefault(f"{r['arch']} cache={r['diffusion_cache']}", []).append(r)
        for i, (name, rs) in enumerate(series.items()):
            xs, ys = sorted_xy(rs, "steps", lambda r: r["output_tok_s"])
            ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], linestyle=DASHES[i % len(DASHES)], label=name)
        for arch, rs in by_arch([r for r in autoregressive if r["context"] == context and r["batch"] == batch]).items():
            ax.axhline(rs[0]["output_tok_s"], color="black", linestyle=DASHES[1], label=f"{arch} autoregressive")
        ax.set_xscale("log", base=2)
        ax.set_xticks(steps)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(title=f"context {context}, batch {batch}, {cell[0]['new_tokens']} new tokens",
               xlabel="sampler steps (forward passes for the answer)", ylabel="output tokens/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Masked diffusion LM: tokens/s vs steps, beside autoregressive decode of the same size")
    fig.tight_layout()
    path = out / "diffusion_tok_s_vs_steps.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def autoregressive_charts(rows: list[dict], out: Path) -> list[Path]:
    groups = by_arch(rows)
    mib = 2.0**20
    smallest_batch = {a: min(r["batch"] for r in rs) for a, rs in groups.items()}
    largest_context = {a: max(r["context"] for r in rs) for a, rs in groups.items()}
    per_seq = {a: [r for r in rs if r["batch"] == smallest_batch[a]] for a, rs in groups.items()}
    cache = line_chart(
        out / "cache_bytes_vs_context.png", "KV cache per sequence (line: analytic, x: measured)",
        "context length (tokens held)", "cache MiB per sequence",
        {a: ([r["context"] + r["new_tokens"] for r in sorted(rs, key=lambda r: r["context"])],
             [r["analytic_cache_bytes"] / r["batch"] / mib for r in sorted(rs, key=lambda r: r["context"])]) for a, rs in per_seq.items()},
        markers={a: ([r["context"] + r["new_tokens"] for r in rs], [r["measured_cache_bytes"] / r["batch"] / mib for r in rs])
                 for a, rs in per_seq.items()},
        logy=True,
    )
    throughput = line_chart(
        out / "decode_throughput_vs_batch.png", "Decode throughput vs batch size (longest context)",
        "batch size", "decode tokens/s",
        {a: sorted_xy([r for r in rs if r["context"] == largest_context[a]], "batch", lambda r: r["decode_tok_s"]) for a, rs in groups.items()},
    )
    latency = line_chart(
        out / "latency_vs_context.png", "Per-token decode latency vs context (smallest batch, median step)",
        "context length (tokens)", "median decode step (ms)",
        {a: sorted_xy(rs, "context", lambda r: r.get("decode_step_ms_p50", r["tpot_ms"])) for a, rs in per_seq.items()},
    )
    return [cache, throughput, latency]
