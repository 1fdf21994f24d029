"""Everything an Engine's options must satisfy, checked before anything is allocated: each bad value is an error
that names it and what is allowed; and the memory its sizes ask for, priced and checked against the limit
(zoo/resources.py: the free memory, or ZOO_MEMORY_LIMIT) before torch is asked for any of it."""
from dataclasses import dataclass

import torch

from cache import KV_FORMATS
from harness.engine.block_manager import ADMISSIONS, HOST_BYTES_PER_BLOCK, MAX_BLOCKS
from harness.engine.cache_pool import LAYOUTS, MAX_BLOCK_SIZE, pool_bytes, size_cache
from harness.engine.scheduler import HOST_BYTES_PER_SLOT, MAX_BATCH
from harness.engine.speculative import SpeculativeConfig
from harness.engine.speculative.tree import tree_blocker
import zoo
from zoo import checks, resources


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
    block_size = checks.integer("block_size (tokens per paged block)", checks.power_of_two("block_size", block_size),
                                maximum=MAX_BLOCK_SIZE)
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
    if cache_budget_bytes is not None:  # a budget promises the pool memory: more than there is cannot be kept
        resources.check_bytes("the cache budget", cache_budget_bytes, next(model.parameters()).device,
                              "cache_budget_bytes")
    return max_batch, max_seq_len, block_size, num_blocks, cache_budget_bytes, max_num_batched_tokens


def fp8_kernels_missing(device: torch.device) -> bool:
    """Whether a CUDA device is older than sm_89, where Triton has no float8 e4m3 (the CPU kernel decodes it itself)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def scored_retention(model) -> str:
    """The first scored retention among the model's layers, described ("" when none has one)."""
    return next((spec.retention.describe() for spec in model.cache_specs() if spec.retention.scored), "")


