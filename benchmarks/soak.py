"""Soak: waves of requests through one long-lived engine; its memory must stay flat.

Each wave queues `--requests` requests (random prompts of 4-24 tokens, 2-8 new tokens, a mix of greedy, sampled,
stop ids and aborts) with add_request, drains them with step(), and records the process's resident set size
(VmRSS, after a garbage collection) and what the engine holds. A leak shows as RSS that climbs wave after wave;
the first wave or two warm allocator pools and caches, so the figure compared is wave N against wave 2.

Each wave's row is written to OUT/results.jsonl as it finishes (atomically); a re-run starts a new soak, since
the point is one engine's life.

    python benchmarks/soak.py                            # 10 waves of 1,000 requests, tiny gqa, paged
    python benchmarks/soak.py --arch hybrid --kv-cache contiguous --waves 4
"""
import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

import zoo
from harness import Engine, SamplingParams
from harness.results import write_atomic


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark needs Linux")


def random_request(rng: random.Random, vocab: int) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 24))]
    kind = rng.random()
    if kind < 0.4:
        params = SamplingParams(max_new_tokens=rng.randint(2, 8), temperature=0.0)
    elif kind < 0.8:
        params = SamplingParams(max_new_tokens=rng.randint(2, 8), temperature=rng.uniform(0.5, 1.5),
                                top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**32))
    else:
        params = SamplingParams(max_new_tokens=8, temperature=1.0, repetition_penalty=1.3,
                                stop_token_ids=tuple(rng.sample(range(vocab), 20)), seed=rng.randrange(2**32))
    return prompt, params


def run_wave(engine: Engine, rng: random.Random, requests: int) -> dict:
    ids = [engine.add_request(*random_request(rng, engine.model.config.vocab_size)) for _ in range(requests)]
    to_abort = set(rng.sample(ids, requests // 20))  # 5% aborted after their first step
    reasons: dict[str, int] = {}
    first_step = True
    while engine.has_unfinished():
        for out in engine.step():
            reasons[out.finish_reason] = reasons.get(out.finish_reason, 0) + 1
        if first_step:
            for request_id in to_abort:
                out = engine.abort(request_id)
                if out is not None:
                    reasons["abort"] = reasons.get("abort", 0) + 1
            first_step = False
    return reasons


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gqa")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--kv-cache", default="paged", choices=["contiguous", "paged"])
    p.add_argument("--max-batch", type=int, default=4, help="small, so 10 waves take more decode steps than the engine keeps one by one")
    p.add_argument("--waves", type=int, default=10)
    p.add_argument("--requests", type=int, default=1000, help="requests per wave")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/soak")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model = zoo.build(args.arch, preset=args.preset, max_seq_len=64).eval()
    engine = Engine(model, max_batch=args.max_batch, max_seq_len=64, kv_cache=args.kv_cache)
    rng = random.Random(args.seed)
    rows = []
    for wave in range(1, args.waves + 1):
        start = time.perf_counter()
        reasons = run_wave(engine, rng, args.requests)
        gc.collect()
        rows.append({"wave": wave, "rss_mb": rss_bytes() / 2**20, "seconds": time.perf_counter() - start,
                     "finish_reasons": reasons, "unfinished": len(engine.unfinished),
                     "stats_kept": len(engine.decode_stats.seconds), "decode_steps": engine.decode_stats.steps,
                     "blocks_used": sum(m.used for m in engine.block_managers),
                     "tables": sum(len(m.tables) for m in engine.block_managers)})
        write_atomic(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        print(json.dumps(rows[-1]), flush=True)
    if len(rows) >= 2:
        base, last = rows[1]["rss_mb"], rows[-1]["rss_mb"]
        print(f"RSS after wave {len(rows)}: {last:.1f} MB; after wave 2: {base:.1f} MB; change {100 * (last / base - 1):+.2f}%")


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
