"""The comparison as Markdown tables, one row per measured cell: autoregressive cells, then diffusion cells; rows of
trained models (`zoo compare --weights`) add their validation bits per byte (a diffusion LM's: its ELBO bound).

A column is (title, key or tuple of keys, format): a tuple fills one cell from several fields ("measured / floor").
"""

COLUMNS = [
    ("arch", "arch", "{}"),
    ("context", "context", "{}"),
    ("batch", "batch", "{}"),
    ("KV MiB analytic / measured", ("analytic_cache_bytes", "measured_cache_bytes"), "{:.2f} / {:.2f}"),
    ("TTFT / prefill floor (ms)", ("ttft_ms", "prefill_floor_ms"), "{:.1f} / {:.1f}"),
    ("TPOT (ms)", "tpot_ms", "{:.2f}"),
    ("step p50 / floor (ms)", ("step_ms_p50", "floor_ms"), "{:.2f} / {:.2f}"),
    ("x floor", "fraction_of_floor", "{:.1f}"),
    ("bound", "bound", "{}"),
    ("decode tok/s", "decode_tok_s", "{:.1f}"),
    ("MBU", "mbu", "{:.0%}"),
    ("MFU", "mfu", "{:.0%}"),
]
TEXT_KEYS = ("arch", "diffusion_cache", "bound", "quant", "kv_dtype")  # left-aligned

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
QUALITY_COLUMN = ("val bpb", "val_bpb", "{:.3f}")
QUANT_COLUMN = ("quant", "quant", "{}")
KV_COLUMN = ("KV", "kv_dtype", "{}")
EVICT_COLUMN = ("evict (share kept)", ("kv_policy", "kv_budget"), "{} {:.3g}")
WEIGHTS_COLUMN = ("weights MiB", "weight_bytes", "{:.2f}")
MIB_KEYS = ("analytic_cache_bytes", "measured_cache_bytes", "weight_bytes")  # shown in MiB
BOUND_COLUMN = ("val bpb (ELBO bound)", "val_bpb", "≤ {:.3f}")


def table(rows: list[dict], columns: list[tuple[str, str, str]], order) -> list[str]:
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |",
             "|" + "|".join("---" if key in TEXT_KEYS else "---:" for _, key, _ in columns) + "|"]
    for row in sorted(rows, key=order):
        cells = []
        for _, key, fmt in columns:
            keys = key if isinstance(key, tuple) else (key,)
            values = [row.get(k) for k in keys]
            if any(v is None for v in values):  # a diffusion cell, or a row written before the field existed
                cells.append("—")
            else:
                cells.append(fmt.format(*(v / 2**20 if k in MIB_KEYS else v for k, v in zip(keys, values))))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown_table(rows: list[dict]) -> str:
    autoregressive = [r for r in rows if not r.get("steps")]
    diffusion = [r for r in rows if r.get("steps")]
    quantized = any(r.get("quant", "none") != "none" for r in rows)
    quantized_kv = any(r.get("kv_dtype", "auto") != "auto" for r in rows)
    evicted = any(r.get("kv_policy", "none") != "none" for r in rows)
    columns = (COLUMNS[:1] + [QUANT_COLUMN, WEIGHTS_COLUMN] * quantized + [KV_COLUMN] * quantized_kv
               + [EVICT_COLUMN] * evicted + COLUMNS[1:]
               + [QUALITY_COLUMN] * any("val_bpb" in r for r in autoregressive))
    def order(r: dict) -> tuple:  # an architecture's plain rows first, then its quantized and evicting ones
        quant, policy = r.get("quant", "none"), r.get("kv_policy", "none")
        return (r["arch"], quant != "none", quant, r.get("kv_dtype", "auto"), policy != "none", policy,
                -(r.get("kv_budget") or 1), r["context"], r["batch"])

    lines = table(autoregressive, columns, order) if autoregressive else []
    if diffusion:
        lines += ([""] if lines else []) + ["Masked diffusion LM (LLaDA sampler; first block = the TTFT analogue):", ""]
        lines += table(diffusion, DIFFUSION_COLUMNS + [BOUND_COLUMN] * any("val_bpb" in r for r in diffusion),
                       lambda r: (r["arch"], r["context"], r["batch"], -r["steps"], CACHE_ORDER.index(r["diffusion_cache"])))
    return "\n".join(lines) + "\n"