def check_scored(model, max_seq_len: int, max_num_batched_tokens: int | None, speculative, kv_dtype: str) -> None:
    """Scored retention (cache/eviction.py) evicts as its layers attend, a whole prompt then one token a step:
    every option that would feed it otherwise is refused here, before any work, as is a budget no sequence of the
    engine can fill (it would never evict: a full cache under another name)."""
    scored = scored_retention(model)
    if not scored:
        return
    largest = max(spec.retention.capacity for spec in model.cache_specs() if spec.retention.scored)
    refusals = [
        (largest >= max_seq_len, f"a layer keeps {largest} tokens a sequence, and max_seq_len={max_seq_len} never "
                                 f"exceeds it, so nothing would be evicted; give a budget below max_seq_len"),
        (max_num_batched_tokens is not None, f"max_num_batched_tokens={max_num_batched_tokens} (chunked prefill): "
                                             f"a prompt is scored whole, so give None"),
        (speculative is not None, "speculative decoding verifies several tokens a step and rolls back, which an "
                                  "eviction cannot undo"),
        (kv_dtype != "auto", f"kv_dtype={kv_dtype!r}: its rows stay in the model's dtype; give 'auto'"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"the model's layers keep tokens by score ({scored}): {why}")


def check_speculative(speculative, model, compile: bool, kv_cache: str, max_seq_len: int) -> int:
    """The lookahead (k) a speculative setting asks the caches for, 0 without one; every reason it cannot run on
    this engine is an error here, before any work."""
    if speculative is None:
        return 0
    if not isinstance(speculative, SpeculativeConfig):
        raise ValueError(f"speculative must be a harness.SpeculativeConfig or None, got {type(speculative).__name__}")
    speculative.check_target(model)
    draft_blocker = tree_blocker(speculative.draft) if speculative.tree_budget is not None else ""
    if draft_blocker:
        raise ValueError(f"tree_budget: the draft scores each depth's tree in one forward, which it cannot: "
                         f"{draft_blocker}")
    if compile:
        raise ValueError("compile=True compiles the one-token decode step, which speculative decoding does not run "
                         "(it verifies k + 1 tokens per step): use one or the other")
    k = speculative.num_speculative_tokens
    blocker = tree_blocker(model) if speculative.tree else ""
    if blocker and not speculative.chain_fallback:
        shape = (f"a tree of {speculative.tree_budget} tokens" if speculative.tree_budget is not None
                 else f"{speculative.chains} chains")
        raise ValueError(f"{shape} make a token tree, which this target cannot verify in one forward: {blocker}; "
                         f"use one chain, or chain_fallback=True to verify the first chain alone")
    written = speculative.width if speculative.tree and not blocker else k  # proposals a verification writes
    if kv_cache == "contiguous":
        # a verification writes its proposals and the newest token into a ring in one step: two in one row would lose
        # one a rollback needs (a draft writes one token a step, which its rollback undoes newest first)
        rings = [spec.retention.rows(max_seq_len + written) for spec in model.cache_specs()
                 if spec.elements_per_token]
        rows = min((r for r in rings if r < max_seq_len + written), default=None)
        if rows is not None and rows < written + 1:
            what = "num_speculative_tokens" if written == k else "the tree's proposed tokens"
            raise ValueError(f"{what}={written}: the target's contiguous ring buffer holds {rows} rows, fewer than "
                             f"the {written + 1} tokens a verification writes; propose fewer than {rows} or use "
                             f"kv_cache='paged'")
    return written


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
        f"scored retention ({scored_retention(model)}) picks its evictions with host reads"
        if scored_retention(model) else "",
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


@dataclass(frozen=True)
class Footprint:
    """The memory an engine's sizes ask for, priced from the cache declarations before anything is allocated."""

    cache: int  # the KV pool and state slots, as CachePool.nbytes measures them (the graphs' spares not counted)
    device: int  # on the model's device: the cache, the graphs' spare slot, blocks and input buffers, a draft's pool
    host: int  # in host memory: the scheduler's and block managers' free lists, the graphs' host copies


def sized_by(kv_cache: str, num_blocks: int | None, cache_budget_bytes: int | None, lookahead: int) -> str:
    """The options that decide the pool's size, for a refusal to tell the user which to lower."""
    if kv_cache == "paged" and num_blocks is not None:
        fields = ["num_blocks", "block_size", "max_batch"]
    elif kv_cache == "paged" and cache_budget_bytes is not None:
        fields = ["cache_budget_bytes", "max_batch"]
    else:
        fields = ["max_batch", "max_seq_len"]
    fields += ["num_speculative_tokens"] if lookahead else []
    return f"{', '.join(fields[:-1])} or {fields[-1]}"


def check_pool(specs, dtype, device, kv_cache: str, max_batch: int, cache_len: int, block_size: int,
               num_blocks: list[int], kv_dtype: str, graphs: bool, speculative, lower: str) -> Footprint:
    """Price every allocation the engine's sizes decide and refuse, naming `lower`, what exceeds the limit (on a GPU
    the device's part and the host's apart), then counts past the engine's bounds; returns the estimate."""
    needs = footprint(specs, dtype, kv_cache, max_batch, cache_len, block_size, num_blocks, kv_dtype, graphs,
                      speculative)
    what = f"the engine's caches ({describe_pool(kv_cache, max_batch, cache_len, block_size, num_blocks)})"
    if torch.device(device).type == "cpu":
        resources.check_bytes(what, needs.device + needs.host, device, lower)
    else:
        resources.check_bytes(what, needs.device, device, lower)
        resources.check_bytes(f"the host bookkeeping of {what}", needs.host, "cpu", lower)
    check_counts(max_batch, num_blocks, lower)
    return needs


def check_counts(max_batch: int, num_blocks: list[int], lower: str) -> None:
    """Counts past what the engine's structures are built for, even where the memory would hold them."""
    if max_batch > MAX_BATCH:
        raise ValueError(f"max_batch={max_batch:,} is more batch slots than an engine runs ({MAX_BATCH:,} at most)")
    if max(num_blocks, default=0) > MAX_BLOCKS:
        raise ValueError(f"{max(num_blocks):,} blocks per cache group are more than int32 block tables can name "
                         f"({MAX_BLOCKS:,} at most): lower {lower}")


def describe_pool(kv_cache: str, max_batch: int, cache_len: int, block_size: int, num_blocks: list[int]) -> str:
    """The sizes a pool was asked for, as a refusal quotes them."""
    if kv_cache == "contiguous":
        return f"kv_cache='contiguous': {max_batch:,} slots of {cache_len:,} tokens"
    if not num_blocks:
        return f"kv_cache='paged': {max_batch:,} slots of recurrent state, no blocks"
    blocks = " and ".join(f"{n:,}" for n in num_blocks)
    return f"kv_cache='paged': {max_batch:,} slots; {blocks} blocks of {block_size} tokens per cache group"


def footprint(specs, dtype, kv_cache: str, max_batch: int, cache_len: int, block_size: int, num_blocks: list[int],
              kv_dtype: str, graphs: bool, speculative) -> Footprint:
    """What the pool (CachePool), the scheduler and block managers, the decode graphs and a draft model's cache
    will allocate for these sizes."""
    cache = pool_bytes(specs, dtype, kv_cache, max_batch, cache_len, block_size, num_blocks, kv_dtype)
    spare = int(graphs)  # a slot and a block per group that padding rows write
    device = pool_bytes(specs, dtype, kv_cache, max_batch + spare, cache_len, block_size,
                        [n + spare for n in num_blocks], kv_dtype)
    host = max_batch * HOST_BYTES_PER_SLOT + sum(num_blocks) * HOST_BYTES_PER_BLOCK
    if graphs:
        inputs = graph_input_bytes(max_batch, [-(-cache_len // block_size)] * len(num_blocks))
        device += inputs
        host += inputs + max_batch * len(num_blocks) * 8  # pinned host copies; a list slot per row per table
    draft_device, draft_host = draft_bytes(speculative, kv_cache, max_batch, cache_len, block_size)
    return Footprint(cache, device + draft_device, host + draft_host)


def graph_input_bytes(rows: int, table_widths: list[int]) -> int:
    """Bytes of the decode graphs' static input buffers (harness/engine/decode_graphs.py StaticInputs): per row a token,
    position and slot (int64), a length (int32), and per cache group a block table row (int32) and a slot (int64)."""
    return rows * (3 * 8 + 4 + sum(4 * width + 8 for width in table_widths))


def draft_bytes(speculative, kv_cache: str, max_batch: int, cache_len: int, block_size: int) -> tuple[int, int]:
    """(device, host) bytes of the draft models' own caches, each sized as harness/engine/speculative/proposers.py
    DraftModel sizes it: room for every slot's worst case. (0, 0) without a draft model."""
    device = host = 0
    step_tokens = 0 if speculative is None else speculative.draft_lookahead + 1
    for draft in () if speculative is None else speculative.drafts:
        if isinstance(draft, str):
            continue
        specs, dtype = draft.cache_specs(), next(draft.parameters()).dtype
        rows = speculative.draft_cache_len(cache_len)
        _, blocks = size_cache(specs, dtype, kv_cache, max_batch, rows, block_size, None, None, step_tokens)
        host += sum(blocks) * HOST_BYTES_PER_BLOCK
        device += pool_bytes(specs, dtype, kv_cache, max_batch, rows, block_size, blocks)
    return device, host
