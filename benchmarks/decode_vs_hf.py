"""archzoo Engine vs transformers `generate` on the same weights: decode tokens/s, their ratio, and MBU.

The `base` GQA model (12 layers, d_model 768, 12 query / 4 KV heads, vocab 32000) against its Llama twin, or
--archs mamba: the `base` Mamba (no MLP) against its MambaForCausalLM twin; greedy, random prompt.
Decode rate for both sides = batch * (N - 1) / (time(N new tokens) - time(1 new token)), so prefill is excluded
the same way for both. Runs alternate between the two sides; each figure is the median of --repeats runs.
measure_batch() is the one cell as a row of data (benchmarks/gpu_check.py calls it).

    python benchmarks/decode_vs_hf.py                      # bf16 and fp32, batch 1 and 16
    python benchmarks/decode_vs_hf.py --dtypes bfloat16 --batches 1 --repeats 5
    python benchmarks/decode_vs_hf.py --archs gqa,mamba --device cuda --no-compile   # CUDA graphs, not compile
"""
import argparse
import statistics
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

import harness
import zoo
from harness import roofline
from hf_agreement import agreement, time_hf, time_zoo
from zoo.hf import copy_weights_to_hf

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class HfRun:
    """How one comparison cell runs: prompt and decode lengths, repeats, and the engine's options."""

    prompt_len: int = 512
    new_tokens: int = 128
    repeats: int = 3
    kv_cache: str = "contiguous"
    compile: bool = True
    device: str = "cpu"


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


def mamba_twin(model) -> MambaForCausalLM:
    """HF's Mamba with a registry Mamba's shape (blocks without MLPs, dt_rank left to both sides' default)."""
    c, mixer = model.config, model.blocks[0].mixer
    cfg = MambaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                      state_size=mixer.d_state, conv_kernel=mixer.d_conv, expand=mixer.d_inner // c.d_model,
                      layer_norm_epsilon=c.norm_eps, tie_word_embeddings=c.tie_embeddings, use_bias=False,
                      use_conv_bias=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    hf = MambaForCausalLM(cfg)
    copy_weights_to_hf(model, hf)
    return hf.eval()


# arch -> (registry overrides that give HF's layout, the HF twin)
TWINS = {"gqa": ({}, hf_twin), "mamba": ({"mlp": "none"}, mamba_twin)}


def build_pair(arch: str, preset: str, dtype: torch.dtype, device: str):
    """(zoo model, HF twin with the same weights), both in `dtype` on `device`; the same weights for every dtype."""
    overrides, twin = TWINS[arch]
    torch.manual_seed(0)
    model = zoo.build(arch, preset=preset, **overrides).eval()
    hf = twin(model)
    return model.to(device, dtype), hf.to(device, dtype)


# Untimed tokens a side decodes just before its timed runs: its weights back in the caches whoever ran before. On a
# 2-core Xeon VM whose L3 holds a `small` model, the first ~8 steps after other work ran up to 2x slower while the
# L3 refilled: archzoo, timed right after decode_vs_peers' 1 GiB read sweep, measured 217-260 tok/s (0.74-0.85x
# llama.cpp), and 307.5 (1.00x) warmed.
WARM_TOKENS = 16


def decode_rate(timer, prompts, new_tokens, rates: list) -> None:
    """Decode tokens/s of `timer` (seconds for n new tokens per prompt): the time of new_tokens less that of one,
    after an untimed warm-up, appended to rates."""
    timer(prompts, min(new_tokens, WARM_TOKENS))
    t_full = timer(prompts, new_tokens)
    t_prefill = timer(prompts, 1)
    if t_full <= t_prefill:  # an H100 run drew a negative rate: a one-off cost (a compile) landed in the shorter run
        raise RuntimeError(f"{new_tokens} tokens took {t_full:.4f} s, no longer than 1 token's {t_prefill:.4f} s: "
                           f"something outside decoding was timed")
    rates.append(prompts.shape[0] * (new_tokens - 1) / (t_full - t_prefill))


def read_rate(device: str) -> float:
    """MBU's denominator: the CPU's memory read rate past any cache, or a GPU's device copy (bytes read + written)."""
    if torch.device(device).type == "cuda":
        return harness.measure_copy_bandwidth(device)
    return roofline.measure_read_rate()


def measure_batch(model, hf, batch: int, run: HfRun, peak: float) -> dict:
    """Both sides' decode tokens/s at `batch`, their ratio, archzoo's MBU against `peak` (bytes/s: the read rate, read_rate) and
    the greedy-token check, as a row."""
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, run.prompt_len), generator=torch.Generator().manual_seed(batch))
    prompts = prompts.to(run.device)
    engine = harness.Engine(model, max_batch=batch, max_seq_len=run.prompt_len + run.new_tokens,
                            kv_cache=run.kv_cache, compile=run.compile)
    for new_tokens in (1, 4):  # warm-up (compiles, graph captures, the Triton specializations) of both timed runs
        time_zoo(engine, prompts, new_tokens)
        time_hf(hf, prompts, new_tokens)
    hf_rates, zoo_rates = [], []
    for _ in range(run.repeats):
        decode_rate(lambda p, n: time_hf(hf, p, n), prompts, run.new_tokens, hf_rates)
        decode_rate(lambda p, n: time_zoo(engine, p, n), prompts, run.new_tokens, zoo_rates)
    hf_rate, zoo_rate = statistics.median(hf_rates), statistics.median(zoo_rates)
    kv_mean = zoo.cache_bytes(model, seq_len=run.prompt_len + run.new_tokens // 2, batch=batch)
    mbu = harness.metrics.mbu(zoo.decode_weight_bytes(model), kv_mean, batch / zoo_rate, peak)
    return {"arch": model.config.name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "batch": batch, "hf_tok_s": hf_rate, "zoo_tok_s": zoo_rate, "ratio": zoo_rate / hf_rate, "mbu": mbu,
            "cuda_graphs": engine.cuda_graphs,
            "greedy": agreement(hf, engine, prompts, run.new_tokens)}  # untimed: logits kept for the top-5 check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="gqa", help=f"comma-separated, of {', '.join(TWINS)} (default: gqa)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache", default="contiguous", choices=["contiguous", "paged"])
    p.add_argument("--no-compile", action="store_true", help="run archzoo's decode step eagerly (on CUDA: graphs)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    args = p.parse_args()
    run = HfRun(prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats, kv_cache=args.kv_cache,
                compile=not args.no_compile, device=args.device)

    # MBU against the hardware's read rate (a GPU's device copy, read + written): harness/roofline.py
    peak = read_rate(args.device)
    print(f"machine: {torch.get_num_threads()} threads; memory read rate {peak / 1e9:.1f} GB/s (MBU's denominator)")
    print(f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, kv_cache={args.kv_cache}, "
          f"compile={run.compile}, device={args.device}\n")
    print("| arch | dtype | batch | transformers tok/s | archzoo tok/s | ratio | archzoo MBU "
          "| greedy tokens vs transformers |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for arch in args.archs.split(","):
        for dtype_name in args.dtypes.split(","):
            model, hf = build_pair(arch, "base", DTYPES[dtype_name], args.device)
            for batch in map(int, args.batches.split(",")):
                r = measure_batch(model, hf, batch, run, peak)
                print(f"| {arch} | {dtype_name} | {batch} | {r['hf_tok_s']:.1f} | {r['zoo_tok_s']:.1f} | "
                      f"{r['ratio']:.2f}x | {r['mbu']:.0%} | {r['greedy']} |", flush=True)


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
