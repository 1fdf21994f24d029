"""An analytic roofline per architecture: the bytes and FLOPs one decode step (or one prefill) must cost, from the
model's cache declarations and parameters alone, and the machine's two measured ceilings that turn them into a
floor on time (max of bytes / streaming rate and FLOPs / matmul rate)."""
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

import zoo
from cache import specs_read
from harness.metrics import measure_copy_bandwidth, sync
from kernels import cpu_decode, cpu_memory

# FLOPs per state element per token for a recurrent ("state") layer: the update reads each element, decays it and
# adds the new outer product (~2), and the readout contracts it with the query or C (~2).
STATE_FLOPS_PER_ELEMENT = 4


@dataclass(frozen=True)
class StepCost:
    """What one step must move and compute; `bytes` is what a memory-bound step streams."""

    weight_bytes: int
    cache_read_bytes: int
    cache_write_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_read_bytes + self.cache_write_bytes


@dataclass(frozen=True)
class ReadRates:
    """The machine's memory read rate by working-set size: a buffer of each size read again and again with the
    engine's threads, best pass. A buffer that fits a cache reads faster than one that does not; the largest size
    (READ_BYTES, past any cache) is the memory's own rate."""

    sizes: tuple[int, ...]  # bytes, ascending
    rates: tuple[float, ...]  # bytes/s at each size
    how: str = ""

    def at(self, nbytes: int) -> float:
        """The rate a step that streams `nbytes` can reach at most: that of the largest size measured up to nbytes
        (a larger working set reads no faster), raised to any larger size's rate, which it can reach too (so one slow
        pass cannot raise the floor); below the smallest size, the fastest measured. Never a smaller size's alone: a
        step past the last cache reads at the memory's rate however fast a cache-sized buffer reads (a 91 MB step
        priced at a 32 MiB buffer's 54 GB/s, on a 32 MiB-L3 EPYC whose memory reads at 31, was 1.7x too low)."""
        within = [i for i, size in enumerate(self.sizes) if size <= nbytes]
        return max(self.rates[within[-1] if within else 0:])

    def higher(self, other: "ReadRates") -> "ReadRates":
        """Size by size, the faster of two sweeps over the same sizes (a cell's floor from the sweeps just before and
        after its steps: the memory could read at either rate while they ran)."""
        if self.sizes != other.sizes:
            raise ValueError(f"read sweeps over different sizes: {self.sizes} and {other.sizes}")
        return ReadRates(self.sizes, tuple(map(max, self.rates, other.rates)), self.how)


@dataclass(frozen=True)
class MachineRates:
    """The two ceilings of the roofline, measured on this machine in one dtype: the memory read rate (bytes, the
    floor's), by working-set size where measured, and the matmul rate (FLOPs). The rate torch's GEMV reaches and the
    copy rate are measured beside them, to be shown, never to price a floor."""

    stream_bytes_per_s: float  # the read rate past any cache (CPU), or the device copy rate (GPU)
    matmul_flops_per_s: float
    dtype: str
    device: str
    how: str  # how each rate was measured, for the reader of a results row
    read_rates: ReadRates | None = None  # by working-set size (CPU); None: stream_bytes_per_s at every size
    gemv_bytes_per_s: float | None = None  # what torch's F.linear reaches over the model's weights at batch 1
    copy_bytes_per_s: float | None = None  # a large copy, bytes read + written

    def stream_rate(self, nbytes: int) -> float:
        """The read rate that prices a step streaming `nbytes`."""
        return self.stream_bytes_per_s if self.read_rates is None else self.read_rates.at(nbytes)

    def priced_at(self, read_rates: ReadRates) -> "MachineRates":
        """These ceilings with the read rates of `read_rates` (a sweep taken again, around one cell's steps); the
        matmul, GEMV and copy rates stay the run's."""
        return replace(self, stream_bytes_per_s=read_rates.rates[-1], read_rates=read_rates)

    def row_fields(self) -> dict:
        optional = {"gemv_gb_s": self.gemv_bytes_per_s, "copy_gb_s": self.copy_bytes_per_s}
        return {"stream_gb_s": self.stream_bytes_per_s / 1e9, "read_gb_s": self.stream_bytes_per_s / 1e9,
                "matmul_gflop_s": self.matmul_flops_per_s / 1e9, "rates_how": self.how,
                **{name: None if rate is None else rate / 1e9 for name, rate in optional.items()}}


