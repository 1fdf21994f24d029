"""How near the machine's memory read rate a decode step's weight reads run: the bare linear layers of one step of
the `base` gqa model (every nn.Linear, as the model's layers call them: kernels/linear.py's CPU dispatch, the C GEMV
at decode sizes) beside torch's own F.linear on the same weights, at batch 1 and 4, fp32 and bf16, in one run with the
read rate measured (harness/roofline.py: past any cache, and for a working set of the weights' size; the 1 GiB rate
again just before and after each row, which prices it); and the
same GEMVs called one after another from C (cpu_decode.dense_gemv_layers), as an engine's planned step calls its
kernels, without the ~20 µs of Python a call the modules' forwards add; and the read kernel over those same weight
tensors where they lie (cpu_decode.read_buffers): the rate that memory is read at, which a step's GEMVs can at best
match, beside the floor's fresh 1 GiB buffer (on a VM the two can differ by a third: where a buffer's pages land
decides its rate). The weights lie where an engine puts them (harness/engine/model_runner.py: 2 MiB pages where
the kernel grants them). int8: the same
model in bf16 with every linear layer, the head too, quantized per output channel (zoo.quantize), called as the model
calls them (kernels/quantized_matmul.py: the C int8 GEMV at decode sizes) beside torch's `_weight_int8pack_mm`.

    python benchmarks/weight_streaming.py
    python benchmarks/weight_streaming.py --batches 1,2,4,8,16 --dtypes fp32,bf16,int8 --repeats 30
    python benchmarks/weight_streaming.py --rounds 4
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import zoo
from harness import roofline
from harness.engine.model_runner import place_weights
from kernels import cpu_decode
from zoo.quantize import QuantizedLinear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16}  # int8: bf16 activations


def step_seconds(layers, inputs, call, repeats: int) -> float:
    """Median seconds of one pass over every layer (after one untimed pass)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        for layer, x in zip(layers, inputs):
            call(layer, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@torch.inference_mode()
def measure(model, name: str, batch: int, repeats: int, rates: roofline.MachineRates) -> dict:
    quantized = name == "int8"
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear if quantized else torch.nn.Linear)]
    inputs = [torch.randn(batch, m.in_features).to(DTYPES[name]) for m in layers]
    weight_bytes = sum((m.q if quantized else m.weight).nbytes for m in layers)
    before = roofline.measure_read_rate()  # beside this row: the VM's memory has fast and slow spells a minute apart
    archzoo = step_seconds(layers, inputs, lambda layer, x: layer(x), repeats)
    torch_call = ((lambda layer, x: torch._weight_int8pack_mm(x, layer.q, layer.scales)) if quantized else
                  (lambda layer, x: F.linear(x, layer.weight)))
    torch_s = step_seconds(layers, inputs, torch_call, repeats)
    # the same GEMVs called one after another from C, as a planned decode step calls its kernels: no Python between
    from_c = None if quantized else step_seconds(
        [[m.weight for m in layers]], [inputs], lambda weights, xs: cpu_decode.dense_gemv_layers(xs, weights), repeats)
    # the same weight tensors read where they lie, with nothing else: the rate their memory gives
    own = weight_bytes / roofline.tensors_read_rate([m.q if quantized else m.weight for m in layers], repeats)
    after = roofline.measure_read_rate()
    read, working_set = max(before, after), rates.stream_rate(weight_bytes)  # the higher: the stricter floor
    return {"dtype": name, "batch": batch, "weight_mb": weight_bytes / 1e6,
            "archzoo_gb_s": weight_bytes / archzoo / 1e9, "torch_gb_s": weight_bytes / torch_s / 1e9,
            "pct_read": weight_bytes / archzoo / read, "pct_working_set": weight_bytes / archzoo / working_set,
            "from_c_gb_s": from_c and weight_bytes / from_c / 1e9,
            "pct_read_from_c": from_c and weight_bytes / from_c / read,
            "read_gb_s": read / 1e9, "read_before_gb_s": before / 1e9, "read_after_gb_s": after / 1e9,
            "working_set_gb_s": working_set / 1e9, "own_gb_s": weight_bytes / own / 1e9,
            "pct_own_from_c": from_c and own / from_c, "pct_own": own / archzoo}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="base")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="each row this many times (a row whose read rates before and "
                   "after differ by more than 15%% ran across a fast and a slow spell of the memory)")
    args = p.parse_args()
    rows = []
    for name in args.dtypes.split(","):
        torch.manual_seed(0)
        model = zoo.build("gqa", preset=args.preset).to(DTYPES[name]).eval()
        rates = roofline.measure_machine(model)
        if name == "int8":
            model = zoo.quantize(model, zoo.QuantizeConfig("int8", head=True))
        off = place_weights(model)  # where an engine's runner puts them: 2 MiB pages
        print(f"{name}: weights {'in 2 MiB pages' if not off else 'where torch put them: ' + off}", flush=True)
        print(f"{name}: {rates.how}", flush=True)
        rows += [measure(model, name, int(b), args.repeats, rates)
                 for b in args.batches.split(",") for _ in range(args.rounds)]
    print("| dtype | batch | weights (MB) | archzoo GB/s | torch GB/s (F.linear; int8: _weight_int8pack_mm) | "
          "% of read rate (1 GiB, the higher of before / after the row) | steady | % of read rate for its working "
          "set | archzoo from C GB/s (% of read rate) | the weights' own memory read at, GB/s (archzoo / from C as "
          "% of it) |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        from_c = "—" if r["from_c_gb_s"] is None else f"{r['from_c_gb_s']:.1f} ({r['pct_read_from_c']:.0%})"
        own_from_c = "—" if r["pct_own_from_c"] is None else f"{r['pct_own_from_c']:.0%}"
        low, high = sorted((r["read_before_gb_s"], r["read_after_gb_s"]))
        print(f"| {r['dtype']} | {r['batch']} | {r['weight_mb']:.0f} | {r['archzoo_gb_s']:.1f} | "
              f"{r['torch_gb_s']:.1f} | {r['pct_read']:.0%} ({r['read_before_gb_s']:.1f} / "
              f"{r['read_after_gb_s']:.1f}) | {'yes' if low >= 0.85 * high else 'no'} | "
              f"{r['pct_working_set']:.0%} ({r['working_set_gb_s']:.1f}) | {from_c} | {r['own_gb_s']:.1f} "
              f"({r['pct_own']:.0%} / {own_from_c}) |")

if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
