"""Constant-state mixers against attention: per-token decode latency as the context grows, and Mamba decode
against transformers' MambaForCausalLM `generate` on the same weights.

Part 1 (`base` size, batch 1): one request whose cache holds `context` tokens, median time of a decode step,
for contexts 512 -> 16384. The cache is filled by position bookkeeping, not by a prefill (a step's cost does
not depend on the cached values; a recurrent state has the same size at any context).

Part 2: a random HF MambaForCausalLM (mamba-130m's shape: d_model 768, 24 layers, no MLP, vocab 32000),
converted with zoo.from_hf; decode tokens/s of HF `generate` and of archzoo's Engine (compiled decode step)
at batch 1 and 16, decode rate = batch x (N - 1) / (time(N new tokens) - time(1 new token)), median of runs
that alternate between the two sides. Greedy tokens are compared by vLLM's rule (identical, or each side's
token in the other's top-5 where they first diverge), always on fp32 twins of the two models.

    python benchmarks/state_family.py
    python benchmarks/state_family.py --archs gqa,mamba --contexts 512,4096 --skip-hf
"""
import argparse
import statistics
import time

import torch

import zoo
from harness import Engine, SamplingParams
from hf_agreement import agreement, time_hf, time_zoo

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def decoding_engine(model, context: int, steps: int) -> Engine:
    """One request whose cache holds `context` tokens, admitted and ready to decode."""
    engine = Engine(model, max_batch=1, max_seq_len=context + steps + 2)
    engine.add_request([0] * context, SamplingParams(max_new_tokens=steps + 2, temperature=0.0))
    engine.admit_prefilled()
    return engine


def latency_table(args) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"\nPer-token decode latency (ms), batch 1, {args.preset}, {args.dtype}, median of {args.steps} steps "
          f"taken round-robin over the contexts (so drift on a shared machine hits all of them alike)")
    print("| arch | " + " | ".join(str(c) for c in contexts) + f" | {contexts[-1]} / {contexts[0]} |")
    print("|---|" + "---:|" * (len(contexts) + 1))
    for arch in args.archs.split(","):
        torch.manual_seed(0)
        model = zoo.build(arch, preset=args.preset, max_seq_len=max(contexts) + args.steps + 2).to(DTYPES[args.dtype]).eval()
        engines = [decoding_engine(model, c, args.steps) for c in contexts]
        times = [[] for _ in contexts]
        for engine in engines:
            engine.runner.decode(list(engine.scheduler.running))  # warm-up
        for _ in range(args.steps):
            for engine, spent in zip(engines, times):
                running = list(engine.scheduler.running)
                start = time.perf_counter()
                engine.runner.decode(running)
                spent.append(time.perf_counter() - start)
        ms = [1000 * statistics.median(t) for t in times]
        print(f"| {arch} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ms[-1] / ms[0]:.2f}x |", flush=True)


def hf_mamba(dtype: torch.dtype):
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=32000, hidden_size=768, num_hidden_layers=24, state_size=16, expand=2,
                         use_bias=False, use_conv_bias=True, tie_word_embeddings=True)
    torch.manual_seed(0)
    return MambaForCausalLM(config).to(dtype).eval()


def versus_hf(args) -> None:
    hf = hf_mamba(DTYPES[args.hf_dtype])
    model = zoo.from_hf(hf).eval()
    # tokens are checked on fp32 twins: this random 24-layer model's bf16 logits drift from its fp32 ones by up to
    # ~10 in both implementations, so a bf16 token comparison would measure rounding, not correctness
    hf32 = hf if args.hf_dtype == "float32" else hf_mamba(torch.float32)
    model32 = model if args.hf_dtype == "float32" else zoo.from_hf(hf32).eval()
    n = args.new_tokens
    print(f"\nMamba decode vs transformers generate: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{args.hf_dtype}, prompt {args.prompt_len}, {n} new tokens, compile={not args.no_compile}")
    print("| batch | transformers tok/s | archzoo tok/s | ratio | greedy tokens |")
    print("|---:|---:|---:|---:|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = torch.randint(0, 32000, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        engine = Engine(model, max_batch=batch, max_seq_len=args.prompt_len + n, compile=not args.no_compile)
        time_zoo(engine, prompts, 2)  # compile and warm up outside the timed runs
        rates = {"hf": [], "zoo": []}
        for _ in range(args.repeats):
            for side, timer in (("hf", lambda p, k: time_hf(hf, p, k)), ("zoo", lambda p, k: time_zoo(engine, p, k))):
                rates[side].append(batch * (n - 1) / (timer(prompts, n) - timer(prompts, 1)))
        hf_rate, zoo_rate = statistics.median(rates["hf"]), statistics.median(rates["zoo"])
        check = agreement(hf32, Engine(model32, max_batch=batch, max_seq_len=args.prompt_len + n), prompts, n)
        print(f"| {batch} | {hf_rate:.1f} | {zoo_rate:.1f} | {zoo_rate / hf_rate:.2f}x | {check} (fp32) |", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="gqa,linear,mamba,mamba2")
    p.add_argument("--preset", default="base")
    p.add_argument("--contexts", default="512,2048,8192,16384")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--skip-hf", action="store_true", help="only the latency table")
    p.add_argument("--hf-dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    print(f"torch threads {torch.get_num_threads()}")
    latency_table(args)
    if not args.skip_hf:
        versus_hf(args)


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