def model_dtype(model, dtype: torch.dtype | None) -> torch.dtype:
    return dtype or next(model.parameters()).dtype


def weight_elements(model) -> int:
    """Weights a decode step reads (every one but an untied embedding table): each is one multiply-add per token."""
    return zoo.cache.decode_weight_elements(model)


def weight_bytes(model, dtype: torch.dtype) -> int:
    """Bytes of those weights: in `dtype`, or as stored where the model is quantized (payload and scales)."""
    if getattr(model, "quantization", None) is not None:
        return zoo.decode_weight_bytes(model)
    return weight_elements(model) * dtype.itemsize


def active_elements(model) -> int:
    """Weights one token applies: weight_elements less, per MoE layer, the experts it is not routed to."""
    return weight_elements(model) - sum(moe.inactive_weights for moe in zoo.moe_layers(model).values())


def unread_expert_bytes(model, dtype: torch.dtype, tokens: int, experts_read: dict[int, float] | None = None) -> float:
    """Expert weight bytes a step over `tokens` tokens does not read: per MoE layer, the share of its experts outside
    the step's union, measured (experts_read: layer -> mean distinct experts a step read) or, without a measurement,
    a uniform router's expectation E (1 - (1 - k/E)^tokens)."""
    quantized = getattr(model, "quantization", None) is not None
    unread = 0.0
    for i, moe in zoo.moe_layers(model).items():
        read = experts_read[i] if experts_read else zoo.expected_experts_read(moe.n_experts, moe.top_k, tokens)
        stack = (sum(linear.stored_bytes for linear in moe.experts.children()) if quantized
                 else 3 * moe.n_experts * moe.d_model * moe.expert_hidden * dtype.itemsize)
        unread += (1 - read / moe.n_experts) * stack
    return unread


def attention_flops(own, read, keys: int) -> int:
    """One query's FLOPs in one layer over `keys` keys: q.k over the key width and p.v over the value width for every
    query head (a shared layer uses its own heads and its source's widths; MLA's latent row is both, absorbed)."""
    if read.kind == "state":
        return STATE_FLOPS_PER_ELEMENT * read.state_elements
    return 2 * own.query_heads * (read.head_dim + read.value_dim) * keys


def decode_step_cost(model, batch: int, context: int, dtype: torch.dtype | None = None,
                     kv_format: str = "auto", experts_read: dict[int, float] | None = None) -> StepCost:
    """One decode step for `batch` sequences holding `context` tokens: it writes the new token's K/V (or rewrites
    its state) and attends over the keys of context + 1 its retention policy keeps; kv_format: how the per-token
    caches are stored (cache.KV_FORMATS), which sets their bytes. An MoE layer reads only the experts its batch is
    routed to: experts_read (layer -> distinct experts per step, measured), else a uniform router's expectation;
    each token applies top_k of them."""
    if batch < 1 or context < 0:
        raise ValueError(f"batch must be >= 1 and context >= 0, got batch={batch}, context={context}")
    dtype = model_dtype(model, dtype)
    specs = model.cache_specs()
    weights = active_elements(model)
    keys = context + 1
    write = sum(spec.token_bytes(dtype, kv_format) + spec.state_bytes(dtype) for spec in specs if spec.owns_memory)
    attention = sum(attention_flops(own, read, read.retention.keys_seen(keys))
                    for own, read in zip(specs, specs_read(specs)))
    return StepCost(weight_bytes=round(weight_bytes(model, dtype) - unread_expert_bytes(model, dtype, batch,
                                                                                          experts_read)),
                    cache_read_bytes=zoo.cache_read_bytes(model, seq_len=keys, batch=batch, dtype=dtype,
                                                          kv_format=kv_format),
                    cache_write_bytes=batch * write,
                    flops=batch * (2 * weights + attention))


