"""Does evicting by score make decode cheaper? The decode step of `mha` (small preset, bf16) at batch 16 and context
4096, with the cache full and with H2O and TOVA keeping 1/2, 1/4, 1/8 and 1/16 of it, caches filled as if
prefilled (harness/decode_probe.py), median of 7 steps after one untimed. An evicting step reads only the kept rows
but also scores them (the query's weights recomputed over the kept keys) and picks the one that leaves. The floor:
the step's weight and cache bytes over the machine's read rate past any cache (harness/roofline.py), measured at
the start and again at the end (a difference means the machine was shared, and the figures are noise).

    python benchmarks/kv_eviction_decode.py [--arch mha] [--batch 16] [--context 4096] [--kv-cache contiguous]
"""
import argparse

import torch

import zoo
from harness import roofline
from harness.decode_probe import decode_probe

FRACTIONS = (1 / 2, 1 / 4, 1 / 8, 1 / 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="mha")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--kv-cache", default="contiguous", choices=("contiguous", "paged"))
    parser.add_argument("--policies", default="h2o,tova,snapkv")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = zoo.build(args.arch, preset=args.preset).to(torch.bfloat16).eval()
    rate = roofline.measure_read_rate()

    def floor_ms(m) -> float:  # weights once, and each sequence's cache as a decode query reads it
        return 1000 * (zoo.decode_weight_bytes(m) + args.batch * zoo.cache_read_bytes(m, args.context)) / rate

    full = decode_probe(model, args.batch, args.context, args.kv_cache).median_step()
    print(f"{args.arch} {args.preset} bf16, batch {args.batch}, context {args.context}, {args.kv_cache}, "
          f"{torch.get_num_threads()} threads, read rate {rate / 1e9:.1f} GB/s")
    print(f"| cache | kept tokens | step (ms) | floor (ms) | x floor | vs full |\n|---|---:|---:|---:|---:|---:|\n"
          f"| full | {args.context} | {1000 * full:.1f} | {floor_ms(model):.1f} | {1000 * full / floor_ms(model):.1f} "
          f"| 1.00 |", flush=True)
    for policy in args.policies.split(","):
        for fraction in FRACTIONS:
            budget = round(args.context * fraction)
            evicted = zoo.evict(model, policy=policy, budget=budget)
            step = decode_probe(evicted, args.batch, args.context, args.kv_cache).median_step()
            print(f"| {policy} 1/{round(1 / fraction)} | {budget} | {1000 * step:.1f} | {floor_ms(evicted):.1f} | "
                  f"{1000 * step / floor_ms(evicted):.1f} | {step / full:.2f} |", flush=True)
    print(roofline.disturbance(rate, roofline.measure_read_rate()))


if __name__ == "__main__":
    main()
