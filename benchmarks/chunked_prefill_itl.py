"""Chunked prefill under a mixed load: long prompts arriving while other requests decode. Whole-prompt prefill runs a
long prompt in one step, and every running decode waits for it (an inter-token-latency spike); a token budget per
step (Engine(max_num_batched_tokens=...)) splits it into chunks beside the decodes (Sarathi-Serve).

`--decoders` requests with `--short-len`-token prompts decode `--decode-tokens` greedy tokens each. Meanwhile
`--long-prompts` requests of `--long-len` tokens (and `--long-new-tokens` outputs) arrive, one every `--gap` engine
steps. The same requests, at the same steps, for each budget; the outputs must be identical. Reported: the decoders'
ITL p50 / p99 (ms), the long prompts' mean TTFT, and throughput in tokens (prompt + output) per second.

Rows (one per architecture and budget) go to OUT/results.jsonl atomically as they finish; a re-run skips them.

    python benchmarks/chunked_prefill_itl.py                     # gqa, mla, mamba on the small preset
    python benchmarks/chunked_prefill_itl.py --archs gqa --budgets 0,128
"""
import argparse
import random
import statistics
import time
from pathlib import Path

import torch

import zoo
from harness import Engine, SamplingParams
from harness.metrics import percentile
from harness.results import ResultStore


def measure(model, args, budget: int | None) -> dict:
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    short = [[rng.randrange(vocab) for _ in range(args.short_len)] for _ in range(args.decoders)]
    long = [[rng.randrange(vocab) for _ in range(args.long_len)] for _ in range(args.long_prompts)]
    engine = Engine(model, max_batch=args.decoders + args.long_prompts, max_seq_len=args.long_len + args.long_new_tokens,
                    kv_cache="paged", block_size=16, max_num_batched_tokens=budget)
    engine.generate([short[0]], SamplingParams(max_new_tokens=2, temperature=0.0))  # the untimed first call
    decoders = {engine.add_request(p, SamplingParams(max_new_tokens=args.decode_tokens, temperature=0.0)) for p in short}
    arrivals = {(i + 1) * args.gap: p for i, p in enumerate(long)}
    outputs, step, start = {}, 0, time.perf_counter()
    while engine.has_unfinished() or arrivals:
        if step in arrivals:
            engine.add_request(arrivals.pop(step), SamplingParams(max_new_tokens=args.long_new_tokens, temperature=0.0))
        outputs.update((out.request_id, out) for out in engine.step())
        step += 1
    seconds = time.perf_counter() - start
    itl = [gap * 1e3 for i in decoders for gap in outputs[i].metrics.itl]
    tokens = sum(len(o.prompt_ids) + len(o.token_ids) for i, o in outputs.items() if i)  # less the warm-up
    return {"steps": step, "seconds": seconds, "median_itl_ms": percentile(itl, 50), "p99_itl_ms": percentile(itl, 99),
            "max_itl_ms": max(itl),
            "long_mean_ttft_ms": statistics.mean(outputs[i].metrics.ttft * 1e3 for i in outputs if i and i not in decoders),
            "total_token_throughput": tokens / seconds,
            "outputs": [outputs[i].token_ids for i in sorted(outputs) if i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="gqa,mla,mamba")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--budgets", default="0,768,512,256", help="tokens per step; 0 = whole-prompt prefill")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--short-len", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--long-new-tokens", type=int, default=4)
    parser.add_argument("--gap", type=int, default=16, help="engine steps between long-prompt arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/chunked_prefill_itl")
    args = parser.parse_args()
    torch.set_num_threads(2)
    store = ResultStore(Path(args.out) / "results.jsonl", ("arch", "preset", "budget", "long_len", "gap"))
    print("| arch | budget | ITL p50 / p99 / max (ms) | long-prompt TTFT (ms) | tokens/s | vs whole | same outputs |")
    print("|---|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        torch.manual_seed(0)
        model = zoo.build(arch, preset=args.preset, max_seq_len=args.long_len + args.long_new_tokens).eval()
        rows = []
        for budget in (int(b) for b in args.budgets.split(",")):
            key = {"arch": arch, "preset": args.preset, "budget": budget, "long_len": args.long_len, "gap": args.gap}
            if not store.done(key):
                store.append({**key, **measure(model, args, budget or None)})
            rows.append(next(r for r in store.rows if all(r[k] == v for k, v in key.items())))
        for row in rows:
            print(f"| {arch} | {row['budget'] or 'whole'} | {row['median_itl_ms']:.0f} / {row['p99_itl_ms']:.0f} / "
                  f"{row['max_itl_ms']:.0f} | {row['long_mean_ttft_ms']:.0f} | {row['total_token_throughput']:.0f} | "
                  f"{row['total_token_throughput'] / rows[0]['total_token_throughput']:.2f}× | "
                  f"{row['outputs'] == rows[0]['outputs']} |", flush=True)


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
