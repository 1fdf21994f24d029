"""How far Fast-dLLM's approximate caches (and fewer sampling steps) drift from the exact LLaDA sampler, measured
on a masked diffusion LM that has learned a task.

On random weights a diffusion LM's predictions are near-uniform, so which tokens a cached or a fast sampler picks
says nothing about the cache. So this script first trains the `tiny` diffusion LM (d_model 64, 2 layers) on a
copy task whose answer is fixed by the prompt: 16 symbols of 32 and a separator, then the same 16 symbols
(`--task copy`) or the same in reverse order (`--task reverse`), with LLaDA's SFT objective (only the answer is
ever masked). Then, on held-out prompts in one batch, for each block length (the answer, half of it), step count
(gen_length, /4, /16 where the block count divides it) and cache (none, Fast-dLLM prefix, dual), plus threshold
unmasking (confidence >= 0.9) without a cache and with the dual cache, it reports:

- accuracy: generated tokens equal to the right answer;
- agree vs no cache: tokens equal to the no-cache run with the same block length and steps (for threshold rows:
  the no-cache threshold run) -- the cache's own drift;
- agree vs 1 tok/fwd: tokens equal to the no-cache run that unmasks one token per forward, the most exact sampler;
- forwards, tokens per forward (per sequence), wall time (median of --repeats after a warm-up) and tokens/s.

Greedy, low-confidence remasking, so every run is deterministic. The defaults (reverse, 600 steps: ~30 s of
training on one CPU thread, ~40 s in all) leave the model right on ~80% of the answer tokens, confident on some
and not on others: a model that copies perfectly (`--task copy`, which saturates at 1.000 within ~250 steps) is so
confident that every sampler and cache picks the same tokens, which measures nothing either.

    python benchmarks/diffusion_agreement.py
    python benchmarks/diffusion_agreement.py --task copy --train-steps 150 --prompts 256 --threads 2
"""
import argparse
import os
import platform
import statistics
import sys
import time

import torch

import zoo
from harness import DiffusionSampler
from harness.diffusion import masked_diffusion_loss

SYMBOLS = 32
SEP = SYMBOLS  # the separator id; the model's mask token is the id after it


def task_batch(n: int, length: int, task: str, generator: torch.Generator) -> torch.Tensor:
    """[n, 2 * length + 1]: prompt (length symbols, separator), then the answer (the prompt copied or reversed)."""
    x = torch.randint(0, SYMBOLS, (n, length), generator=generator)
    answer = x if task == "copy" else x.flip(1)
    return torch.cat([x, torch.full((n, 1), SEP), answer], dim=1)


def train(args):
    torch.manual_seed(args.seed)
    n = args.answer_length
    model = zoo.build("diffusion", preset="tiny", vocab_size=SYMBOLS + 1, max_seq_len=2 * n + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = torch.Generator().manual_seed(args.seed)
    loss_mask = torch.zeros(2 * n + 1, dtype=torch.bool)
    loss_mask[n + 1:] = True  # the answer only: the prompt is never masked (LLaDA's SFT)
    model.train()
    start = time.perf_counter()
    for _ in range(args.train_steps):
        tokens = task_batch(args.batch, n, args.task, data)
        loss = masked_diffusion_loss(model, tokens, generator=data, loss_mask=loss_mask.expand_as(tokens))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), loss.item(), time.perf_counter() - start


def settings(gen_length: int, threshold: float):
    """(block_length, steps, cache, threshold) per row; the first row of each block length is its exact reference."""
    rows = []
    for block in (gen_length, gen_length // 2):
        blocks = gen_length // block
        for steps in (gen_length, gen_length // 4, gen_length // 16):
            if steps >= 1 and steps % blocks == 0:
                rows += [(block, steps, cache, None) for cache in (None, "prefix", "dual")]
        # with a threshold, `steps` only has to be a multiple of the block count; each block runs until unmasked
        rows += [(block, gen_length, cache, threshold) for cache in (None, "dual")]
    return rows


def run(model, prompts, gen_length, setting, repeats):
    """The first run's output (greedy: every run gives the same tokens) and the median wall time of the rest."""
    block, steps, cache, threshold = setting
    sampler = DiffusionSampler(model, steps=steps, block_length=block, cache=cache, threshold=threshold)
    out = sampler.generate(prompts, gen_length)
    walls = [sampler.generate(prompts, gen_length).wall_s for _ in range(repeats)]
    return out, statistics.median(walls) if walls else out.wall_s


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="reverse", choices=["copy", "reverse"])
    p.add_argument("--answer-length", type=int, default=16, help="symbols to copy; also gen_length")
    p.add_argument("--train-steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64, help="training examples per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--prompts", type=int, default=64, help="held-out prompts, generated as one batch")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (after one untimed run)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = gen_length = args.answer_length
    if n % 2:
        p.error(f"--answer-length must be even (block lengths are it and half of it), got {n}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    start = time.perf_counter()
    model, loss, train_s = train(args)
    print(f"\ntrained diffusion/tiny ({sum(q.numel() for q in model.parameters()) / 1e3:.0f}k params) on {args.task} "
          f"of {n} symbols: {args.train_steps} steps x {args.batch} examples, final loss {loss:.4f}, {train_s:.1f} s")

    test = task_batch(args.prompts, n, args.task, torch.Generator().manual_seed(args.seed + 1000))
    prompts, truth = test[:, : n + 1], test[:, n + 1:]
    DiffusionSampler(model, steps=n, block_length=n).generate(prompts[:2], gen_length)  # warm-up

    print(f"\n{args.prompts} held-out prompts in one batch, gen_length {gen_length}, greedy, low-confidence "
          f"remasking; wall = median of {args.repeats} runs\n")
    print("| block | steps | cache | threshold | accuracy | agree vs no cache | agree vs 1 tok/fwd | forwards | "
          "tok/fwd | wall ms | tok/s |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    references = {}  # (block, steps, threshold) -> the no-cache output
    for setting in settings(gen_length, args.threshold):
        block, steps, cache, threshold = setting
        out, wall = run(model, prompts, gen_length, setting, args.repeats)
        if cache is None:
            references[block, steps, threshold] = out
        accuracy = (torch.tensor(out.token_ids) == truth).double().mean().item()
        same = out.agreement(references[block, steps, threshold])
        exact = out.agreement(references[block, gen_length, None])
        tokens = args.prompts * gen_length
        print(f"| {block} | {'-' if threshold else steps} | {cache or 'none'} | {threshold or '-'} | {accuracy:.3f} | "
              f"{same:.3f} | {exact:.3f} | {out.forward_passes} | {out.tokens_per_forward:.2f} | "
              f"{1000 * wall:.1f} | {tokens / wall:.0f} |", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
