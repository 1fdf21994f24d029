"""Prefix caching on a shared system prompt: TTFT and throughput with and without it, and the hit rate.

Every request is one `--prefix-len`-token system prompt (shared by all) followed by its own `--suffix-len`-token user
suffix, and asks for `--new-tokens` greedy tokens. All `--requests` arrive at once into an engine of `--max-batch`
slots (paged, block size 16, optimistic admission). Without prefix caching every request prefills the whole prompt;
with it, a request finds the prefix's blocks cached and prefills only its suffix. Cold: the system prompt is new, so
the first step's `--max-batch` admissions all miss (none of it is cached yet). Warm: one earlier request used it (the
steady state of a server whose system prompt is in use); both engines serve that request before the clock starts.
The outputs must be identical.
A model with a recurrent state has prefix caching turned off, with the reason in its row.

Rows (one per architecture and setting) go to OUT/results.jsonl atomically as they finish; a re-run skips them.

    python benchmarks/shared_prefix.py                      # gqa, mla, swa, hybrid, mamba on the small preset
    python benchmarks/shared_prefix.py --archs gqa --requests 16
"""
import argparse
import random
import statistics
import time
from pathlib import Path

import torch

import zoo
from harness import Engine, SamplingParams
from harness.results import ResultStore


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)] for _ in range(args.requests)]


def measure(model, prompts: list[list[int]], prefix_caching: bool, warm: bool, args) -> dict:
    engine = Engine(model, max_batch=args.max_batch, max_seq_len=args.prefix_len + args.suffix_len + args.new_tokens,
                    kv_cache="paged", block_size=16, admission="optimistic", prefix_caching=prefix_caching)
    earlier = prompts[0][: args.prefix_len] + [0] * args.suffix_len if warm else prompts[0][:32]  # else unrelated
    engine.generate([earlier], SamplingParams(max_new_tokens=2, temperature=0.0))  # also the untimed first call
    engine.scheduler.prompt_tokens = engine.scheduler.cached_prompt_tokens = 0
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    ttfts = [o.metrics.ttft * 1e3 for o in outputs]
    return {"prefix_caching": prefix_caching, "seconds": seconds,
            "mean_ttft_ms": statistics.mean(ttfts), "median_ttft_ms": statistics.median(ttfts),
            "request_throughput": len(outputs) / seconds,
            "output_throughput": sum(len(o.token_ids) for o in outputs) / seconds,
            "prefix_cache_hit_rate": engine.prefix_cache_hit_rate, "prefix_caching_off": engine.prefix_caching_off,
            "outputs": [o.token_ids for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="gqa,mla,swa,hybrid,mamba")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/shared_prefix")
    args = parser.parse_args()
    torch.set_num_threads(2)
    store = ResultStore(Path(args.out) / "results.jsonl",
                        ("arch", "preset", "warm", "prefix_caching", "requests", "prefix_len", "suffix_len"))
    print("| arch | prefix | mean TTFT off → on (ms) | TTFT ratio | output tok/s off → on | hit rate | same outputs | "
          "note |")
    print("|---|---|---|---|---|---|---|---|")
    max_seq_len = args.prefix_len + args.suffix_len + args.new_tokens
    for arch in args.archs.split(","):
        torch.manual_seed(0)
        model = zoo.build(arch, preset=args.preset, max_seq_len=max_seq_len).eval()
        prompts = workload(args, model.config.vocab_size)
        for warm in (False, True):
            rows = {}
            for prefix_caching in (False, True):
                key = {"arch": arch, "preset": args.preset, "warm": warm, "prefix_caching": prefix_caching,
                       "requests": args.requests, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len}
                if not store.done(key):
                    store.append({**key, **measure(model, prompts, prefix_caching, warm, args)})
                rows[prefix_caching] = next(r for r in store.rows if all(r[k] == v for k, v in key.items()))
            report(arch, warm, rows[False], rows[True])


def report(arch: str, warm: bool, off: dict, on: dict) -> None:
    print(f"| {arch} | {'warm' if warm else 'cold'} | {off['mean_ttft_ms']:.0f} → {on['mean_ttft_ms']:.0f} | "
          f"{off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}× | {off['output_throughput']:.1f} → "
          f"{on['output_throughput']:.1f} | {on['prefix_cache_hit_rate']:.2f} | {off['outputs'] == on['outputs']} | "
          f"{on['prefix_caching_off'] or ''} |", flush=True)


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
