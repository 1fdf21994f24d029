"""PNG charts of a comparison: cache bytes vs context, decode throughput vs batch, per-token latency vs context,
measured decode step vs its roofline floor, for masked diffusion LMs tokens/s vs sampler steps beside
autoregressive decode, and for trained models (`zoo compare --weights`) validation bits per byte vs cache bytes."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogFormatter, NullFormatter, ScalarFormatter  # noqa: E402

from harness.train.objective import BPB  # noqa: E402


MARKERS = "os^vDP*X"
DASHES = ("-", "--", "-.", ":")


def series_name(row: dict) -> str:
    """A row's line in a chart: its architecture, with its weight quantization, quantized KV cache and KV eviction
    where it has them."""
    quant, kv, policy = row.get("quant", "none"), row.get("kv_dtype", "auto"), row.get("kv_policy", "none")
    evict = [] if policy == "none" else [f"{policy}-{row['kv_budget']:g}"]
    return " ".join([row["arch"]] + [quant] * (quant != "none") + [f"kv-{kv}"] * (kv != "auto") + evict)


def by_arch(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by series_name, in row order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(series_name(row), []).append(row)
    return groups


def line_chart(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
               markers: dict[str, tuple[list, list]] | None = None, logx: bool = True, logy: bool = False,
               xticks: list | None = None, legend: dict | None = None) -> Path:
    """xticks: where the x axis is labelled (default: at every x a series has); legend: matplotlib's legend
    arguments (default: its best place inside the axes)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for i, (name, (xs, ys)) in enumerate(series.items()):
        # marker and dash vary too: lines that coincide (e.g. mqa and cla caches) stay distinguishable
        line, = ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], linestyle=DASHES[i % len(DASHES)], label=name)
        if markers and name in markers:
            ax.scatter(*markers[name], marker="x", s=60, color=line.get_color(), zorder=3)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xticks or sorted({x for xs, _ in series.values() for x in xs}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    if logy:
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**(legend or {}))
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
    if any("val_bpb" in r for r in rows):
        charts.append(quality_chart([r for r in rows if "val_bpb" in r], out))
        if any(r.get("quant", "none") != "none" or r.get("kv_dtype", "auto") != "auto" for r in rows):
            charts.append(memory_chart([r for r in rows if "val_bpb" in r], out))
    return charts


