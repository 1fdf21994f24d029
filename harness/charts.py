"""PNG charts of a comparison: cache bytes vs context, decode throughput vs batch, per-token latency vs context."""
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
