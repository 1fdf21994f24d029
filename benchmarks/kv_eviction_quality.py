"""What a smaller KV cache costs in quality: a `zoo train` language model read through its cache one byte a step
(harness/cached_bpb.py), keeping 1/2, 1/4, 1/8 and 1/16 of the context, by position (a sliding window; 4
StreamingLLM sinks and a window) or by score (H2O: half the budget the newest tokens, half heavy hitters; TOVA:
the newest query's attention alone), against the full cache. Every method at a budget keeps the same number of
tokens a sequence, so the same cache bytes (an evicting layer allocates one spare row, counted in its bytes).

Rows go to OUT/results.jsonl as they finish (a re-run skips them); the chart (bits per byte against cache bytes per
sequence) to OUT/quality_vs_bytes.png.

    python benchmarks/kv_eviction_quality.py --weights results/moe_quality/train/dense-total --windows 64
"""
import argparse
import copy
from pathlib import Path

import torch

import zoo
from cache import Retention
from harness.cached_bpb import cached_bits_per_byte
from harness.charts import line_chart
from harness.results import ResultStore
from harness.train.corpus import load_corpus, validation_windows
from harness.train.checkpoint import checkpoint_folder, read_train_state

METHODS = ("window", "sinks+window", "h2o", "tova")
FRACTIONS = (1 / 2, 1 / 4, 1 / 8, 1 / 16)
SINKS = 4  # StreamingLLM's


def with_retention(model, retention: Retention):
    """A copy whose full-attention layers keep by this positional policy (the weights unchanged)."""
    changed = copy.deepcopy(model)
    for block in changed.blocks:
        mixer = block.mixer
        if getattr(mixer, "retention", None) is not None and mixer.retention.keeps_all:
            mixer.retention, mixer.window, mixer.sinks = retention, retention.window, retention.sinks
    return changed


def kept_model(model, method: str, budget: int):
    if method == "window":
        return with_retention(model, Retention(window=budget))
    if method == "sinks+window":
        return with_retention(model, Retention(sinks=SINKS, window=budget - SINKS))
    return zoo.evict(model, policy=method, budget=budget)


def cache_bytes(model, length: int) -> int:
    """Bytes one sequence's cache holds at `length` tokens, as the engine allocates them for it (rows)."""
    return sum(spec.token_bytes(torch.float32) * spec.retention.rows(length)
               for spec in model.cache_specs() if spec.elements_per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=Path, required=True, help="a `zoo train` output folder")
    parser.add_argument("--windows", type=int, default=64, help="validation windows scored per method and budget")
    parser.add_argument("--out", type=Path, default=Path("results/kv_eviction_quality"))
    args = parser.parse_args()
    state = read_train_state(args.weights)
    if state is None:
        raise SystemExit(f"{args.weights} holds no `zoo train` checkpoint")
    model = zoo.load(checkpoint_folder(args.weights)).float().eval()
    context = state["settings"]["context"]
    corpus = load_corpus(state["settings"]["corpus"])
    windows = validation_windows(corpus, args.windows, context + 1).long()
    args.out.mkdir(parents=True, exist_ok=True)
    store = ResultStore(args.out / "results.jsonl", ("weights", "method", "budget", "windows"))
    cells = [("full", context + 1)] + [(m, max(SINKS + 2, round(context * f))) for f in FRACTIONS for m in METHODS]
    for method, budget in cells:
        cell = {"weights": str(args.weights), "method": method, "budget": budget, "windows": args.windows}
        if store.done(cell):
            continue
        kept = model if method == "full" else kept_model(model, method, budget)
        row = {**cell, "context": context, "bpb": cached_bits_per_byte(kept, windows),
               "cache_bytes": cache_bytes(kept, context + 1), "full_cache_bytes": cache_bytes(model, context + 1)}
        store.append(row)
        print(f"{method:>13} budget {budget:>4}: {row['bpb']:.4f} bits per byte, {row['cache_bytes']:,} B", flush=True)
    rows = [r for r in store.rows if r["weights"] == str(args.weights) and r["windows"] == args.windows]
    full = next(r for r in rows if r["method"] == "full")
    series = {m: tuple(zip(*sorted((r["cache_bytes"], r["bpb"]) for r in rows if r["method"] == m))) for m in METHODS}
    series["full cache"] = ([full["cache_bytes"]], [full["bpb"]])
    line_chart(args.out / "quality_vs_bytes.png", f"{model.config.name} ({args.weights.name}), context {context}",
               "cache bytes per sequence", "bits per byte (read through the cache)", series)
    print(f"| method | " + " | ".join(f"1/{round(1 / f)}" for f in FRACTIONS) + " |")
    for method in METHODS:
        cells = sorted((r for r in rows if r["method"] == method), key=lambda r: -r["budget"])
        print(f"| {method} | " + " | ".join(f"{r['bpb']:.3f}" for r in cells) + " |")
    print(f"full cache: {full['bpb']:.3f} bits per byte")


if __name__ == "__main__":
    main()
