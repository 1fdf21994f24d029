"""archzoo against its CPU peers on the same weights, in the same run: transformers `generate` and llama.cpp (through
llama-cpp-python, on a GGUF export of the model: zoo/gguf_export.py). Decode tokens/s, each side's ratio to
llama.cpp in the same dtype, MBU, and a greedy-token check.

The `base` GQA model (12 layers, d_model 768, 12 query / 4 KV heads, vocab 32000), batch 1, greedy, one random
prompt of token ids for every side. Weights are spread (tests/helpers.py) so greedy continuations change every step
and the token check means something; speed does not depend on their values. Sides: archzoo's engine (its default
eager decode step, which runs each block's halves as one call each on the CPU; --compile: the torch.compile'd step,
as benchmarks/decode_vs_hf.py measures it) and transformers in fp32 and bf16; llama.cpp on the f32, bf16 and
Q8_0 exports, its KV cache in f32, bf16 and f16 (its default) respectively, n_threads = torch's thread count; beside
Q8_0, archzoo with int8 weights (per-channel scales, the head too) and bf16 activations and KV.
Decode rate for every side = batch * (N - 1) / (time(N new tokens) - time(1 new token)), wall clock around the same
kind of greedy loop (llama.cpp's: eval the prompt, then one token at a time, argmax of the last logits), so prefill
is excluded the same way everywhere; llama.cpp's own perf counters are not used. Sides alternate within each
repeat; each figure is the median of --repeats runs. MBU = (weight bytes a step reads, as stored + KV read at the
mean context) / step time / the machine's read rate for a working set of those bytes (harness.roofline's sweep, as
zoo compare prices a step): the highest of the sweeps taken before the sides and after each round of them.
Greedy tokens: transformers against archzoo by vLLM's rule (benchmarks/hf_agreement.py); llama.cpp against archzoo
in the same dtype (Q8_0 and archzoo int8 against archzoo fp32): the number of leading tokens equal.

    pip install -e ".[peers]"                                   # llama-cpp-python (builds llama.cpp) and gguf
    python benchmarks/decode_vs_peers.py                         # base; f32, bf16, q8_0; prompt 256, 64 new tokens
    python benchmarks/decode_vs_peers.py --dtypes f32 --prompt-len 512 --new-tokens 128 --repeats 5
    python benchmarks/decode_vs_peers.py --preset tiny --repeats 1               # a smoke run
    python benchmarks/decode_vs_peers.py --compile                                # archzoo's compiled step

Without llama-cpp-python (or gguf) the llama.cpp rows are skipped with the reason; the others are still measured.
"""
import argparse
import functools
import importlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import harness
import zoo
from decode_vs_hf import decode_rate, hf_twin
from harness.roofline import ReadRates, measure_machine, measure_read_rates, read_buffer
from hf_agreement import agreement, time_hf, time_zoo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import spread_weights  # noqa: E402  (tests/helpers.py: weights whose greedy output varies)

# export dtype -> archzoo / transformers dtype (None: llama.cpp only)
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "q8_0": None}
# export dtype -> llama.cpp's KV cache type name and bytes per element: the export's own where llama.cpp has it
KV_TYPES = {"f32": ("F32", 4), "bf16": ("BF16", 2), "q8_0": ("F16", 2)}


@dataclass
class PeerRun:
    """One comparison: model size, dtypes, prompt and decode lengths, repeats, and the engine's options."""

    preset: str = "base"
    dtypes: tuple[str, ...] = ("f32", "bf16", "q8_0")
    prompt_len: int = 256
    new_tokens: int = 64
    repeats: int = 3
    compile: bool = False  # the engine's default: eager, the fused block halves on the CPU
    # llama.cpp's extra CPU weight buffers (AMX, repacked quants): off, since on an AMX Xeon ggml's AMX Q8_0 matmul
    # crashed (segfault in ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36); f32 and bf16 do not use them
    llama_extra_buffers: bool = False


@dataclass
class Side:
    """One measured side: name, dtype, timer (prompts, new tokens) -> seconds, bytes a decode step reads, KV type."""

    name: str
    dtype: str
    timer: Callable[[torch.Tensor, int], float]
    step_bytes: float
    kv: str
    greedy: str = ""
    rate: float = 0.0


