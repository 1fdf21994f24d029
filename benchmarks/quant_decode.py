"""Decode with quantized weights: the `base` GQA model (125M params) at batch 1, the engine in bf16, int8 and int4
weights (round to nearest), all compiled, beside transformers' bf16 `generate` on the same weights, in one run. Each
scheme runs twice: with the vocabulary head kept in bf16 (QuantizeConfig's default) and quantized too, as gpt-fast
quantizes every linear layer for its int8 / int4 figures; at `base` size the 32000 x 768 head is a quarter of the
bf16 weights, so which one is meant changes the speed-up a lot.

Decode rate = batch * (N - 1) / (time(N new tokens) - time(1 new token)) for every side (prefill excluded alike);
each figure is the median of --repeats runs, the sides alternating. MBU counts the bytes each side's step must read:
its weights as stored (int8: 1 byte a weight + a scale per row; int4: half a byte + a scale and zero per group) and
the KV cache, over the machine's measured memory read rate (harness/roofline.py). The bare weight matmuls of one step are timed too (the
floor the quantized kernels can reach on this machine).

    python benchmarks/quant_decode.py
    python benchmarks/quant_decode.py --schemes int8,int4 --group-size 64 --repeats 5 --no-compile
    python benchmarks/quant_decode.py --dtype fp32       # fp32 activations: archzoo's C GEMV, not torch's packed ops
"""
import argparse
import statistics
import time

import torch

import harness
import zoo
from decode_vs_hf import decode_rate, hf_twin, read_rate
from hf_agreement import time_hf, time_zoo
from zoo.quantize import QuantizedLinear


def bare_matmuls_s(model, repeats: int = 20) -> float:
    """One decode step's weight matmuls alone (batch 1), as the model's layers run them: the floor of the step."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    dtype = next(model.parameters()).dtype
    inputs = [torch.randn(1, m.in_features).to(dtype) for m in layers]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer(x)  # archzoo's Linear and QuantizedLinear: their CPU decode paths
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", default="int8,int4")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--heads", default="kept,quantized", help="the vocabulary head: kept in bf16, quantized, or both")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the model's (and transformers') dtype")
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = zoo.build("gqa", preset="base").to(dtype).eval()
    hf = hf_twin(model).to(dtype)
    peak = read_rate("cpu")  # MBU against the machine's memory read rate (harness/roofline.py)
    prompts = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    models = {args.dtype: model}
    for scheme in args.schemes.split(","):
        for head in args.heads.split(","):
            name = scheme if head == "kept" else f"{scheme} + head"
            models[name] = zoo.quantize(model, zoo.QuantizeConfig(scheme, group_size=args.group_size,
                                                                   head=head == "quantized"))
    engines = {name: harness.Engine(m, max_batch=1, max_seq_len=args.prompt_len + args.new_tokens,
                                    compile=not args.no_compile) for name, m in models.items()}
    time_hf(hf, prompts, 4)
    for engine in engines.values():
        time_zoo(engine, prompts, 4)  # warm-up and compile outside the timed runs
    hf_name = f"transformers {args.dtype}"
    rates = {name: [] for name in [hf_name, *engines]}
    for _ in range(args.repeats):
        decode_rate(lambda q, n: time_hf(hf, q, n), prompts, args.new_tokens, rates[hf_name])
        for name, engine in engines.items():
            decode_rate(lambda q, n, e=engine: time_zoo(e, q, n), prompts, args.new_tokens, rates[name])
    print(f"machine: {torch.get_num_threads()} threads, read rate {peak / 1e9:.1f} GB/s; gqa/base, prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens, batch 1, greedy, compile={not args.no_compile}, int4 group "
          f"{args.group_size}\n")
    print(f"| weights | tok/s | vs engine {args.dtype} | vs transformers {args.dtype} | weight MB read / step | MBU | "
          "bare matmuls (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    median = {name: statistics.median(r) for name, r in rates.items()}
    kv = zoo.cache_bytes(model, seq_len=args.prompt_len + args.new_tokens // 2)
    hf_rate = median.pop(hf_name)
    print(f"| {hf_name} | {hf_rate:.1f} | {hf_rate / median[args.dtype]:.2f}x | 1.00x | | | |")
    for name, rate in median.items():
        weights = zoo.decode_weight_bytes(models[name])
        mbu = harness.metrics.mbu(weights, kv, 1 / rate, peak)
        print(f"| engine {name} | {rate:.1f} | {rate / median[args.dtype]:.2f}x | {rate / hf_rate:.2f}x | "
              f"{weights / 1e6:.1f} | {mbu:.0%} | {1000 * bare_matmuls_s(models[name]):.2f} |", flush=True)


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
