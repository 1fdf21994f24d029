"""Does evicting by score make decode cheaper? The decode step of `mha` (small preset, bf16) at batch 16 and context
4096, with the cache full and with H2O and TOVA keeping 1/2, 1/4, 1/8 and 1/16 of it, caches filled as if
prefilled (harness/decode_probe.py), median of 7 steps after one untimed. An evicting step reads only the kept rows
but also scores them (the query's weights recomputed over the kept keys) and picks the one that leaves.

    python benchmarks/kv_eviction_decode.py [--arch mha] [--batch 16] [--context 4096] [--kv-cache contiguous]
"""
import argparse

import torch

import zoo
from harness.decode_probe import decode_probe

FRACTIONS = (1 / 2, 1 / 4, 1 / 8, 1 / 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="mha")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--kv-cache", default="contiguous", choices=("contiguous", "paged"))
    parser.add_argument("--policies", default="h2o,tova")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = zoo.build(args.arch, preset=args.preset).to(torch.bfloat16).eval()
    full = decode_probe(model, args.batch, args.context, args.kv_cache).median_step()
    print(f"{args.arch} {args.preset} bf16, batch {args.batch}, context {args.context}, {args.kv_cache}, "
          f"{torch.get_num_threads()} threads")
    print(f"| cache | kept tokens | step (ms) | vs full |\n|---|---|---|---|\n| full | {args.context} | "
          f"{1000 * full:.1f} | 1.00 |", flush=True)
    for policy in args.policies.split(","):
        for fraction in FRACTIONS:
            budget = round(args.context * fraction)
            evicted = zoo.evict(model, policy=policy, budget=budget)
            step = decode_probe(evicted, args.batch, args.context, args.kv_cache).median_step()
            print(f"| {policy} 1/{round(1 / fraction)} | {budget} | {1000 * step:.1f} | {step / full:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
