"""How many requests of a given context fit a fixed cache budget, per architecture, and how fast they decode.

The `base` size (12 layers, d_model 768, 12 query heads), one cache budget (default 2 GiB) and one context
(default 4096). For each architecture:

- predicted max batch = budget // analytic cache bytes of one request (zoo.cache_bytes at context + new tokens);
- measured max batch, contiguous = the rows the Engine allocates under the budget; paged = how many such requests
  the scheduler admits at once from a pool sized by the same budget;
- decode tok/s at the contiguous max batch, against the roofline prediction batch / max(bytes / bandwidth,
  FLOPs / matmul rate): bytes = weights + cache read (a shared CLA cache counted once per layer that reads it),
  FLOPs = 2 x parameters x batch + attention (q.k and p.v over the keys each layer sees), with the copy bandwidth
  and a large matmul's rate measured in the same run. On a CPU the large batches are compute-bound, and MLA's
  absorbed decode does H x (rank + rope + rank) multiply-adds per key: its cache is small, its attention is not.

Decode starts from a full-length cache without running the prefill (batch x 4096 tokens of prefill would take
hours on a CPU); a decode step's cost does not depend on the cached values, only on how many there are.

    python benchmarks/kv_family.py                                  # all KV-family architectures, bf16
    python benchmarks/kv_family.py --archs gqa,mla --budget-gib 1 --context 2048 --steps 3
"""
import argparse
import statistics
import time

import torch

import zoo
from cache import specs_read
from harness import Engine, SamplingParams
from harness.metrics import measure_copy_bandwidth

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ARCHS = "mha,gqa,mqa,mla,cla,swa,hybrid-1in6,hybrid-3to1"


def admitted_at_once(model, budget: int, context: int, new_tokens: int, kv_cache: str, offered: int) -> Engine:
    """An engine under `budget` offered `offered` requests, with all it can hold admitted and its cache treated as
    holding `context` tokens."""
    max_seq_len = context + new_tokens
    engine = Engine(model, max_batch=offered, max_seq_len=max_seq_len, kv_cache=kv_cache, cache_budget_bytes=budget)
    prompt = [0] * context
    for _ in range(min(offered, engine.max_batch)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    engine.admit_prefilled()  # decode reads `context` cached tokens
    return engine


def attention_flops(model, keys: int) -> int:
    """FLOPs of one sequence's decode-step attention: q.k over each key's key width, p.v over its value width."""
    return sum(2 * block.mixer.n_heads * (read.head_dim + read.value_dim) * read.retention.keys_seen(keys)
               for block, read in zip(model.blocks, specs_read(model.cache_specs())))


def measure_matmul_flops(dtype, size: int = 2048) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * size**3 / (time.perf_counter() - start)


def decode_tok_s(engine: Engine, steps: int) -> float:
    running = list(engine.scheduler.running)
    engine.runner.decode(running)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.runner.decode(running)
        times.append(time.perf_counter() - start)
    return len(running) / statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=ARCHS)
    p.add_argument("--preset", default="base")
    p.add_argument("--budget-gib", type=float, default=2.0)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="timed decode steps per architecture (median)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    args = p.parse_args(argv)
    budget, new_tokens = int(args.budget_gib * 2**30), args.steps + 2
    bandwidth = measure_copy_bandwidth("cpu", nbytes=1 << 28)
    flops = measure_matmul_flops(DTYPES[args.dtype])
    print(f"budget {args.budget_gib} GiB, context {args.context}, {args.preset}, {args.dtype}, copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s, torch threads {torch.get_num_threads()}")
    print("| arch | cache/request MiB | predicted max batch | contiguous | paged | decode tok/s | "
          "memory-bound tok/s | compute-bound tok/s | measured/predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        torch.manual_seed(0)
        model = zoo.build(arch, preset=args.preset).to(DTYPES[args.dtype]).eval()
        per_request = zoo.cache_bytes(model, seq_len=args.context + new_tokens)
        predicted = budget // per_request
        offered = 2 * predicted + 8  # more than fit, so the budget is what stops admission
        paged = len(admitted_at_once(model, budget, args.context, new_tokens, "paged", offered).scheduler.running)
        engine = admitted_at_once(model, budget, args.context, new_tokens, "contiguous", offered)
        batch = len(engine.scheduler.running)
        rate = decode_tok_s(engine, args.steps)
        step_bytes = zoo.decode_weight_bytes(model) + zoo.cache_read_bytes(model, seq_len=args.context, batch=batch)
        step_flops = batch * (2 * sum(p.numel() for p in model.parameters()) + attention_flops(model, args.context))
        memory_bound, compute_bound = batch / (step_bytes / bandwidth), batch / (step_flops / flops)
        print(f"| {arch} | {per_request / 2**20:.1f} | {predicted} | {batch} | {paged} | {rate:.1f} | {memory_bound:.0f} | "
              f"{compute_bound:.0f} | {rate / min(memory_bound, compute_bound):.2f} |", flush=True)
        del engine, model


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
