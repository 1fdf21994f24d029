"""The comparison as Markdown tables, one row per measured cell: autoregressive cells, then diffusion cells."""

COLUMNS = [
    ("arch", "arch", "{}"),
    ("context", "context", "{}"),
    ("batch", "batch", "{}"),
    ("analytic KV (MiB)", "analytic_cache_bytes", "{:.2f}"),
    ("measured KV (MiB)", "measured_cache_bytes", "{:.2f}"),
    ("TTFT (ms)", "ttft_ms", "{:.1f}"),
    ("TPOT (ms)", "tpot_ms", "{:.2f}"),
    ("decode tok/s", "decode_tok_s", "{:.1f}"),
    ("MBU", "mbu", "{:.1%}"),
]

DIFFUSION_COLUMNS = [
    ("arch", "arch", "{}"),
    ("context", "context", "{}"),
    ("batch", "batch", "{}"),
    ("steps", "steps", "{}"),
    ("block", "block_length", "{}"),
    ("cache", "diffusion_cache", "{}"),
    ("forwards/token", "forwards_per_token", "{:.3f}"),
    ("tokens/forward", "tokens_per_forward", "{:.2f}"),
    ("first block (ms)", "ttft_ms", "{:.1f}"),
    ("tok/s", "output_tok_s", "{:.1f}"),
    ("cache (MiB)", "analytic_cache_bytes", "{:.2f}"),
    ("agrees w/ no cache", "agreement_vs_no_cache", "{:.1%}"),
]
CACHE_ORDER = ("none", "prefix", "dual")


def table(rows: list[dict], columns: list[tuple[str, str, str]], order) -> list[str]:
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |",
             "|" + "|".join("---" if key in ("arch", "diffusion_cache") else "---:" for _, key, _ in columns) + "|"]
    for row in sorted(rows, key=order):
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            if value is None:
                cells.append("—")
            else:
                cells.append(fmt.format(value / 2**20 if key.endswith("cache_bytes") else value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown_table(rows: list[dict]) -> str:
    autoregressive = [r for r in rows if not r.get("steps")]
    diffusion = [r for r in rows if r.get("steps")]
    lines = table(autoregressive, COLUMNS, lambda r: (r["arch"], r["context"], r["batch"])) if autoregressive else []
    if diffusion:
        lines += ([""] if lines else []) + ["Masked diffusion LM (LLaDA sampler; first block = the TTFT analogue):", ""]
        lines += table(diffusion, DIFFUSION_COLUMNS,
                       lambda r: (r["arch"], r["context"], r["batch"], -r["steps"], CACHE_ORDER.index(r["diffusion_cache"])))
    return "\n".join(lines) + "\n"