def prefill_cost(model, batch: int, prompt_len: int, dtype: torch.dtype | None = None,
                 kv_format: str = "auto") -> StepCost:
    """`batch` prompts of `prompt_len` tokens from an empty cache. Every weight is applied to every token except the
    head, which the engine applies at the last position only (an MoE layer applies top_k experts per token and reads
    those its tokens are routed to); bytes = weights + the cache written."""
    if batch < 1 or prompt_len < 1:
        raise ValueError(f"batch and prompt_len must be >= 1, got batch={batch}, prompt_len={prompt_len}")
    dtype = model_dtype(model, dtype)
    specs = model.cache_specs()
    weights = active_elements(model)
    head = model.config.vocab_size * model.config.d_model
    attention = 0
    for own, read in zip(specs, specs_read(specs)):
        if read.kind == "state":
            attention += prompt_len * attention_flops(own, read, 0)
        else:  # per (query, key) pair; MLA counted as its absorbed form (the expanded prefill does fewer)
            attention += attention_flops(own, read, read.retention.causal_pairs(prompt_len))
    unread = unread_expert_bytes(model, dtype, batch * prompt_len)
    return StepCost(weight_bytes=round(weight_bytes(model, dtype) - unread), cache_read_bytes=0,
                    cache_write_bytes=zoo.cache_bytes(model, seq_len=prompt_len, batch=batch, dtype=dtype,
                                                      kv_format=kv_format),
                    flops=batch * (2 * (weights - head) * prompt_len + 2 * head + attention))


def floor_seconds(cost: StepCost, rates: MachineRates) -> float:
    """The roofline: no step is faster than reading its bytes at the machine's read rate (for a working set of its
    size) or computing its FLOPs at the measured matmul rate."""
    return max(cost.bytes / rates.stream_rate(cost.bytes), cost.flops / rates.matmul_flops_per_s)


def bound(cost: StepCost, rates: MachineRates) -> str:
    """Which ceiling sets the floor."""
    memory = cost.bytes / rates.stream_rate(cost.bytes)
    return "memory" if memory >= cost.flops / rates.matmul_flops_per_s else "compute"


def mbu(cost: StepCost, seconds: float, rates: MachineRates) -> float:
    """Bandwidth utilisation (Databricks): the step's bytes over its measured time, against the read rate that prices
    its floor, so a step at its floor is 100% and none is above."""
    return cost.bytes / seconds / rates.stream_rate(cost.bytes)


def mfu(cost: StepCost, seconds: float, rates: MachineRates) -> float:
    """FLOP utilisation: the step's FLOPs over its measured time, against the matmul rate."""
    return cost.flops / seconds / rates.matmul_flops_per_s


def best_time(fn, device: str, repeats: int, budget_s: float) -> float:
    """Best of up to `repeats` timed calls after one warm-up; stops early once `budget_s` is spent (slow dtypes)."""
    fn()  # warm-up: first-call allocation and kernel selection
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > budget_s:
            break
    return best


@torch.inference_mode()
def measure_machine(model, device: str = "cpu", dtype: torch.dtype | None = None, repeats: int = 3,
                    matmul_size: int | None = None, target_s: float = 0.2, budget_s: float = 2.0) -> MachineRates:
    """Read rate (the floor's): on a CPU a streaming read kernel over buffers of 1 MiB to READ_BYTES with the engine's
    threads (measure_read_rates); on a GPU a device copy of READ_BYTES, bytes read + written. Beside it, not pricing
    anything: the rate torch's GEMV reaches (a bare F.linear at batch 1 over every nn.Linear weight of `model`, all
    weight bytes / best time) and a copy's. Matmul rate: one n^3 product in the model's dtype, 2 n^3 / best time,
    n = matmul_size (default: 2048 on a CPU, 8192 on a GPU, where a 2048^3 bf16 product reached 250 of an H100's
    ~700 TFLOP/s) or smaller where one product would take longer than target_s; or the FLOP rate those GEMVs
    reached where that is higher (bf16 on a CPU without bf16 units: GEMM ~1.4, GEMV ~18 GFLOP/s), since a ceiling
    below a rate the machine reached would put MFU over 100%."""
    dtype = model_dtype(model, dtype)
    gemv_s, streamed, count, elements = measure_gemv(model, device, dtype, repeats, budget_s)
    largest = matmul_size or (8192 if torch.device(device).type == "cuda" else 2048)
    n = matmul_size_for(dtype, device, largest, target_s)
    square = 2 * n**3 / measure_square(n, device, dtype, repeats, budget_s)
    gemv_flops = 2 * elements / gemv_s
    copy = measure_copy_bandwidth(device, READ_BYTES if torch.device(device).type == "cuda" else 2**28)
    read_rates = measure_read_rates() if torch.device(device).type == "cpu" else None
    read, read_how = ((read_rates.rates[-1], f"read: {read_rates.how}") if read_rates is not None else
                      (copy, f"read: a device copy of {READ_BYTES >> 20} MiB, bytes read + written"))
    name = str(dtype).removeprefix("torch.")
    how = (f"{read_how}; torch's GEMV: F.linear at batch 1 over the {count} linear weights of "
           f"{model.config.name} ({streamed / 1e6:.1f} MB), {streamed / gemv_s / 1e9:.1f} GB/s, best of {repeats}; "
           f"matmul: the higher of a {n}^3 product ({square / 1e9:.1f} GFLOP/s, best of up to {repeats}) and those "
           f"GEMVs ({gemv_flops / 1e9:.1f} GFLOP/s); {torch.get_num_threads()} threads")
    return MachineRates(read, max(square, gemv_flops), name, str(device), how, read_rates=read_rates,
                        gemv_bytes_per_s=streamed / gemv_s, copy_bytes_per_s=copy)


