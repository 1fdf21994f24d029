"""Everything an Engine's options must satisfy, checked before anything is allocated: each bad value is an error
that names it and what is allowed."""
import torch

from cache import KV_FORMATS
from harness.block_manager import ADMISSIONS
from harness.cache_pool import LAYOUTS
from harness.speculative import SpeculativeConfig
import zoo
from zoo import checks


def check_options(model, max_batch, max_seq_len, kv_cache, block_size, num_blocks, cache_budget_bytes, compile,
                  admission, max_num_batched_tokens, prefix_caching, kv_dtype, quantize) -> tuple:
    """The engine's options as validated integers: (max_batch, max_seq_len, block_size, num_blocks,
    cache_budget_bytes, max_num_batched_tokens)."""
    if quantize is not None:
        if not isinstance(quantize, zoo.QuantizeConfig):
            raise ValueError(f"quantize must be a zoo.QuantizeConfig or None, got {type(quantize).__name__}")
        if quantize.method != "rtn":
            raise ValueError(f"Engine(quantize=...) rounds to nearest; method={quantize.method!r} needs calibration "
                             f"text: pass zoo.quantize(model, config, calibration) as the model instead")
    config = model.config
    if not config.causal:  # each position sees later ones: a new token would change every cached key
        raise ValueError(f"{config.name!r} is a masked diffusion LM (non-causal); the engine decodes causal models "
                         f"one token at a time; use harness.DiffusionSampler")
    max_batch = checks.integer("max_batch", max_batch, minimum=1)
    max_seq_len = checks.integer("max_seq_len (the model's max_seq_len at most)",
                                 config.max_seq_len if max_seq_len is None else max_seq_len, 1, config.max_seq_len)
    checks.choice("kv_cache", kv_cache, LAYOUTS)
    block_size = checks.power_of_two("block_size", block_size)
    num_blocks = checks.optional_integer("num_blocks", num_blocks, minimum=1)
    cache_budget_bytes = checks.optional_integer("cache_budget_bytes", cache_budget_bytes, minimum=1)
    checks.boolean("compile", compile)
    checks.choice("admission", admission, ADMISSIONS)
    max_num_batched_tokens = checks.optional_integer("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    if admission != "reserve" and kv_cache != "paged":
        raise ValueError(f"admission={admission!r} needs kv_cache='paged': the contiguous layout gives each "
                         f"request a whole row, so there is nothing to admit optimistically")
    checks.boolean("prefix_caching", prefix_caching)
    checks.choice("kv_dtype", kv_dtype, KV_FORMATS)
    if kv_dtype != "auto" and not any(spec.elements_per_token for spec in model.cache_specs()):
        raise ValueError(f"kv_dtype={kv_dtype!r}: {config.name!r} keeps no per-token cache, only recurrent state, "
                         f"which stays in its declared dtype (rounding would compound over every token)")
    if kv_dtype == "fp8" and fp8_kernels_missing(next(model.parameters()).device):
        raise ValueError(f"kv_dtype='fp8' on CUDA needs compute capability 8.9 or later (Ada, Hopper: float8 e4m3 in "
                         f"hardware, which the Triton decode kernels use); this GPU is "
                         f"{torch.cuda.get_device_capability()}; use kv_dtype='int8'")
    if prefix_caching and kv_cache != "paged":
        raise ValueError("prefix_caching=True needs kv_cache='paged': requests share cached blocks by reference")
    if num_blocks is not None and kv_cache != "paged":
        raise ValueError(f"num_blocks={num_blocks} sizes a paged pool, but kv_cache={kv_cache!r}; the contiguous "
                         f"layout is sized by max_batch or cache_budget_bytes")
    if num_blocks is not None and cache_budget_bytes is not None:
        raise ValueError(f"give num_blocks ({num_blocks}) or cache_budget_bytes ({cache_budget_bytes}), not both: "
                         f"each sizes the paged pool")
    return max_batch, max_seq_len, block_size, num_blocks, cache_budget_bytes, max_num_batched_tokens


def fp8_kernels_missing(device: torch.device) -> bool:
    """Whether a CUDA device is older than sm_89, where Triton has no float8 e4m3 (the CPU kernel decodes it itself)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def check_speculative(speculative, model, compile: bool, kv_cache: str, max_seq_len: int) -> int:
    """The lookahead (k) a speculative setting asks the caches for, 0 without one; every reason it cannot run on
    this engine is an error here, before any work."""
    if speculative is None:
        return 0
    if not isinstance(speculative, SpeculativeConfig):
        raise ValueError(f"speculative must be a harness.SpeculativeConfig or None, got {type(speculative).__name__}")
    speculative.check_target(model)
    if compile:
        raise ValueError("compile=True compiles the one-token decode step, which speculative decoding does not run "
                         "(it verifies k + 1 tokens per step): use one or the other")
    k = speculative.num_speculative_tokens
    if kv_cache == "contiguous":
        # a verification writes k + 1 keys into a ring in one step: two in one row would lose one a rollback needs
        # (a draft writes one token a step, which its rollback undoes newest first, so any ring serves it)
        rings = [spec.retention.rows(max_seq_len + k) for spec in model.cache_specs() if spec.elements_per_token]
        rows = min((r for r in rings if r < max_seq_len + k), default=None)
        if rows is not None and rows < k + 1:
            raise ValueError(f"num_speculative_tokens={k}: the target's contiguous ring buffer holds {rows} rows, "
                             f"fewer than the k + 1 = {k + 1} tokens a verification writes; lower k below {rows} or "
                             f"use kv_cache='paged'")
    return k


def resolve_graph_mode(cuda_graphs, model, compile: bool, speculative) -> tuple[str | None, str]:
    """(the decode runner's graph mode: "capture", "static" or None; why graphs are off, "" when captured).
    cuda_graphs=True where they cannot run is an error naming the reason."""
    if not (cuda_graphs is None or isinstance(cuda_graphs, bool) or cuda_graphs == "static"):
        raise ValueError(f"cuda_graphs must be None (on for CUDA), True, False or 'static', got {cuda_graphs!r}")
    if cuda_graphs is False:
        return None, "cuda_graphs=False"
    device = next(model.parameters()).device
    blockers = [
        f"the model is on {device.type}: CUDA graphs need a CUDA device" if device.type != "cuda" else "",
        "compile=True: the torch.compile'd step runs as compiled" if compile else "",
        "speculative decoding verifies k + 1 tokens a step, eagerly" if speculative is not None else "",
    ]
    static_blockers = [reason for reason in blockers[1:] if reason]
    if cuda_graphs == "static":
        if static_blockers:
            raise ValueError(f"cuda_graphs='static' cannot run here: {static_blockers[0]}")
        return "static", "cuda_graphs='static': the padded step runs eagerly, not captured"
    reasons = [reason for reason in blockers if reason]
    if reasons and cuda_graphs is True:
        raise ValueError(f"cuda_graphs=True cannot run here: {reasons[0]}")
    return (None, reasons[0]) if reasons else ("capture", "")
