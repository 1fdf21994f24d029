"""Mamba's MQAR training step on CPU with the compiled scan (forward and backward in kernels/cpu/selective_scan.c)
against the torch-op loop it replaced (ssm/scan.py's reference), interleaved step by step in one process so the
machine's drift falls on both. The recall recipe's model: d_model 64, 2 layers, no MLP, vocabulary 8192, batch 64,
L = 64 with 4 key-value pairs; forward, backward and an AdamW step. A second table times the scan alone (one
layer's SelectiveScan forward + backward at the same sizes).

    python benchmarks/mamba_train_step.py [--d-models 64,128] [--steps 20]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ssm.scan  # noqa: E402
from harness.recall.data import MQARSetting, make_mqar  # noqa: E402
from harness.recall.train import TrainConfig, build_recall_model, training_loss  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-models", default="64,128")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    args = parser.parse_args()
    inputs, labels = make_mqar(MQARSetting(seq_len=64, num_kv_pairs=4, vocab_size=8192), 64, seed=0)
    compiled = ssm.scan.compiled_kernel_fits
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| d_model | torch-op loop s/step | compiled s/step | speed-up |")
    print("|---:|---:|---:|---:|")
    for d_model in (int(d) for d in args.d_models.split(",")):
        torch.manual_seed(0)
        model = build_recall_model(TrainConfig(arch="mamba", d_model=d_model), vocab_size=8192, seq_len=64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(0)
        times = {"loop": [], "compiled": []}

        def step(side: str) -> None:
            ssm.scan.compiled_kernel_fits = compiled if side == "compiled" else (lambda dt, A: False)
            start = time.perf_counter()
            optimizer.zero_grad()
            training_loss(model, inputs, labels, generator).backward()
            optimizer.step()
            times[side].append(time.perf_counter() - start)

        for side in ("loop", "compiled"):  # warm-up: the kernel builds, allocator settles
            step(side)
        times = {"loop": [], "compiled": []}
        for _ in range(args.steps):
            step("loop")
            step("compiled")
        loop, fast = statistics.median(times["loop"]), statistics.median(times["compiled"])
        print(f"| {d_model} | {loop:.3f} | {fast:.3f} | {loop / fast:.1f}x |", flush=True)
    print("\n| d_model | scan fwd+bwd, torch-op loop ms | compiled ms | speed-up |")
    print("|---:|---:|---:|---:|")
    for d_model in (int(d) for d in args.d_models.split(",")):
        g = torch.Generator().manual_seed(0)
        b, t, d, n = 64, 64, 2 * d_model, 16
        dt = torch.nn.functional.softplus(torch.randn(b, t, d, generator=g) - 1)
        inputs = (dt, -torch.exp(torch.randn(d, n, generator=g)), dt * torch.randn(b, t, d, generator=g),
                  torch.randn(b, t, n, generator=g), torch.randn(b, t, n, generator=g), torch.zeros(b, d, n))
        grad_y = torch.randn(b, t, d, generator=g)
        scan_times = {"loop": [], "compiled": []}

        def scan(side: str) -> None:
            ssm.scan.compiled_kernel_fits = compiled if side == "compiled" else (lambda dt, A: False)
            leaves = [x.clone().requires_grad_() for x in inputs]
            start = time.perf_counter()
            y, _ = ssm.scan.SelectiveScan.apply(*leaves)
            (y * grad_y).sum().backward()
            scan_times[side].append(time.perf_counter() - start)

        for _ in range(args.steps + 2):
            scan("loop")
            scan("compiled")
        loop, fast = (statistics.median(scan_times[side][2:]) for side in ("loop", "compiled"))
        print(f"| {d_model} | {loop * 1e3:.1f} | {fast * 1e3:.1f} | {loop / fast:.1f}x |", flush=True)
    ssm.scan.compiled_kernel_fits = compiled


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
