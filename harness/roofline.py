"""An analytic roofline per architecture: the bytes and FLOPs one decode step (or one prefill) must cost, from the
model's cache declarations and parameters alone, and the machine's two measured ceilings that turn them into a
floor on time (max of bytes / streaming rate and FLOPs / matmul rate)."""
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import zoo
from cache import specs_read
from harness.metrics import sync

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
class MachineRates:
    """The two ceilings of the roofline, measured on this machine in one dtype."""

    stream_bytes_per_s: float
    matmul_flops_per_s: float
    dtype: str
    device: str
    how: str  # how each rate was measured, for the reader of a results row

    def row_fields(self) -> dict:
        return {"stream_gb_s": self.stream_bytes_per_s / 1e9, "matmul_gflop_s": self.matmul_flops_per_s / 1e9,
                "rates_how": self.how}


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


def attention_flops(own, read, keys: int) -> int:
    """One query's FLOPs in one layer over `keys` keys: q.k over the key width and p.v over the value width for every
    query head (a shared layer uses its own heads and its source's widths; MLA's latent row is both, absorbed)."""
    if read.kind == "state":
        return STATE_FLOPS_PER_ELEMENT * read.state_elements
    return 2 * own.query_heads * (read.head_dim + read.value_dim) * keys


def decode_step_cost(model, batch: int, context: int, dtype: torch.dtype | None = None,
                     kv_format: str = "auto") -> StepCost:
    """One decode step for `batch` sequences holding `context` tokens: it writes the new token's K/V (or rewrites
    its state) and attends over the keys of context + 1 its retention policy keeps; kv_format: how the per-token
    caches are stored (cache.KV_FORMATS), which sets their bytes."""
    if batch < 1 or context < 0:
        raise ValueError(f"batch must be >= 1 and context >= 0, got batch={batch}, context={context}")
    dtype = model_dtype(model, dtype)
    specs = model.cache_specs()
    weights = weight_elements(model)
    keys = context + 1
    write = sum(spec.token_bytes(dtype, kv_format) + spec.state_bytes(dtype) for spec in specs if spec.owns_memory)
    attention = sum(attention_flops(own, read, read.tokens_held(keys)) for own, read in zip(specs, specs_read(specs)))
    return StepCost(weight_bytes=weight_bytes(model, dtype),
                    cache_read_bytes=zoo.cache_read_bytes(model, seq_len=keys, batch=batch, dtype=dtype,
                                                          kv_format=kv_format),
                    cache_write_bytes=batch * write,
                    flops=batch * (2 * weights + attention))


def prefill_cost(model, batch: int, prompt_len: int, dtype: torch.dtype | None = None,
                 kv_format: str = "auto") -> StepCost:
    """`batch` prompts of `prompt_len` tokens from an empty cache. Every weight is applied to every token except the
    head, which the engine applies at the last position only; bytes = weights + the cache written."""
    if batch < 1 or prompt_len < 1:
        raise ValueError(f"batch and prompt_len must be >= 1, got batch={batch}, prompt_len={prompt_len}")
    dtype = model_dtype(model, dtype)
    specs = model.cache_specs()
    weights = weight_elements(model)
    head = model.config.vocab_size * model.config.d_model
    attention = 0
    for own, read in zip(specs, specs_read(specs)):
        if read.kind == "state":
            attention += prompt_len * attention_flops(own, read, 0)
        else:  # per (query, key) pair; MLA counted as its absorbed form (the expanded prefill does fewer)
            attention += attention_flops(own, read, read.retention.causal_pairs(prompt_len))
    return StepCost(weight_bytes=weight_bytes(model, dtype), cache_read_bytes=0,
                    cache_write_bytes=zoo.cache_bytes(model, seq_len=prompt_len, batch=batch, dtype=dtype,
                                                      kv_format=kv_format),
                    flops=batch * (2 * (weights - head) * prompt_len + 2 * head + attention))


def floor_seconds(cost: StepCost, rates: MachineRates) -> float:
    """The roofline: no step is faster than streaming its bytes or computing its FLOPs at the measured rates."""
    return max(cost.bytes / rates.stream_bytes_per_s, cost.flops / rates.matmul_flops_per_s)


def bound(cost: StepCost, rates: MachineRates) -> str:
    """Which ceiling sets the floor."""
    memory = cost.bytes / rates.stream_bytes_per_s
    return "memory" if memory >= cost.flops / rates.matmul_flops_per_s else "compute"


def mbu(cost: StepCost, seconds: float, rates: MachineRates) -> float:
    """Bandwidth utilisation: the step's bytes over its measured time, against the streaming rate."""
    return cost.bytes / seconds / rates.stream_bytes_per_s


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
                    matmul_size: int = 2048, target_s: float = 0.2, budget_s: float = 2.0) -> MachineRates:
    """Streaming rate: a bare F.linear at batch 1 over every nn.Linear weight of `model` (a decode step's GEMVs with
    nothing else), all weight bytes / best time. Matmul rate: one n^3 product in the model's dtype, 2 n^3 / best time,
    n = matmul_size or smaller where one product would take longer than target_s; or the FLOP rate those GEMVs
    reached where that is higher (bf16 on a CPU without bf16 units: GEMM ~1.4, GEMV ~18 GFLOP/s), since a ceiling
    below a rate the machine reached would put MFU over 100%."""
    dtype = model_dtype(model, dtype)
    weights = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}.values())
    if not weights:
        raise ValueError("the model has no nn.Linear weights to stream")
    weights = [w.detach().to(device=device, dtype=dtype) for w in weights]
    inputs = [torch.randn(1, w.shape[1], device=device).to(dtype) for w in weights]  # a fresh vector per shape

    def stream():
        for w, x in zip(weights, inputs):
            F.linear(x, w)

    stream_s = best_time(stream, device, repeats, budget_s)
    n = matmul_size_for(dtype, device, matmul_size, target_s)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    square = 2 * n**3 / best_time(lambda: a @ b, device, repeats, budget_s)
    gemv = 2 * sum(w.numel() for w in weights) / stream_s
    streamed = sum(w.nbytes for w in weights)
    name = str(dtype).removeprefix("torch.")
    how = (f"stream: F.linear at batch 1 over the {len(weights)} linear weights of {model.config.name} "
           f"({streamed / 1e6:.1f} MB), best of {repeats}; matmul: the higher of a {n}^3 product "
           f"({square / 1e9:.1f} GFLOP/s, best of up to {repeats}) and those GEMVs ({gemv / 1e9:.1f} GFLOP/s); "
           f"{torch.get_num_threads()} threads")
    return MachineRates(streamed / stream_s, max(square, gemv), name, str(device), how)


def matmul_size_for(dtype: torch.dtype, device: str, largest: int, target_s: float) -> int:
    """The square size whose product takes about target_s (from a timed 256^3 probe), between 512 and `largest`: a
    CPU without bf16 units multiplies bf16 at ~1 GFLOP/s, where one 2048^3 product takes a minute."""
    probe = 256
    a = torch.randn(probe, probe, device=device).to(dtype)
    rate = 2 * probe**3 / best_time(lambda: a @ a, device, repeats=3, budget_s=0.1)
    size = int((target_s * rate / 2) ** (1 / 3)) // 64 * 64
    return max(min(512, largest), min(largest, size))
