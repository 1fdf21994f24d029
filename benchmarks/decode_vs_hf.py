"""archzoo Engine vs transformers `generate` on the same weights: decode tokens/s, their ratio, and MBU.

The `base` GQA model (12 layers, d_model 768, 12 query / 4 KV heads, vocab 32000), greedy, random prompt.
Decode rate for both sides = batch * (N - 1) / (time(N new tokens) - time(1 new token)), so prefill is excluded
the same way for both. Runs alternate between the two sides; each figure is the median of --repeats runs.

    python benchmarks/decode_vs_hf.py                      # bf16 and fp32, batch 1 and 16
    python benchmarks/decode_vs_hf.py --dtypes bfloat16 --batches 1 --repeats 5
"""
import argparse
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import zoo
from hf_agreement import agreement, time_hf, time_zoo
from zoo.hf import copy_weights_to_hf

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def hf_twin(model) -> LlamaForCausalLM:
    c = model.config
    attn = c.layers[0].params
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp_hidden,
                      num_hidden_layers=c.n_layers, num_attention_heads=attn["n_heads"], num_key_value_heads=attn["n_kv_heads"],
                      max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                      rope_theta=c.rope_base)
    hf = LlamaForCausalLM(cfg)
    copy_weights_to_hf(model, hf)
    return hf.eval()


def decode_rate(timer, prompts, new_tokens, rates: list) -> None:
    t_full = timer(prompts, new_tokens)
    t_prefill = timer(prompts, 1)
    rates.append(prompts.shape[0] * (new_tokens - 1) / (t_full - t_prefill))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache", default="contiguous", choices=["contiguous", "paged"])
    p.add_argument("--no-compile", action="store_true", help="run archzoo's decode step eagerly")
    args = p.parse_args()

    torch.manual_seed(0)
    base = zoo.build("gqa", preset="base")
    peak = harness.measure_copy_bandwidth("cpu")
    print(f"machine: {torch.get_num_threads()} threads; peak copy bandwidth {peak / 1e9:.1f} GB/s (read+write)")
    print(f"model: gqa/base, {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy, kv_cache={args.kv_cache}, compile={not args.no_compile}\n")
    print("| dtype | batch | transformers tok/s | archzoo tok/s | ratio | archzoo MBU | greedy tokens vs transformers |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for dtype_name in args.dtypes.split(","):
        model = zoo.build("gqa", preset="base")
        model.load_state_dict(base.state_dict())
        model = model.to(DTYPES[dtype_name]).eval()
        hf = hf_twin(model).to(DTYPES[dtype_name])
        for batch in map(int, args.batches.split(",")):
            prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
            engine = harness.Engine(model, max_batch=batch, max_seq_len=args.prompt_len + args.new_tokens,
                                    kv_cache=args.kv_cache, compile=not args.no_compile)
            time_zoo(engine, prompts, 4)  # warm-up (and compile) outside the timed runs
            time_hf(hf, prompts, 4)
            hf_rates, zoo_rates = [], []
            for _ in range(args.repeats):
                decode_rate(lambda p, n: time_hf(hf, p, n), prompts, args.new_tokens, hf_rates)
                decode_rate(lambda p, n: time_zoo(engine, p, n), prompts, args.new_tokens, zoo_rates)
            hf_rate, zoo_rate = statistics.median(hf_rates), statistics.median(zoo_rates)
            tpot = batch / zoo_rate
            kv_mean = zoo.cache_bytes(model, seq_len=args.prompt_len + args.new_tokens // 2, batch=batch)
            mbu = harness.metrics.mbu(zoo.decode_weight_bytes(model), kv_mean, tpot, peak)
            tokens = agreement(hf, engine, prompts, args.new_tokens)  # untimed: logits kept for the top-5 check
            print(f"| {dtype_name} | {batch} | {hf_rate:.1f} | {zoo_rate:.1f} | {zoo_rate / hf_rate:.2f}x | {mbu:.0%} | {tokens} |",
                  flush=True)


if __name__ == "__main__":
    main()