def llama_cpp_module():
    """llama_cpp and gguf, or the reason the llama.cpp side cannot run."""
    try:
        importlib.import_module("gguf")
        return importlib.import_module("llama_cpp")
    except ImportError as error:
        return f"{error} (pip install -e '.[peers]')"


def build_model(preset: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return spread_weights(zoo.build("gqa", preset=preset), seed=0)


def zoo_greedy(engine, prompts: torch.Tensor, new_tokens: int) -> list[int]:
    params = harness.SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    return engine.generate(prompts.tolist(), params)[0].token_ids


def llama_greedy(llm, prompt: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation from an empty cache: the prompt in one eval, then one token per eval."""
    import llama_cpp  # present wherever an `llm` is

    llm.reset()
    out, feed = [], prompt
    for _ in range(new_tokens):
        llm.eval(feed)
        # the last token's logits, read from the context (llama-cpp-python copies them only with logits_all)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        out.append(int(np.argmax(logits)))
        feed = out[-1:]
    return out


def time_llama(llm, prompts: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    llama_greedy(llm, prompts[0].tolist(), new_tokens)
    return time.perf_counter() - start


def leading_equal(ours: list[int], theirs: list[int]) -> str:
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return f"identical ({same}/{len(ours)})" if same == len(ours) else f"first {same}/{len(ours)} equal"


def kv_bytes(model, run: PeerRun, dtype: torch.dtype) -> int:
    """KV a decode step reads at the mean context, in `dtype`."""
    return zoo.cache_bytes(model, seq_len=run.prompt_len + run.new_tokens // 2, batch=1, dtype=dtype)


def torch_sides(model, dtype_name: str, prompts: torch.Tensor, run: PeerRun, reference: dict) -> list[Side]:
    """archzoo's engine and transformers in one dtype; archzoo's greedy tokens go to `reference` for llama.cpp."""
    dtype = TORCH_DTYPES[dtype_name]
    hf = hf_twin(model).to(dtype)
    ours = build_copy(model, dtype)
    engine = harness.Engine(ours, max_batch=1, max_seq_len=run.prompt_len + run.new_tokens, compile=run.compile)
    reference[dtype_name] = zoo_greedy(engine, prompts, run.new_tokens)
    step_bytes = zoo.decode_weight_bytes(ours) + kv_bytes(ours, run, dtype)
    kv = str(dtype).removeprefix("torch.")
    return [Side("archzoo", dtype_name, lambda p, n: time_zoo(engine, p, n), step_bytes, kv, "reference"),
            Side("transformers", dtype_name, lambda p, n: time_hf(hf, p, n), step_bytes, kv,
                 agreement(hf, engine, prompts, run.new_tokens))]


def int8_side(model, prompts: torch.Tensor, run: PeerRun, reference: dict) -> Side:
    """archzoo's answer to Q8_0: int8 weights (one scale per output channel, the head too, as Q8_0 quantizes it) with
    bf16 activations and KV cache; its greedy tokens against archzoo fp32, as Q8_0's are."""
    ours = zoo.quantize(build_copy(model, torch.bfloat16), zoo.QuantizeConfig("int8", head=True))
    engine = harness.Engine(ours, max_batch=1, max_seq_len=run.prompt_len + run.new_tokens, compile=run.compile)
    tokens = zoo_greedy(engine, prompts, run.new_tokens)
    step_bytes = zoo.decode_weight_bytes(ours) + kv_bytes(ours, run, torch.bfloat16)
    return Side("archzoo int8", "q8_0", lambda p, n: time_zoo(engine, p, n), step_bytes, "bfloat16",
                f"vs archzoo f32: {leading_equal(reference['f32'], tokens)}")


def build_copy(model, dtype: torch.dtype):
    """The model in `dtype`, leaving the fp32 original for the exports."""
    copy = zoo.build(model.config).to(dtype)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def llama_side(llama_cpp, model, dtype_name: str, folder: Path, prompts: torch.Tensor, run: PeerRun,
               reference: dict) -> Side:
    import gguf  # checked with llama_cpp

    from zoo.gguf_export import export_gguf

    path = export_gguf(model, folder / f"{dtype_name}.gguf", dtype_name)
    kv_name, kv_size = KV_TYPES[dtype_name]
    llm = load_llama(llama_cpp, path, run, int(gguf.GGMLQuantizationType[kv_name]))
    tokens = llama_greedy(llm, prompts[0].tolist(), run.new_tokens)
    against = dtype_name if TORCH_DTYPES[dtype_name] is not None else "f32"
    step_bytes = gguf_decode_bytes(path) + kv_bytes(model, run, torch.float32) // 4 * kv_size
    return Side("llama.cpp", dtype_name, lambda p, k: time_llama(llm, p, k), step_bytes, kv_name.lower(),
                f"vs archzoo {against}: {leading_equal(reference[against], tokens)}")


def load_llama(llama_cpp, path: Path, run: PeerRun, kv_type: int):
    """llama.cpp on `path`, its KV cache in `kv_type` (gguf numbers types as ggml does; llama_cpp lacks BF16's), with or
    without its extra weight buffers (run.llama_extra_buffers). Llama() takes no use_extra_bufts argument but reads
    llama_model_default_params(), so that is wrapped while it loads."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = run.llama_extra_buffers
        return p

    low.llama_model_default_params = params
    try:
        return llama_cpp.Llama(str(path), n_ctx=run.prompt_len + run.new_tokens, n_batch=run.prompt_len,
                               n_ubatch=run.prompt_len, n_threads=torch.get_num_threads(),
                               n_threads_batch=torch.get_num_threads(), type_k=kv_type, type_v=kv_type, verbose=False)
    finally:
        low.llama_model_default_params = default


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of the file's tensors a decode step reads: all but token_embd, unless it also serves as the output."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


SWEEP_REPEATS = 3  # passes a size in each read sweep: ~0.5 s a sweep at 31 GB/s


def measure(sides: list[Side], prompts: torch.Tensor, run: PeerRun) -> list[ReadRates]:
    """Every side's median decode rate, the sides alternating within each repeat; returns the read sweeps taken
    before the sides and after each repeat's round, each over the working-set sizes and every side's step bytes."""
    for side in sides:
        side.timer(prompts, 4)  # warm-up (and compile) outside the timed runs
    buffer, step_bytes = read_buffer(), tuple(sorted({side.step_bytes for side in sides}))
    sweeps = [measure_read_rates(SWEEP_REPEATS, buffer=buffer, also=step_bytes)]
    rates = {id(side): [] for side in sides}
    for _ in range(run.repeats):
        for side in sides:
            decode_rate(side.timer, prompts, run.new_tokens, rates[id(side)])
        sweeps.append(measure_read_rates(SWEEP_REPEATS, buffer=buffer, also=step_bytes))
    for side in sides:
        side.rate = statistics.median(rates[id(side)])
    return sweeps


def table(sides: list[Side], read_rates: ReadRates) -> str:
    llama = {s.dtype: s.rate for s in sides if s.name == "llama.cpp"}
    lines = ["| dtype | side | KV cache | decode tok/s | / llama.cpp | MB per step | MBU | greedy tokens |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for s in sorted(sides, key=lambda s: list(TORCH_DTYPES).index(s.dtype)):  # stable: archzoo first in a dtype
        ratio = f"{s.rate / llama[s.dtype]:.2f}x" if s.dtype in llama else "—"
        mbu = harness.metrics.mbu(s.step_bytes, 0, 1 / s.rate, read_rates.at(s.step_bytes))
        lines.append(f"| {s.dtype} | {s.name} | {s.kv} | {s.rate:.1f} | {ratio} | {s.step_bytes / 1e6:.1f} | "
                     f"{mbu:.0%} | {s.greedy} |")
    return "\n".join(lines)


def run_peers(run: PeerRun) -> str:
    """The whole comparison; returns the table (printed as well, with the settings and the machine's rate)."""
    model = build_model(run.preset)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (1, run.prompt_len), generator=torch.Generator().manual_seed(1))
    rates = measure_machine(model)
    print(f"machine: {torch.get_num_threads()} threads; read rate {rates.stream_bytes_per_s / 1e9:.1f} GB/s "
          f"({rates.how})")
    print(f"gqa {run.preset}, batch 1, prompt {run.prompt_len}, {run.new_tokens} new tokens, greedy, "
          f"compile={run.compile}, llama.cpp extra buffers={run.llama_extra_buffers}, median of {run.repeats}\n")
    reference, sides = {}, []
    for dtype_name in run.dtypes:
        if TORCH_DTYPES[dtype_name] is not None:
            sides += torch_sides(model, dtype_name, prompts, run, reference)
    if "q8_0" in run.dtypes:
        if "f32" not in reference:  # int8's and Q8_0's tokens are checked against fp32
            reference["f32"] = zoo_greedy(harness.Engine(model, max_batch=1), prompts, run.new_tokens)
        sides.append(int8_side(model, prompts, run, reference))
    llama_cpp = llama_cpp_module()
    with tempfile.TemporaryDirectory() as folder:
        if isinstance(llama_cpp, str):
            print(f"llama.cpp rows skipped: {llama_cpp}")
        else:
            sides += [llama_side(llama_cpp, model, d, Path(folder), prompts, run, reference) for d in run.dtypes]
        sweeps = measure(sides, prompts, run)
    # the machine's rate moves within a run (31-35 GB/s, then 48-56 for a while, on the 2-core EPYC VM): each side is
    # priced at the highest rate its bytes were read at, before the sides and after each round of them, so no side's
    # MBU is inflated by a slow moment (priced at the rates before and after alone, an f32 side that ran in a fast
    # spell measured MBU 116%); and at its own bytes' rate, as zoo compare prices a step, so a working set a large
    # cache holds part of is not priced at the memory's rate alone (the 2-core Xeon's 480 MiB L3: 204 MB of bf16
    # weights read at 42-54 GB/s where 1 GiB reads at 31)
    read_rates = functools.reduce(ReadRates.higher, sweeps)
    rate_of = {f"{s.dtype} ({s.step_bytes / 1e6:.0f} MB)": read_rates.at(s.step_bytes) for s in sides}
    print(f"MBU against the highest read rate of each side's step bytes over {len(sweeps)} sweeps (before the sides "
          f"and after each round of them): {', '.join(f'{k} {v / 1e9:.1f} GB/s' for k, v in rate_of.items())}; "
          f"1 GiB read at {', '.join(f'{sweep.rates[-1] / 1e9:.1f}' for sweep in sweeps)} GB/s")
    text = table(sides, read_rates)
    print(text, flush=True)
    return text


def dtype_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [n for n in names if n not in TORCH_DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown dtype(s) {bad or text!r}; allowed: {', '.join(TORCH_DTYPES)}")
    return names


def at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def main(argv=None) -> int:
    d = PeerRun()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=d.preset, choices=list(zoo.PRESETS), help=f"model size (default: {d.preset})")
    p.add_argument("--dtypes", type=dtype_list, default=d.dtypes, help=f"comma-separated, of {', '.join(TORCH_DTYPES)} "
                   "(q8_0: llama.cpp only) (default: all)")
    p.add_argument("--prompt-len", type=at_least(1), default=d.prompt_len, help=f"default: {d.prompt_len}")
    p.add_argument("--new-tokens", type=at_least(2), default=d.new_tokens, help=f"default: {d.new_tokens}")
    p.add_argument("--repeats", type=at_least(1), default=d.repeats, help=f"default: {d.repeats}")
    p.add_argument("--compile", action="store_true", help="torch.compile archzoo's decode step (default: eager, the "
                   "engine's default)")
    p.add_argument("--llama-extra-buffers", action="store_true", help="let llama.cpp use its extra CPU weight buffers "
                   "(AMX, repacked Q8_0); off by default: its AMX Q8_0 matmul crashed on an AMX Xeon")
    args = p.parse_args(argv)
    limit = zoo.PRESETS[args.preset].max_seq_len
    if args.prompt_len + args.new_tokens > limit:
        p.error(f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} exceeds the {args.preset} "
                f"preset's max_seq_len {limit}")
    run_peers(PeerRun(preset=args.preset, dtypes=args.dtypes, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                      repeats=args.repeats, compile=args.compile,
                      llama_extra_buffers=args.llama_extra_buffers))
    return 0


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        code = main()
    sys.exit(code)