def measure_gemv(model, device: str, dtype: torch.dtype, repeats: int, budget_s: float) -> tuple[float, int, int, int]:
    """A bare F.linear at batch 1 over every nn.Linear weight of `model` (a decode step's GEMVs with nothing else):
    (best seconds, weight bytes, weights, weight elements)."""
    weights = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}.values())
    if not weights:
        raise ValueError("the model has no nn.Linear weights to stream")
    weights = [w.detach().to(device=device, dtype=dtype) for w in weights]
    inputs = [torch.randn(1, w.shape[1], device=device).to(dtype) for w in weights]  # a fresh vector per shape

    def stream():
        for w, x in zip(weights, inputs):
            F.linear(x, w)

    seconds = best_time(stream, device, repeats, budget_s)
    return seconds, sum(w.nbytes for w in weights), len(weights), sum(w.numel() for w in weights)


def measure_square(n: int, device: str, dtype: torch.dtype, repeats: int, budget_s: float) -> float:
    """Best seconds of one n^3 product in `dtype`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return best_time(lambda: a @ b, device, repeats, budget_s)


READ_BYTES = 2**30  # the largest working set: past any cache this project's machines have
READ_SMALLEST = 2**20  # the smallest: L2-sized, where a tiny model's step lives


def read_buffer() -> torch.Tensor:
    """READ_BYTES of ones on the CPU, written once so every page is mapped before a pass is timed; in 2 MiB pages where
    the kernel grants them (kernels/cpu_memory.py), as an engine's weights lie: a 4 KiB-page buffer's rate depends on
    where its pages land (25-46 GB/s from one allocation to the next on the 2-core EPYC VM, 31-35 in 2 MiB pages)."""
    return cpu_memory.huge_page_bytes(READ_BYTES).fill_(1)


def read_pass(buffer: torch.Tensor) -> None:
    """Read every byte of `buffer` once: the C streaming kernel with the engine's threads, or torch's sum where the
    kernels did not build (slower: a floor priced by it is too high, and says so in `how`)."""
    if cpu_decode.cpu_kernels_available():
        cpu_decode.read_bandwidth(buffer, torch.get_num_threads())
    else:
        buffer.view(torch.int64).sum()


def measure_read_rates(repeats: int = 5, budget_s: float = 1.0, buffer: torch.Tensor | None = None,
                       also: tuple[int, ...] = ()) -> ReadRates:
    """The CPU's read rate at working sets of READ_SMALLEST to READ_BYTES (powers of two) and at the sizes in `also`
    (a step's own bytes: exact where a power of two on either side of it would be too slow or too fast), each the best
    of up to `repeats` passes after a warm-up pass, over `buffer` (READ_BYTES; default: a fresh read_buffer())."""
    if buffer is None:
        buffer = read_buffer()
    elif buffer.nbytes != READ_BYTES:
        raise ValueError(f"a read sweep needs a buffer of {READ_BYTES} bytes (read_buffer()), got {buffer.nbytes}")
    if bad := [size for size in also if not 64 <= size <= READ_BYTES]:
        raise ValueError(f"read sweep sizes must be 64 to {READ_BYTES} bytes, got {bad}")
    sizes = {size // 64 * 64 for size in also}  # whole lines: the read kernel reads 64-byte lines
    size = READ_SMALLEST
    while size <= READ_BYTES:
        sizes.add(size)
        size *= 2
    sizes = sorted(sizes)
    rates = tuple(size / best_time(lambda: read_pass(buffer[:size]), "cpu", repeats, budget_s) for size in sizes)
    kernel = "archzoo's streaming read kernel" if cpu_decode.cpu_kernels_available() else "torch's sum (no C kernel)"
    how = (f"{kernel}, {torch.get_num_threads()} threads, best of {repeats} passes: "
           f"{rates[-1] / 1e9:.1f} GB/s over {READ_BYTES >> 20} MiB, {max(rates) / 1e9:.1f} GB/s at most "
           f"({sizes[rates.index(max(rates))] >> 20} MiB); a step is priced at the rate for its bytes")
    return ReadRates(tuple(sizes), rates, how)


def measure_read_rate(repeats: int = 3) -> float:
    """The read rate past any cache alone (bytes/s): what a benchmark checks at its start and end."""
    buffer = read_buffer()
    return READ_BYTES / best_time(lambda: read_pass(buffer), "cpu", repeats, budget_s=1.0)


def tensors_read_rate(tensors, repeats: int = 5) -> float:
    """The rate (bytes/s) the memory `tensors` lie in is read at: the read kernel over each in turn in one call
    (cpu_decode.read_buffers, the engine's threads), the median of `repeats` passes after an untimed one. Not the
    floor's: on a VM the rate memory reads at depends on where its pages land (a fresh 1 GiB buffer measured 25-46
    GB/s from one allocation to the next, a model's long-lived weights 23-30 beside it), so this says how much of a
    step's distance from its floor lies in its memory, not its kernels."""
    tensors = list({t.data_ptr(): t for t in tensors}.values())  # a tied weight once
    nbytes = sum(t.nbytes // 64 * 64 for t in tensors)
    passes = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        cpu_decode.read_buffers(tensors, torch.get_num_threads())
        passes.append(time.perf_counter() - start)
    return nbytes / statistics.median(passes[1:])


DISTURBANCE = 0.15  # two read rates this far apart: the machine changed between them


def rate_change(first_bytes_per_s: float, second_bytes_per_s: float) -> float:
    """How far apart two read rates are, as a share of the higher."""
    return abs(second_bytes_per_s - first_bytes_per_s) / max(first_bytes_per_s, second_bytes_per_s)


def moved(first_bytes_per_s: float, second_bytes_per_s: float, tolerance: float = DISTURBANCE) -> bool:
    """Whether the read rate moved more than `tolerance` between two readings (before and after a cell's steps)."""
    return rate_change(first_bytes_per_s, second_bytes_per_s) > tolerance


def disturbance(start_bytes_per_s: float, end_bytes_per_s: float, tolerance: float = DISTURBANCE) -> str:
    """The read rate at a run's start and end, and whether they differ by more than `tolerance`: a machine busy with
    other work part of the time makes a run's figures noise (OpenMP GEMMs slow 10-100x when a core is taken)."""
    line = f"read rate at start {start_bytes_per_s / 1e9:.1f} GB/s, at end {end_bytes_per_s / 1e9:.1f} GB/s"
    change = rate_change(start_bytes_per_s, end_bytes_per_s)
    if change > tolerance:
        return f"{line}: DISTURBED (they differ by {change:.0%} > {tolerance:.0%}); treat this run's figures as noise"
    return f"{line}: steady (within {tolerance:.0%})"


def matmul_size_for(dtype: torch.dtype, device: str, largest: int, target_s: float) -> int:
    """The square size whose product takes about target_s (from a timed 256^3 probe), between 512 and `largest`: a
    CPU without bf16 units multiplies bf16 at ~1 GFLOP/s, where one 2048^3 product takes a minute."""
    probe = 256
    a = torch.randn(probe, probe, device=device).to(dtype)
    rate = 2 * probe**3 / best_time(lambda: a @ a, device, repeats=3, budget_s=0.1)
    size = int((target_s * rate / 2) ** (1 / 3)) // 64 * 64
    return max(min(512, largest), min(largest, size))
