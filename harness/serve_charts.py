"""PNG charts of a serving benchmark: latency (p50 and p99 TTFT and ITL) and throughput (output tokens/s, goodput
beside request throughput) against the offered load, one line per architecture."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from harness.charts import MARKERS, by_arch, sorted_xy  # noqa: E402

LOADS = {"request_rate": "request rate (req/s, Poisson arrivals)", "concurrency": "concurrency (requests in flight)"}


def panel(ax, rows: list[dict], load: str, lines: dict[str, tuple[str, str]], title: str, ylabel: str) -> None:
    """One colour and marker per architecture; `lines` maps a row field to its dash and label (p50 solid and p99
    dashed, say, in the same colour)."""
    for i, (arch, rs) in enumerate(by_arch(rows).items()):
        for key, (dash, label) in lines.items():
            ax.plot(*sorted_xy(rs, load, lambda r: r[key]), color=f"C{i % 10}", linestyle=dash,
                    marker=MARKERS[i % len(MARKERS)], label=f"{arch} {label}".strip())
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r[load] for r in rows}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(title=title, xlabel=LOADS[load], ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncols=2 if len(lines) > 1 else 1)


def figure(path: Path, rows: list[dict], load: str, panels: list[tuple[dict, str, str]], title: str) -> Path:
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.4), dpi=120, squeeze=False)
    for ax, (lines, panel_title, ylabel) in zip(axes[0], panels):
        panel(ax, rows, load, lines, panel_title, ylabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_serve_charts(rows: list[dict], out: Path) -> list[Path]:
    """A latency and a throughput chart for each kind of load the rows hold (Poisson rate, closed-loop concurrency)."""
    out.mkdir(parents=True, exist_ok=True)
    charts = []
    for load in LOADS:
        measured = [r for r in rows if r[load] is not None]
        if not measured:
            continue
        r = measured[0]
        workload = (f"{r['num_prefixes']} shared prefixes of {r['prefix_len']} + {r['suffix_len']} tokens"
                    if r["num_prefixes"] else f"prompts ~{r['input_len']}") + f", outputs ~{r['output_len']} tokens"
        slo = ", ".join(f"{name} <= {r[key]:g} ms" for name, key in (("TTFT", "ttft_slo_ms"), ("TPOT", "tpot_slo_ms"))
                        if r[key] is not None) or "no SLO (so goodput = all)"
        charts.append(figure(
            out / f"latency_vs_{load}.png", measured, load,
            [({"median_ttft_ms": ("-", "p50"), "p99_ttft_ms": ("--", "p99")}, "time to first token", "TTFT (ms)"),
             ({"median_itl_ms": ("-", "p50"), "p99_itl_ms": ("--", "p99")}, "inter-token latency", "ITL (ms)")],
            f"Serving latency vs load ({r['preset']} preset, {r['num_requests']} requests, {workload})"))
        charts.append(figure(
            out / f"throughput_vs_{load}.png", measured, load,
            [({"output_throughput": ("-", "")}, "output throughput", "output tokens/s"),
             ({"request_goodput": ("-", "goodput"), "request_throughput": ("--", "all completed")},
              f"goodput: requests meeting {slo}", "requests/s")],
            f"Serving throughput vs load ({r['preset']} preset, {r['num_requests']} requests, {workload})"))
    return charts
