"""Sequences a 2 GiB cache budget holds at context 4096, bf16 cache against int8 (a scale per token and KV head; two
per MLA latent row, for the latent and its rotary part), for every architecture with a per-token cache, at the
small preset in bf16: analytic (budget // bytes a sequence holds) and as the engine sizes it
(harness.engine.cache_pool.size_cache: the contiguous rows it would allocate, and the paged blocks per group it
splits the budget into). Arithmetic only: nothing is allocated.

    python benchmarks/kv_int8_capacity.py
"""
import argparse

import torch

import zoo
from harness.engine.cache_pool import size_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    print(f"{args.preset} preset, bf16, context {args.context}, budget {args.budget_gib:g} GiB\n")
    print("| arch | bf16 KiB / seq | int8 KiB / seq | max batch bf16 → int8 (analytic) | engine contiguous | ratio | "
          "ratio if scales were free |")
    print("|---|---:|---:|---|---|---:|---:|")
    for arch in (a for a in zoo.architectures() if zoo.is_causal(a)):
        with torch.device("meta"):
            model = zoo.build(arch, preset=args.preset, max_seq_len=args.context).to(torch.bfloat16)
        specs = model.cache_specs()
        if not any(spec.elements_per_token for spec in specs):
            continue
        seq = {f: zoo.cache_bytes(model, args.context, kv_format=f) for f in ("auto", "int8")}
        analytic = {f: budget // b for f, b in seq.items()}
        engine = {f: size_cache(specs, torch.bfloat16, "contiguous", 10**6, args.context, 16, None, budget, 1, f)[0]
                  for f in seq}
        # with free scales a token's int8 bytes would be half its bf16 bytes (states do not shrink)
        states = sum(spec.state_bytes(torch.bfloat16) for spec in specs)
        free = budget // ((seq["auto"] - states) // 2 + states)
        print(f"| {arch} | {seq['auto'] / 1024:.0f} | {seq['int8'] / 1024:.0f} | {analytic['auto']} → "
              f"{analytic['int8']} | {engine['auto']} → {engine['int8']} | "
              f"{analytic['int8'] / analytic['auto']:.2f}× | {free / analytic['auto']:.2f}× |")


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
