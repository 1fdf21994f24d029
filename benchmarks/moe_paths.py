"""An MoE layer's FFN paths on the CPU at decode sizes, timed interleaved in one process (median of --reps):

- dense: every expert on every token, weighted by the router (zero off a token's top_k): fixed shapes with no
  routing in them, at n_experts / top_k times the routed work (the one-graph MoE a newcomer wrote);
- grouped: tokens sorted by expert, each routed expert's rows multiplied once (zoo/ffn/moe.py, eager steps);
- gathered: each (token, expert) pair's weights gathered from the stacked experts, batched matrix-vector products
  (zoo/ffn/moe.py, compiled and graph-captured steps).
Each path's output is checked against the dense one before it is timed.

    python benchmarks/moe_paths.py                 # the small preset's widths: d_model 512, 8 experts of 1408, top 2
    python benchmarks/moe_paths.py --tokens 1,4,16 --experts 8 --top-k 2 --d-model 1024 --expert-hidden 2816
"""
import argparse
import statistics
import time

import torch

from roofline import ints  # the same comma-separated integer axis
from zoo.ffn.moe import MoE


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=ints, default=[1, 4, 16], help="tokens per step (default: 1,4,16)")
    p.add_argument("--experts", type=int, default=8, help="routed experts (default: 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2)")
    p.add_argument("--d-model", type=int, default=512, help="default: 512 (the small preset's)")
    p.add_argument("--expert-hidden", type=int, default=1408, help="default: 1408 (the small preset's mlp_hidden)")
    p.add_argument("--reps", type=int, default=50, help="timed calls per path and token count (default: 50)")
    return p


def dense(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the router's top_k weights (zero elsewhere)."""
    ids, weights = moe.route(x)
    full = torch.zeros(x.shape[0], moe.n_experts, dtype=x.dtype).scatter(1, ids, weights.to(x.dtype))
    out = torch.zeros_like(x)
    for e in range(moe.n_experts):
        out += full[:, e:e + 1] * moe.experts.expert(e, x)
    return out


def paths(moe: MoE) -> dict:
    return {"dense": lambda x: dense(moe, x), "grouped": lambda x: moe.grouped(x, *moe.route(x)),
            "gathered": lambda x: moe.gathered(x, *moe.route(x))}


@torch.inference_mode()
def measure(moe: MoE, tokens: int, reps: int) -> dict[str, float]:
    """Median milliseconds per path, the paths called in turn so a neighbour's load falls on all alike."""
    x = torch.randn(tokens, moe.d_model)
    calls = paths(moe)
    want = calls["dense"](x)
    for name, call in calls.items():
        err = (call(x) - want).abs().max().item()
        if err > 1e-4:
            raise SystemExit(f"{name} differs from the dense path by {err:.3g} at {tokens} tokens")
        call(x)  # warm
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            call(x)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    moe = MoE(args.d_model, args.expert_hidden, n_experts=args.experts, top_k=args.top_k).eval()
    print(f"MoE FFN, {args.experts} experts x {args.d_model} -> {args.expert_hidden}, top {args.top_k}, fp32, "
          f"{torch.get_num_threads()} threads, median of {args.reps}\n")
    print("| tokens | dense ms | grouped ms | gathered ms | dense / grouped | dense / gathered |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        ms = measure(moe, tokens, args.reps)
        print(f"| {tokens} | {ms['dense']:.3f} | {ms['grouped']:.3f} | {ms['gathered']:.3f} | "
              f"{ms['dense'] / ms['grouped']:.2f}x | {ms['dense'] / ms['gathered']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
