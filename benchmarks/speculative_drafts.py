"""Which architecture makes the best draft? A trained target decodes held-out text alone and with each draft
(trained checkpoints of any architecture, prompt lookup, the target's own first layers), at each batch size, in the
same run: acceptance rate, tokens per target forward, draft and target time per step, output tokens/s and the
speed-up over the target alone at the same batch. Greedy outputs must equal the target alone's (checked, reported).

Prompts are windows of the validation split of the corpus the target was trained on (the Python standard library
by default: files no model saw in training). Every request decodes exactly --new-tokens tokens (no stop ids).
Rows go to OUT/results.jsonl atomically as they finish; a re-run skips them.

    zoo train --arch gqa --preset small --minutes 20 --out runs/lm/gqa-small       # a target, and drafts:
    zoo train --arch gqa --out runs/lm/gqa-tiny; zoo train --arch mamba --out runs/lm/mamba-tiny
    python benchmarks/speculative_drafts.py --target runs/lm/gqa-small \\
        --drafts gqa-tiny=runs/lm/gqa-tiny,mamba-tiny=runs/lm/mamba-tiny --self-layers 2 --batches 1,8
"""
import argparse
import time
from pathlib import Path

import torch

import zoo
from harness import PROMPT_LOOKUP, Engine, SamplingParams, SpeculativeConfig
from harness.results import ResultStore
from harness.train.corpus import load_corpus, validation_windows
from harness.train.checkpoint import read_train_state

KEY = ("target", "draft", "batch", "k", "prompt_len", "new_tokens", "temperature", "requests", "kv_cache")


def prompts_for(target_dir: Path, count: int, length: int) -> list[list[int]]:
    """Held-out windows of the target's own corpus (its train state names it; else the standard library)."""
    state = read_train_state(target_dir) or {}
    path = state.get("settings", {}).get("corpus")
    corpus = load_corpus(Path(path) if path else None)
    return validation_windows(corpus, count, length).tolist()


def run(target, speculative: SpeculativeConfig | None, prompts, args, batch: int, temperature: float) -> dict:
    """Decode the prompts (args.new_tokens each; args.prompt_len, args.kv_cache) after a warm-up, at this batch:
    seconds, output tokens/s, the outputs and the speculative stats of the timed run."""
    engine = Engine(target, max_batch=batch, max_seq_len=args.prompt_len + args.new_tokens, kv_cache=args.kv_cache,
                    speculative=speculative)
    params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=temperature, seed=i)
              for i in range(len(prompts))]
    engine.generate(prompts[:batch], SamplingParams(max_new_tokens=4, temperature=temperature, seed=0))  # warm-up
    if engine.speculative_stats is not None:
        stats = engine.speculative_stats  # count the timed run alone
        engine.speculator.stats = type(stats)(tree_fallback=stats.tree_fallback)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    row = {"seconds": seconds, "output_tok_s": sum(len(o.token_ids) for o in outputs) / seconds,
           "outputs": [o.token_ids for o in outputs]}
    if engine.speculative_stats is not None:
        row.update(engine.speculative_stats.summary())
    return row


def load_drafts(args, target) -> dict:
    drafts = {PROMPT_LOOKUP: PROMPT_LOOKUP}
    for item in filter(None, args.drafts.split(",")):
        name, _, path = item.partition("=")
        drafts[name] = zoo.load(path)
    for n in filter(None, args.self_layers.split(",")):
        drafts[f"first {n} layers"] = target.first_layers(int(n))
    return drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a zoo train output folder")
    parser.add_argument("--drafts", default="", help="NAME=FOLDER,... trained drafts (prompt lookup is always run)")
    parser.add_argument("--self-layers", default="", help="comma-separated: the target's first N layers as drafts")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per cell = batch x rounds")
    parser.add_argument("--temperatures", default="0", help="0 = greedy")
    parser.add_argument("--kv-cache", default="paged", choices=["contiguous", "paged"])
    parser.add_argument("--out", default="results/speculative_drafts")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = zoo.load(args.target)
    drafts = load_drafts(args, target)
    store = ResultStore(Path(args.out) / "results.jsonl", KEY)
    print(f"target {args.target} ({target.config.name}, {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M "
          f"params), k={args.k}, prompts {args.prompt_len} held-out bytes, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print("| draft | batch | T | acceptance | tokens / target forward | draft / target ms per step | out tok/s | "
          "speed-up | same as alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        prompts = prompts_for(Path(args.target), batch * args.rounds, args.prompt_len)
        for temperature in map(float, args.temperatures.split(",")):
            cells = {}
            for name, draft in {"(target alone)": None, **drafts}.items():
                key = {"target": args.target, "draft": name, "batch": batch, "k": args.k, "prompt_len": args.prompt_len,
                       "new_tokens": args.new_tokens, "temperature": temperature, "requests": len(prompts),
                       "kv_cache": args.kv_cache}
                if not store.done(key):
                    speculative = None if draft is None else SpeculativeConfig(draft, num_speculative_tokens=args.k)
                    store.append({**key, **run(target, speculative, prompts, args, batch, temperature)})
                cells[name] = next(r for r in store.rows if all(r[f] == v for f, v in key.items()))
            alone = cells.pop("(target alone)")
            print(f"| target alone | {batch} | {temperature:g} | | 1 | | {alone['output_tok_s']:.1f} | 1.00× | |")
            for name, row in cells.items():
                same = sum(a == b for a, b in zip(row["outputs"], alone["outputs"]))
                print(f"| {name} | {batch} | {temperature:g} | {row['acceptance_rate']:.2f} | "
                      f"{row['tokens_per_forward']:.2f} | {row['draft_ms_per_step']:.1f} / {row['target_ms_per_step']:.1f}"
                      f" | {row['output_tok_s']:.1f} | {row['output_tok_s'] / alone['output_tok_s']:.2f}× | "
                      f"{same}/{len(prompts) if temperature == 0 else '-'} |", flush=True)


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