def memory_chart(rows: list[dict], out: Path) -> Path:
    """One marker per architecture x weight quantization x KV storage: validation bits per byte against the memory one
    sequence needs at the largest context, weights plus cache (quantized weights and one-byte caches as stored, scales
    included; a quantized cache changes memory, not the validation figure, which is an uncached forward)."""
    fig, ax = plt.subplots(figsize=(9.6, 4.4), dpi=120)
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    quants = list(dict.fromkeys(r.get("quant", "none") for r in rows))
    context = max(r["context"] for r in rows)
    for name, rs in by_arch(rows).items():
        at = [r for r in rs if r["context"] == context]
        if not at:
            continue
        row = min(at, key=lambda r: r["batch"])
        x = (row["weight_bytes"] + row["analytic_cache_bytes"] / row["batch"]) / 2**20
        color = plt.get_cmap("tab10")(archs.index(row["arch"]) % 10)
        hollow = row.get("kv_dtype", "auto") != "auto"  # an int8 or fp8 cache: the same marker, unfilled
        ax.scatter([x], [row["val_bpb"]], marker=MARKERS[quants.index(row.get("quant", "none")) % len(MARKERS)],
                   s=50, zorder=3, label=name, edgecolors=color, facecolors="none" if hollow else color)
    ax.set_xscale("log")
    ax.set(title=f"Memory vs quality: weights + cache of one sequence at context {context}",
           xlabel="MiB (weights as stored + cache; hollow: int8 / fp8 KV cache)",
           ylabel="validation bits per byte (lower is better)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out / "memory_vs_quality.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def tokens_text(tokens: int) -> str:
    return f"{tokens / 1e6:.1f}M" if tokens >= 100_000 else f"{tokens / 1e3:.1f}K"


def budget_title(rows: list[dict]) -> str:
    """What each model was trained with: "equal budget: 3 min / 5.1M tokens each on 2-core CPU", a token range
    where an equal time budget bought different token counts, or each model's budget where they differ."""
    runs = {r["arch"]: r for r in rows}.values()
    hardware = {r["train_hardware"] for r in runs}
    where = f" on {hardware.pop()}" if len(hardware) == 1 else " on different hardware"
    budgets = {r["train_budget"] for r in runs}
    if len(budgets) > 1:
        return "budgets differ: " + ", ".join(f"{r['arch']} {r['train_budget']} / {tokens_text(r['train_tokens'])} "
                                              f"tokens" for r in runs) + where
    tokens = sorted({r["train_tokens"] for r in runs})
    spent = " to ".join(tokens_text(t) for t in dict.fromkeys([tokens[0], tokens[-1]])) + " tokens"
    return f"equal budget: {budgets.pop()} / {spent} each{where}"


def quality_chart(rows: list[dict], out: Path) -> Path:
    """One labelled point per trained architecture: validation bits per byte against cache bytes per sequence at
    its largest context (the largest of its rows there: a diffusion LM's dual cache), the unigram baseline as a
    line. A diffusion LM's point is its ELBO bound, so labelled."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for i, (arch, rs) in enumerate(by_arch(rows).items()):
        context = max(r["context"] for r in rs)
        x = max(r["analytic_cache_bytes"] / r["batch"] for r in rs if r["context"] == context) / 2**20
        bound = rs[0]["val_metric"] != BPB
        ax.scatter([x], [rs[0]["val_bpb"]], marker=MARKERS[i % len(MARKERS)], s=50, zorder=3)
        ax.annotate(f"{arch} (ELBO bound)" if bound else arch, (x, rs[0]["val_bpb"]), xytext=(5, 4),
                    textcoords="offset points", fontsize=8)
    ax.axhline(rows[0]["unigram_bpb"], color="black", linestyle=DASHES[1], linewidth=1,
               label=f"unigram baseline {rows[0]['unigram_bpb']:.2f}")
    ax.set_xscale("log")
    ax.margins(x=0.15)  # room for the labels of the outermost points
    ax.set(title=budget_title(rows), xlabel=f"cache MiB per sequence at context {max(r['context'] for r in rows)} "
           f"(+ {rows[0]['new_tokens']} new tokens)", ylabel="validation bits per byte (lower is better)")
    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "quality_vs_cache.png"
    fig.savefig(path)
    plt.close(fig)
    return path


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
        level = [r for r in autoregressive if r["context"] == context and r["batch"] == batch
                 and r.get("output_tok_s") is not None]  # a decode-probe row ran no prefill: no output tok/s
        for arch, rs in by_arch(level).items():
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
        {a: sorted_xy(rs, "context", lambda r: r.get("step_ms_p50", r["tpot_ms"])) for a, rs in per_seq.items()},
    )
    floored = [r for r in rows if r.get("floor_ms")]  # rows written before the roofline existed have no floor
    return [cache, throughput, latency] + ([step_vs_floor_chart(floored, out)] if floored else [])


def floor_bars(ax, rows: list[dict], bar_key: str, bar_label) -> None:
    """Grouped bars on one axis: a group per architecture (in row order), a bar per value of `bar_key` within it,
    height the measured median decode step; the roofline floor is a black bar over each, and the measured / floor
    ratio is written above."""
    archs = list(by_arch(rows))
    values = sorted({r[bar_key] for r in rows})
    width = 0.8 / len(values)
    colors = plt.get_cmap("viridis")([(i + 0.5) / len(values) for i in range(len(values))])
    cells = {(series_name(r), r[bar_key]): r for r in rows}
    for j, (value, color) in enumerate(zip(values, colors)):
        xs = [i + (j - (len(values) - 1) / 2) * width for i, a in enumerate(archs) if (a, value) in cells]
        rs = [cells[a, value] for a in archs if (a, value) in cells]
        ax.bar(xs, [r["step_ms_p50"] for r in rs], width * 0.92, color=color, label=bar_label(value))
        ax.hlines([r["floor_ms"] for r in rs], [x - width / 2 for x in xs], [x + width / 2 for x in xs],
                  color="black", linewidth=2.2, label="roofline floor" if j == 0 else None)
        for x, r in zip(xs, rs):
            ax.annotate(f"{r['step_ms_p50'] / r['floor_ms']:.1f}x", (x, max(r["step_ms_p50"], r["floor_ms"])),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=6.5, rotation=90)
    crowded = len(archs) > 6  # long names (hybrid-1in6) would overlap level
    ax.set_xticks(range(len(archs)), archs, rotation=30 if crowded else 0, ha="right" if crowded else "center")
    ax.set_yscale("log")
    # plain numbers (20, 30, 40 ms), also on the minor ticks a narrow range labels instead of the decades
    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.margins(y=0.25)
    ax.grid(True, axis="y", which="major", alpha=0.3)


def step_vs_floor_chart(rows: list[dict], out: Path) -> Path:
    """One panel per batch size: each architecture's measured median decode step at each context beside the
    floor max(bytes / streaming rate, FLOPs / matmul rate) of a step at that batch and its mean context."""
    batches = sorted({r["batch"] for r in rows})
    n_archs = len(by_arch(rows))
    fig, axes = plt.subplots(len(batches), 1, figsize=(max(6.4, 0.75 * n_archs + 2.5), 2.9 * len(batches) + 0.6),
                             dpi=130, squeeze=False, sharex=True)
    for ax, batch in zip(axes[:, 0], batches):
        floor_bars(ax, [r for r in rows if r["batch"] == batch], "context", lambda c: f"context {c}")
        ax.set_ylabel(f"batch {batch}\ndecode step (ms)")
    axes[0, 0].legend(fontsize=8, ncols=4, loc="lower left", bbox_to_anchor=(0, 1.02), frameon=False)
    r = rows[0]
    fig.suptitle(f"Measured median decode step vs roofline floor ({r['dtype']}, {r['kv_cache']}, {r['device']}: "
                 f"memory read {read_note(rows)}, {r['matmul_gflop_s']:.0f} GFLOP/s matmul"
                 f"{gemv_note(r)}); label: measured / floor",
                 fontsize=9)
    fig.tight_layout()
    path = out / "step_vs_floor.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def read_note(rows: list[dict]) -> str:
    """The read rate that priced the floors: each cell's own where it was swept around the cell's steps (a range),
    else the run's."""
    swept = [r["stream_gb_s"] for r in rows if r.get("read_before_gb_s")]
    if swept:
        return f"{min(swept):.1f}-{max(swept):.1f} GB/s, each cell's around its steps"
    return f"{rows[0].get('read_gb_s') or rows[0]['stream_gb_s']:.1f} GB/s"


def gemv_note(row: dict) -> str:
    """torch's GEMV rate beside the floor's read rate: the library's line, never the floor."""
    return f"; torch's GEMV {row['gemv_gb_s']:.1f} GB/s" if row.get("gemv_gb_s") else ""
