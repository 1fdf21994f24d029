"""Trees against chains of the same verification width: a trained target decodes held-out text with each proposer
as one chain of w tokens, as trees of the same w proposed tokens (b branches of w / b; a budget tree of w nodes grown
by the draft's probabilities; two drafts' chains side by side), and the same for prompt lookup and lookahead
decoding. Each cell: tokens per target forward, output tokens/s, the speed-up over the chain of equal width and over
the target alone, and whether the greedy outputs equal the target alone's (checked). Prompts are held-out windows of
the target's corpus; a target that cannot verify trees (a recurrent state) runs each shape as its first chain
(chain_fallback, recorded in the row). Rows go to OUT/results.jsonl as they finish (a re-run skips them); the table
is printed and the chart (tokens per forward and speed-up against the verification width, a line per shape) written
to OUT/trees_vs_width.png.

    python benchmarks/speculative_trees.py --target results/prune_distill/teacher \\
        --drafts half-depth=results/prune_distill/distill-depth-mlp,half-width=results/prune_distill/distill-mlp
"""
import argparse
from pathlib import Path

import torch

import zoo
from harness import PROMPT_LOOKUP, SpeculativeConfig
from harness.charts import MARKERS, plt
from harness.engine.speculative.config import LOOKAHEAD
from harness.results import ResultStore
from speculative_drafts import prompts_for, run  # benchmarks/, beside this script

KEY = ("target", "proposer", "shape", "width", "batch", "prompt_len", "new_tokens", "requests", "kv_cache")


def shapes(width: int, kind: str) -> dict[str, dict]:
    """SpeculativeConfig settings for each shape of `width` proposed tokens a step, for a proposer of this kind
    ("model", "two drafts" or "text": prompt lookup and lookahead); a branch count that does not divide the width is
    left out."""
    if kind == "two drafts":
        return {"2 drafts x 1 chain": {"num_speculative_tokens": width // 2}}
    out = {"chain": {"num_speculative_tokens": width}}
    for branches in (2, 4):
        if width % branches == 0:
            out[f"{branches} branches"] = {"num_speculative_tokens": width // branches, "branches": branches}
    if kind == "model":
        out["budget tree"] = {"num_speculative_tokens": max(2, width // 2), "branches": 2, "tree_budget": width}
    return out


def proposers(args) -> dict:
    """Name -> the draft argument of SpeculativeConfig."""
    drafts = {name: zoo.load(path).float().eval() for name, path in
              (item.split("=", 1) for item in filter(None, args.drafts.split(",")))}
    out = {name: model for name, model in drafts.items()}
    if len(drafts) >= 2:
        out["two drafts"] = tuple(list(drafts.values())[:2])
    return {**out, "prompt lookup": PROMPT_LOOKUP, "lookahead": LOOKAHEAD}


def chart(rows: list[dict], path: Path) -> Path:
    """Left: tokens per target forward against width; right: speed-up over the target alone (batch 1). A colour
    per proposer, a line style and marker per shape (the chain solid)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
    proposers = sorted({r["proposer"] for r in rows})
    shapes_seen = sorted({r["shape"] for r in rows}, key=lambda shape: (shape != "chain", shape))
    colours = {name: f"C{i}" for i, name in enumerate(proposers)}
    for proposer in proposers:
        for j, shape in enumerate(shapes_seen):
            mine = sorted((r for r in rows if (r["proposer"], r["shape"]) == (proposer, shape)),
                          key=lambda r: r["width"])
            if not mine:
                continue
            style = dict(color=colours[proposer], marker=MARKERS[j % len(MARKERS)],
                         linestyle="-" if shape == "chain" else ("--", ":", "-.")[j % 3])
            xs = [r["width"] for r in mine]
            left.plot(xs, [r["tokens_per_forward"] for r in mine], label=f"{proposer}: {shape}", **style)
            right.plot(xs, [r["speedup"] for r in mine], **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["width"] for r in rows}), [str(w) for w in sorted({r["width"] for r in rows})])
        ax.set_xlabel("verification width (tokens proposed a step)")
        ax.grid(True, alpha=0.3)
    left.set(ylabel="tokens per target forward", title="tokens per target forward")
    right.set(ylabel="output tokens/s over the target alone", title="speed-up (batch 1)")
    right.axhline(1.0, color="gray", linewidth=0.8)
    left.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a zoo train output folder")
    parser.add_argument("--drafts", default="", help="NAME=FOLDER,... trained drafts (two or more: also side by side)")
    parser.add_argument("--widths", default="4,8,16", help="tokens proposed a step")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8, help="requests per cell (at least the batch)")
    parser.add_argument("--kv-cache", default="paged", choices=["contiguous", "paged"])
    parser.add_argument("--out", default="results/speculative_trees")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    target = zoo.load(args.target).float().eval()
    store = ResultStore(Path(args.out) / "results.jsonl", KEY)
    table = []
    for batch in map(int, args.batches.split(",")):
        prompts = prompts_for(Path(args.target), max(batch, args.requests), args.prompt_len)
        base = {"target": args.target, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "requests": len(prompts), "kv_cache": args.kv_cache}

        def cell(proposer: str, shape: str, width: int, speculative) -> dict:
            key = {**base, "proposer": proposer, "shape": shape, "width": width}
            if not store.done(key):
                store.append({**key, **run(target, speculative, prompts, args, batch, temperature=0.0)})
                print(proposer, shape, width, batch, {k: store.rows[-1].get(k) for k in
                                                      ("output_tok_s", "tokens_per_forward")}, flush=True)
            return next(r for r in store.rows if all(r.get(f) == v for f, v in key.items()))

        alone = cell("(target alone)", "", 0, None)
        for name, draft in proposers(args).items():
            kind = "two drafts" if isinstance(draft, tuple) else "text" if isinstance(draft, str) else "model"
            for width in map(int, args.widths.split(",")):
                chain = None
                for shape, settings in shapes(width, kind).items():
                    row = cell(name, shape, width, SpeculativeConfig(draft, **settings, chain_fallback=True))
                    chain = chain or row
                    same = sum(a == b for a, b in zip(row["outputs"], alone["outputs"]))
                    table.append({**row, "speedup": row["output_tok_s"] / alone["output_tok_s"],
                                  "vs_chain": row["output_tok_s"] / chain["output_tok_s"], "same": same})
    print(f"target alone: {alone['output_tok_s']:.1f} tok/s at batch {alone['batch']}")
    print("| proposer | shape | width | batch | tokens / forward | out tok/s | vs chain | vs alone | same as alone |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['proposer']} | {r['shape']} | {r['width']} | {r['batch']} | {r['tokens_per_forward']:.2f} | "
              f"{r['output_tok_s']:.1f} | {r['vs_chain']:.2f}× | {r['speedup']:.2f}× | {r['same']}/{r['requests']} |")
    print("chart:", chart([r for r in table if r["batch"] == 1], Path(args.out) / "trees_vs_width.png"))


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
