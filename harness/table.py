"""The comparison as a Markdown table, one row per measured cell."""

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


def markdown_table(rows: list[dict]) -> str:
    header = "| " + " | ".join(title for title, _, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---:" if key not in ("arch",) else "---" for _, key, _ in COLUMNS) + "|"
    lines = [header, rule]
    for row in sorted(rows, key=lambda r: (r["arch"], r["context"], r["batch"])):
        cells = []
        for _, key, fmt in COLUMNS:
            value = row[key] / 2**20 if key.endswith("cache_bytes") else row[key]
            cells.append(fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
