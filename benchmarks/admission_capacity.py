"""Capacity under one pool: worst-case reservation vs optimistic admission with preemption (vLLM's policy).

Each architecture (tiny preset, fp32, paged, block size 16) gets the same pool: `--pool-requests` requests' worst
case (prompt + max_new_tokens). The workload is `--requests` requests that all ask for `--max-new-tokens` but
stop well before it. They have 64-token random prompts and are sampled at temperature 1 with a stop set of
1/`--mean-output` of the vocabulary, so their output lengths are geometric with that mean. The engine is
identical both times, and the outputs are identical (seeded). What changes is how many requests run at once,
hence the tokens per second.

Rows (one per architecture and admission) go to OUT/results.jsonl atomically as they finish; a re-run skips them.

    python benchmarks/admission_capacity.py                       # gqa, mla, swa, hybrid, mamba
    python benchmarks/admission_capacity.py --archs gqa --requests 64
"""
import argparse
import random
import time
from pathlib import Path

import torch

import zoo
from harness import Engine, SamplingParams
from harness.results import ResultStore


def workload(args, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(args.seed)
    stops = tuple(rng.sample(range(vocab), max(1, vocab // args.mean_output)))
    return [([rng.randrange(vocab) for _ in range(args.prompt_len)],
             SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=i, stop_token_ids=stops))
            for i in range(args.requests)]


def measure(model, requests, admission: str, args) -> dict:
    worst = args.prompt_len + args.max_new_tokens
    engine = Engine(model, max_batch=args.requests, max_seq_len=worst, kv_cache="paged", block_size=16,
                    num_blocks=args.pool_requests * -(-worst // 16), admission=admission)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    running, tokens, start = [], 0, time.perf_counter()
    outputs = []
    while engine.has_unfinished():
        events = engine.step_tokens()
        running.append(len(engine.scheduler.running))
        tokens += sum(event.token_id is not None for event in events)
        outputs += [event.finished for event in events if event.finished is not None]
    seconds = time.perf_counter() - start
    return {"admission": admission, "num_blocks": engine.block_managers[0].num_blocks if engine.block_managers else 0,
            "mean_running": sum(running) / len(running), "max_running": max(running), "steps": len(running),
            "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "preemptions": engine.preemptions,
            "mean_output_len": sum(len(o.token_ids) for o in outputs) / len(outputs),
            "outputs": sorted((o.request_id, o.token_ids) for o in outputs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="gqa,mla,swa,hybrid,mamba")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--pool-requests", type=int, default=4, help="the pool holds this many worst cases")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=448)
    parser.add_argument("--mean-output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/admission_capacity")
    args = parser.parse_args()
    torch.set_num_threads(2)
    store = ResultStore(Path(args.out) / "results.jsonl", ("arch", "admission", "requests", "pool_requests"))
    for arch in args.archs.split(","):
        torch.manual_seed(0)
        model = zoo.build(arch, preset="tiny", max_seq_len=args.prompt_len + args.max_new_tokens).eval()
        requests = workload(args, model.config.vocab_size)
        rows = {}
        for admission in ("reserve", "optimistic"):
            key = {"arch": arch, "admission": admission, "requests": args.requests, "pool_requests": args.pool_requests}
            if not store.done(key):
                store.append({**key, **measure(model, requests, admission, args)})
            rows[admission] = next(r for r in store.rows if all(r[k] == v for k, v in key.items()))
        same = rows["reserve"]["outputs"] == rows["optimistic"]["outputs"]
        r, o = rows["reserve"], rows["optimistic"]
        print(f"{arch:8s} blocks {r['num_blocks']:4d}  running {r['mean_running']:5.1f} -> {o['mean_running']:5.1f} "
              f"(max {r['max_running']} -> {o['max_running']})  tok/s {r['output_tok_s']:7.1f} -> {o['output_tok_s']:7.1f} "
              f"({o['output_tok_s'] / r['output_tok_s']:.2f}x)  preemptions {o['preemptions']}  "
              f"mean output {o['mean_output_len']:.1f}  same outputs {same}")


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
