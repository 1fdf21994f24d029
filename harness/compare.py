"""`zoo compare`: every architecture x context x batch cell through the same engine, measured and written as it goes."""
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from functools import partial
from itertools import groupby
from pathlib import Path

import torch
from tqdm import tqdm

import zoo
from harness.compare_diffusion import (CACHE_MODES, default_block_length, default_steps, measure_diffusion_cell,
                                       prompts_for)
from harness import roofline
from harness.engine.cache_pool import LAYOUTS
from harness.compare_device import DeviceDefaults, device_defaults, is_cuda, skip_reason
from harness.decode_probe import DecodeProbe, fill_random
from harness.engine.decode_stats import DecodeStats
from harness.engine import Engine
from harness.metrics import summarize
from harness.quant_calibration import Calibration, awq_quantize
from harness.results import ResultStore, check_output_folder
from harness.engine.sampling import SamplingParams
from harness.train.trained import TrainedModel, read_trained, validation_set
from zoo import checks
from zoo.quantize import WEIGHT_SCHEMES
from cache import KV_FORMATS
from cache.retention import SCORES

# The fields that identify a cell: a re-run skips rows that match on all of them.
CELL_KEY = ("arch", "preset", "context", "batch", "new_tokens", "dtype", "kv_cache", "device", "block_size",
            "steps", "block_length", "diffusion_cache",  # these three: diffusion cells only (None otherwise)
            "weights",  # the trained checkpoint's folder (None: random weights, as every row before --weights)
            "quant",  # weight quantization, quant_label ("none": as every row before --quant)
            "kv_dtype",  # how per-token caches are stored ("auto": the model's dtype, as every row before --kv-dtypes)
            "measure",  # how the decode step was timed ("generate": as every row before --measure)
            "graphs",  # CUDA graphs asked for: "auto" (the engine's default; every row before --cuda-graphs), on, off
            "kv_policy", "kv_budget")  # eviction by score (zoo.evict) and the share of the context kept ("none", None)
# what an older row lacking a key field had: its cell is found done instead of being run again
KEY_DEFAULTS = {"weights": None, "quant": "none", "kv_dtype": "auto", "measure": "generate", "graphs": "auto",
                "kv_policy": "none", "kv_budget": None}
KV_POLICIES = ("none", *SCORES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# generate: prefill the prompts, then decode new_tokens (TTFT, TPOT); decode-probe: caches filled at random as if
# prefilled, new_tokens decode steps timed at the context held fixed (no prefill, so no TTFT or TPOT)
MEASURES = ("generate", "decode-probe")
GRAPHS = {"auto": None, "on": True, "off": False}  # a cell's graphs field -> Engine(cuda_graphs=...)
PROBE_WARMUP = 2  # untimed steps: the first of a batch size captures its CUDA graph (and compiles Triton kernels)


@dataclass
class CompareSettings:
    archs: list[str] = field(default_factory=zoo.compare_defaults)  # the registry entries marked compare_default
    # None below: the device's default (device_defaults: CPU_DEFAULTS, or CUDA_DEFAULTS on a CUDA device); a preset
    # left None with weights is the one the checkpoints were trained at
    preset: str | None = None
    contexts: list[int] | None = None
    batches: list[int] | None = None
    new_tokens: int | None = None  # tokens decoded per request (decode-probe: decode steps timed)
    dtype: str | None = None
    kv_cache: str | None = None
    block_size: int = 16
    device: str = "cpu"
    measure: str | None = None  # one of MEASURES
    cuda_graphs: bool | None = None  # None: the engine's default (on for a CUDA model where it can), True, False
    seed: int = 0
    out: Path = Path("results/compare")
    # masked diffusion LMs (e.g. "diffusion") run through the LLaDA sampler instead of the engine, once per
    # steps x cache; None = steps {new_tokens, /4, /16} and 32-token blocks (or one block)
    diffusion_steps: list[int] | None = None
    block_length: int | None = None
    diffusion_caches: list[str] = field(default_factory=lambda: list(CACHE_MODES))
    # a folder of `zoo train` outputs, one per architecture named by it (DIR/gqa, ...): those trained models instead
    # of random weights, each row with its validation bits per byte and training budget (harness/train/trained.py)
    weights: Path | None = None
    # weight-only quantization per model (zoo.quantize): "none", "int8", "int4" (groups of quant_group input columns),
    # rounded by quant_method ("rtn", or "awq" calibrated on windows of the training corpus)
    quant: list[str] = field(default_factory=lambda: ["none"])
    quant_group: int = 128
    quant_method: str = "rtn"
    kv_dtypes: list[str] = field(default_factory=lambda: ["auto"])  # per-token cache storage: auto, int8, fp8 (the engine's)
    # KV eviction by score (zoo.evict): "none" or a policy (h2o, tova, snapkv), each run keeping every kv_budgets
    # share of a cell's context (its attention layers' budget: round(share * context) tokens a sequence)
    kv_policies: list[str] = field(default_factory=lambda: ["none"])
    kv_budgets: list[float] = field(default_factory=lambda: [0.25])
    # each model's cells as one Ray task holding a whole machine, on the cluster at this address ("auto": the one this
    # machine is in; "local": a new instance here); weights (and their corpus) must be at the same path on every node
    ray: str | None = None

    def __post_init__(self):
        self.fill_device_defaults()
        # the diffusion defaults are derived from these two, so they are checked first
        checks.integer("new_tokens (TPOT needs two tokens)", self.new_tokens, minimum=2)
        if self.block_length is None:
            self.block_length = default_block_length(self.new_tokens)
        checks.integer("block_length", self.block_length, minimum=1)
        if self.diffusion_steps is None:
            self.diffusion_steps = default_steps(self.new_tokens, self.block_length)

    def fill_device_defaults(self) -> None:
        """The one place a default depends on the device: each setting left None takes the device's value, so a
        value the caller gave always wins. Without weights the preset too (with them, the checkpoints decide)."""
        defaults = device_defaults(self.device)
        for name in (f.name for f in fields(DeviceDefaults) if f.name != "preset"):
            if getattr(self, name) is None:
                value = getattr(defaults, name)
                setattr(self, name, list(value) if isinstance(value, tuple) else value)
        if self.preset is None and self.weights is None:
            self.preset = defaults.preset

    @property
    def graphs(self) -> str:
        """The cells' graphs field: what was asked of the engine."""
        return next(name for name, value in GRAPHS.items() if value is self.cuda_graphs)

    def validate(self) -> dict[str, TrainedModel]:
        """Every bad setting is reported before any model is built; returns the trained models (none without
        weights), whose preset becomes the comparison's."""
        if not self.archs:
            raise ValueError(f"no architectures to compare (archs is empty); allowed: {', '.join(zoo.architectures())}")
        for arch in self.archs:
            zoo.registry.check_architecture(arch)
        if self.preset is not None:
            zoo.presets.preset_settings(self.preset)
        checks.choice("dtype", self.dtype, DTYPES)
        checks.integer_list("contexts", self.contexts, minimum=1)
        checks.integer_list("batches", self.batches, minimum=1)
        checks.choice("kv_cache", self.kv_cache, LAYOUTS)
        checks.power_of_two("block_size", self.block_size)  # the engine's rule, checked before any model is built
        checks.integer("seed", self.seed, minimum=0, maximum=2**64 - 1)  # what torch.manual_seed takes
        checks.device("device", self.device)
        checks.choice("measure", self.measure, MEASURES)
        self.validate_graphs()
        self.validate_ray()
        check_output_folder(self.out)
        trained = {} if self.weights is None else read_trained(self.weights, self.archs, self.preset)
        if trained:
            self.preset = next(iter(trained.values())).preset
        limits = [(t.config.max_seq_len, f"{a}'s checkpoint's") for a, t in trained.items()] or [
            (zoo.PRESETS[self.preset].max_seq_len, f"the {self.preset!r} preset's")]
        for limit, whose in limits:
            if max(self.contexts) + self.new_tokens > limit:
                raise ValueError(f"context {max(self.contexts)} + new_tokens {self.new_tokens} exceeds {whose} "
                                 f"max_seq_len={limit}")
        if any(not zoo.is_causal(a) for a in self.archs):
            self.validate_diffusion()
        self.validate_quant(trained)
        if not isinstance(self.kv_dtypes, (list, tuple)) or not self.kv_dtypes:
            raise ValueError(f"kv_dtypes must be a non-empty list of {', '.join(KV_FORMATS)}, got {self.kv_dtypes!r}")
        for kv_dtype in self.kv_dtypes:
            checks.choice("kv_dtype", kv_dtype, KV_FORMATS)
        self.validate_eviction(trained)
        if any(k != "auto" for k in self.kv_dtypes):
            for arch in self.archs:
                config = trained[arch].config if trained else zoo.make_config(arch, self.preset)
                with torch.device("meta"):
                    if not any(spec.elements_per_token for spec in zoo.DecoderLM(config).cache_specs()):
                        quantized = ",".join(k for k in self.kv_dtypes if k != "auto")
                        raise ValueError(f"kv_dtype {quantized}: {arch!r} keeps no per-token cache, only recurrent "
                                         f"state, which stays in its declared dtype; leave it out of a quantized KV "
                                         f"comparison")
        return trained

    def validate_eviction(self, trained: dict[str, TrainedModel]) -> None:
        """Each policy is known, each budget a share of the context in (0, 1], and each architecture has attention
        layers to evict from (checked on a meta model, before any work)."""
        if not isinstance(self.kv_policies, (list, tuple)) or not self.kv_policies:
            raise ValueError(f"kv_policies must be a non-empty list of {', '.join(KV_POLICIES)}, got "
                             f"{self.kv_policies!r}")
        for policy in self.kv_policies:
            checks.choice("kv_policy", policy, KV_POLICIES)
        if self.kv_policies == ["none"]:
            return
        if not isinstance(self.kv_budgets, (list, tuple)) or not self.kv_budgets:
            raise ValueError(f"kv_budgets must be a non-empty list of shares of the context in (0, 1], got "
                             f"{self.kv_budgets!r}")
        for share in self.kv_budgets:
            if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
                raise ValueError(f"kv_budget {share!r} is not a share of the context: give a number in (0, 1], "
                                 f"e.g. 0.25 to keep a quarter of it")
        if any(k != "auto" for k in self.kv_dtypes):
            raise ValueError(f"kv_dtypes {','.join(self.kv_dtypes)} with kv_policies: an evicting cache keeps rows "
                             f"in the model's dtype; run them as separate comparisons")
        for arch in self.archs:
            with torch.device("meta"):
                model = zoo.DecoderLM(trained[arch].config if trained else zoo.make_config(arch, self.preset))
            try:
                zoo.evict(model, policy=next(p for p in self.kv_policies if p != "none"),
                          budget=eviction_budget(min(self.kv_budgets), min(self.contexts)))
            except ValueError as error:
                raise ValueError(f"kv_policies {','.join(self.kv_policies)}: {arch}: {error}") from None

    def validate_graphs(self) -> None:
        """cuda_graphs=True where the engine could not capture is refused here, before any model is built."""
        if self.cuda_graphs not in GRAPHS.values():
            raise ValueError(f"cuda_graphs must be None (the engine's default: on for CUDA), True or False, got "
                             f"{self.cuda_graphs!r}")
        if self.cuda_graphs is True and not is_cuda(self.device):
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device {self.device!r}")

    def validate_ray(self) -> None:
        if self.ray is None:
            return
        if not isinstance(self.ray, str) or not self.ray:
            raise ValueError(f"ray must be a cluster address, 'auto' or 'local', got {self.ray!r}")
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"ray={self.ray!r} needs Ray installed: pip install -e '.[ray]'")
        if is_cuda(self.device) and torch.device(self.device).index:  # Ray shows a task only the GPU it holds
            raise ValueError(f"with ray each task holds one GPU, which it sees as cuda:0; pass device 'cuda', "
                             f"not {self.device!r}")

    def validate_quant(self, trained: dict[str, TrainedModel]) -> None:
        """Each scheme is known and fits every model's layer widths (checked on shapes alone, before any work)."""
        if not isinstance(self.quant, (list, tuple)) or not self.quant:
            raise ValueError(f"quant must be a non-empty list of {', '.join(QUANT_CHOICES)}, got {self.quant!r}")
        for scheme in self.quant:
            checks.choice("quant", scheme, QUANT_CHOICES)
        for config in filter(None, (quant_config(scheme, self) for scheme in self.quant)):
            for arch in self.archs:
                with torch.device("meta"):
                    model = zoo.DecoderLM(trained[arch].config if trained else zoo.make_config(arch, self.preset))
                try:
                    zoo.quantize_layers(model, config)
                except ValueError as error:
                    raise ValueError(f"{arch}: {error}") from None

    def validate_diffusion(self) -> None:
        if self.new_tokens % self.block_length:
            raise ValueError(f"block_length={self.block_length} must divide new_tokens={self.new_tokens}")
        blocks = self.new_tokens // self.block_length
        bad = [s for s in self.diffusion_steps if not checks.is_integer(s) or s < 1 or s % blocks]
        if not self.diffusion_steps or bad:
            raise ValueError(f"diffusion steps {bad or self.diffusion_steps} not allowed: each must be a positive "
                             f"multiple of the block count new_tokens / block_length = {blocks}")
        unknown = [c for c in self.diffusion_caches if c not in CACHE_MODES]
        if not self.diffusion_caches or unknown:
            raise ValueError(f"unknown diffusion cache {unknown or self.diffusion_caches}; allowed: {', '.join(CACHE_MODES)}")

    def cells(self, trained: dict[str, TrainedModel] | None = None) -> list[dict]:
        common = {"preset": self.preset, "new_tokens": self.new_tokens, "dtype": self.dtype,
                  "kv_cache": self.kv_cache, "device": self.device, "block_size": self.block_size}
        autoregressive = {"steps": None, "block_length": None, "diffusion_cache": None, "measure": self.measure,
                          "graphs": self.graphs}
        cells = []
        for a in self.archs:
            weights = str(trained[a].folder) if trained else None
            for quant in (quant_label(scheme, self) for scheme in self.quant):
                model = {"weights": weights, "quant": quant}
                for c in self.contexts:
                    for b in self.batches:
                        if zoo.is_causal(a):
                            evictions = [(p, share) for p in self.kv_policies
                                         for share in ([None] if p == "none" else self.kv_budgets)]
                            cells += [{"arch": a, "context": c, "batch": b, **common, **autoregressive, **model,
                                       "kv_dtype": kv_dtype, "kv_policy": policy, "kv_budget": share}
                                      for kv_dtype in self.kv_dtypes for policy, share in evictions]
                        else:  # no-cache first: cached cells measure their agreement against it
                            cells += [{"arch": a, "context": c, "batch": b, **common, **model, "kv_dtype": "auto",
                                       "kv_policy": "none", "kv_budget": None,
                                       "steps": s, "block_length": self.block_length, "diffusion_cache": cache,
                                       **DIFFUSION_RUN}
                                      for s in self.diffusion_steps for cache in self.diffusion_caches]
        return cells


QUANT_CHOICES = ("none", *WEIGHT_SCHEMES)


def eviction_budget(share: float, context: int) -> int:
    """Tokens an evicting layer keeps for a cell: the share of its context, at least 2 (H2O splits it in halves)."""
    return max(2, round(share * context))
# a diffusion cell runs the LLaDA sampler, never the engine's decode step: its measure and graphs stay the old defaults
DIFFUSION_RUN = {"measure": "generate", "graphs": "auto"}


def quant_config(scheme: str, settings: CompareSettings) -> zoo.QuantizeConfig | None:
    if scheme == "none":
        return None
    return zoo.QuantizeConfig(scheme, group_size=settings.quant_group, method=settings.quant_method)


def quant_label(scheme: str, settings: CompareSettings) -> str:
    """What a row's quant field says: "none", "int8" or "int8/awq", "int4/g128" or "int4/g128/awq"."""
    config = quant_config(scheme, settings)
    if config is None:
        return "none"
    group = f"/g{config.group_size}" if config.weights == "int4" else ""
    return f"{config.weights}{group}{'/awq' if config.method == 'awq' else ''}"


def quantized(model, scheme_label: str, settings: CompareSettings, corpus: str | None = None):
    """The model quantized as the cell's label says; AWQ is calibrated on the training split of the model's training
    corpus (`corpus`; None: the standard library), never on the validation windows it is scored on."""
    scheme = scheme_label.split("/")[0]
    config = quant_config(scheme, settings)
    if config is None:
        return model
    if config.method == "awq":
        return awq_quantize(model, config, corpus, replace(AWQ_CALIBRATION, seed=settings.seed), settings.device)
    return zoo.quantize(model, config)


# a compare cell calibrates on 2,048 bytes and judges by 32 greedy runs of 64 tokens, to stay a small share of a run
AWQ_CALIBRATION = Calibration(windows=8, prompts=32, new_tokens=64)


def build_model(arch: str, settings: CompareSettings):
    """Built on its device: a large model initialised on the CPU and copied over takes seconds per architecture."""
    torch.manual_seed(settings.seed)
    with torch.device(settings.device):
        model = zoo.build(arch, preset=settings.preset)
    return model.to(dtype=DTYPES[settings.dtype]).eval()


def load_trained(trained: TrainedModel, settings: CompareSettings):
    return zoo.load(trained.folder, settings.device).to(dtype=DTYPES[settings.dtype])


def measure_cell(model, cell: dict, rates: roofline.MachineRates, seed: int,
                 read_buffer: torch.Tensor | None = None) -> dict:
    """Time the cell's decode steps as its measure says (generate: prefill `batch` prompts of `context` tokens
    together, decode `new_tokens` each; decode-probe: `new_tokens` steps at `context` without the prefill); times and
    bytes, whether CUDA graphs ran, and the roofline floor of the median decode step beside it. With a read buffer
    (a CPU run's), the floor is priced at the read rates swept just before and after the steps (the higher), not the
    run's: a VM's memory reads at rates that change from one minute to the next (31-35 GB/s, then 49-56 for a while,
    on the 2-core EPYC), and a floor priced at another minute's rate says more about that minute than the step."""
    max_seq_len = cell["context"] + cell["new_tokens"]
    if cell["kv_policy"] != "none":
        model = zoo.evict(model, policy=cell["kv_policy"], budget=eviction_budget(cell["kv_budget"], cell["context"]))
    engine = Engine(model, max_batch=cell["batch"], max_seq_len=max_seq_len, kv_cache=cell["kv_cache"],
                    block_size=cell["block_size"], kv_dtype=cell["kv_dtype"], cuda_graphs=GRAPHS[cell["graphs"]])
    timed = timed_generate if cell["measure"] == "generate" else timed_probe
    step_bytes = min(roofline.decode_step_cost(model, cell["batch"], floor_context(cell),
                                               kv_format=cell["kv_dtype"]).bytes, roofline.READ_BYTES)
    before = cell_read_rates(read_buffer, step_bytes)
    times, step_s = timed(engine, cell, model.config.vocab_size, seed)
    around = None if before is None else (before, cell_read_rates(read_buffer, step_bytes))
    experts_read = zoo.decode_experts_read(engine.model)  # MoE: distinct experts each timed step read, per layer
    return {
        **cell,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": zoo.parameter_bytes(model),  # as stored: a quantized model's payload and scales
        "analytic_cache_bytes": zoo.cache_bytes(model, seq_len=max_seq_len, batch=cell["batch"], kv_format=cell["kv_dtype"]),
        "measured_cache_bytes": engine.cache_bytes_allocated,
        "cache_bytes_per_token": zoo.cache_bytes(model, seq_len=1, kv_format=cell["kv_dtype"]),
        **times,
        **floor_fields(model, cell, step_s, rates, experts_read, around),
        **routing_fields(engine.model, cell["batch"], experts_read),
        "cuda_graphs": engine.cuda_graphs,
        "cuda_graphs_off": engine.cuda_graphs_off,
        "graph_bytes": engine.graph_bytes,  # after the steps: graphs are captured on a batch size's first step
    }


def timed_generate(engine: Engine, cell: dict, vocab: int, seed: int) -> tuple[dict, float]:
    """The cell's prompts through engine.generate: its latency fields, and the median decode step in seconds."""
    prompts = prompts_for(cell, vocab, seed)
    warm_up(engine, prompts, cell["new_tokens"])
    # No stop tokens: every request runs exactly new_tokens, so cells are comparable.
    params = SamplingParams(max_new_tokens=cell["new_tokens"], temperature=0.0)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    duration = time.perf_counter() - start
    summary = summarize(outputs, duration)
    stats = engine.decode_stats
    step_s = statistics.median(stats.seconds)  # robust to a noisy machine's outliers
    return {
        "ttft_ms": summary["Mean TTFT (ms)"],
        "tpot_ms": summary["Mean TPOT (ms)"],
        "itl_p99_ms": summary["P99 ITL (ms)"],
        "step_ms_p50": 1000 * step_s,
        "decode_tok_s": stats.tokens_per_second,
        "output_tok_s": summary["Output token throughput (tok/s)"],
        "wall_s": duration,
    }, step_s


WARMUP_TOKENS = 3  # a warm-up request's new tokens: its decode steps run at the cell's batch size


def warm_up(engine: Engine, prompts: list[list[int]], new_tokens: int) -> None:
    """Every first call of the cell's shapes before the clock starts (a compiled step's compile, a kernel library's
    build and load, the allocator's first growth): the cell's batch of short prompts prefilled and decoded a few
    steps, then the engine's decode statistics emptied, so no cell's TPOT or ITL holds a first call."""
    params = SamplingParams(max_new_tokens=min(WARMUP_TOKENS, new_tokens), temperature=0.0)
    engine.generate([p[:8] for p in prompts], params)
    engine.decode_stats = DecodeStats()
    zoo.reset_decode_routing(engine.model)


def timed_probe(engine: Engine, cell: dict, vocab: int, seed: int) -> tuple[dict, float]:
    """The cell's prompts admitted as if prefilled, every cache filled at random (harness/decode_probe.py), and
    new_tokens decode steps timed at the context held fixed: a step's cost depends on how many cached values there
    are, not on what they are. No prefill runs, so the latency fields a prefill sets are None."""
    start = time.perf_counter()
    params = SamplingParams(max_new_tokens=cell["new_tokens"], temperature=0.0)
    for prompt in prompts_for(cell, vocab, seed):
        engine.add_request(prompt, params)
    seqs = engine.admit_prefilled()
    if len(seqs) != cell["batch"]:  # the engine was sized for the whole batch: anything less is a bug
        raise RuntimeError(f"the engine admitted {len(seqs)} of {cell['batch']} sequences of {cell['context']} tokens")
    with torch.no_grad():
        fill_random(engine.pool.layers, seed)
    zoo.reset_decode_routing(engine.model)  # the probe's warm-up steps count too: same batch, same shapes
    step_s = DecodeProbe(engine, seqs, cell["context"]).median_step(steps=cell["new_tokens"], warmup=PROBE_WARMUP)
    return {
        "ttft_ms": None,
        "tpot_ms": None,
        "itl_p99_ms": None,
        "step_ms_p50": 1000 * step_s,
        "decode_tok_s": cell["batch"] / step_s,
        "output_tok_s": None,
        "wall_s": time.perf_counter() - start,
    }, step_s


def floor_context(cell: dict) -> int:
    """Tokens cached before the middle decode step. generate: the k-th of the new_tokens - 1 decode steps starts
    from context + k (the first new token comes from the prefill), so this is their mean context, rounded down;
    decode-probe: every step starts from context."""
    if cell["measure"] == "decode-probe":
        return cell["context"]
    return cell["context"] + (cell["new_tokens"] - 2) // 2


def routing_fields(model, batch: int, experts_read: dict[int, float]) -> dict:
    """An MoE model's routing beside its floor: distinct experts a timed decode step read per MoE layer (measured,
    mean over layers and steps), and a uniform router's expectation at this batch; None for a model without MoE."""
    layers = zoo.moe_layers(model)
    if not layers:
        return {"experts_read": None, "experts_read_uniform": None, "n_experts": None}
    expected = [zoo.expected_experts_read(moe.n_experts, moe.top_k, batch) for moe in layers.values()]
    return {"experts_read": sum(experts_read.values()) / len(experts_read) if experts_read else None,
            "experts_read_uniform": sum(expected) / len(expected),
            "n_experts": max(moe.n_experts for moe in layers.values())}


def floor_fields(model, cell: dict, step_s: float, rates: roofline.MachineRates,
                 experts_read: dict[int, float] | None = None,
                 around: tuple[roofline.ReadRates, roofline.ReadRates] | None = None) -> dict:
    """The roofline beside the measurement: the decode step's floor at the cell's batch and mean context (an MoE
    layer's weight bytes those of the experts its timed steps read), and one prompt's prefill floor (the engine
    prefills prompts of 512 tokens or more one after another, so the mean TTFT at batch b waits for about (b + 1) / 2
    of them; shorter ones share a forward). `around`: the read sweeps just before and after the cell's steps, which
    price its floors in place of the run's (the faster of the two at each size), both recorded."""
    step = roofline.decode_step_cost(model, cell["batch"], floor_context(cell), kv_format=cell["kv_dtype"],
                                     experts_read=experts_read or None)
    run_read = rates.stream_bytes_per_s
    reads = {}
    if around is not None:
        before, after = around
        rates = rates.priced_at(before.higher(after))
        reads = {"read_before_gb_s": before.at(step.bytes) / 1e9, "read_after_gb_s": after.at(step.bytes) / 1e9,
                 "read_moved": roofline.moved(before.at(step.bytes), after.at(step.bytes))}
    floor_s = roofline.floor_seconds(step, rates)
    prefill = roofline.prefill_cost(model, 1, cell["context"], kv_format=cell["kv_dtype"])
    return {
        "floor_context": floor_context(cell),
        "floor_ms": 1000 * floor_s,
        "bound": roofline.bound(step, rates),
        "fraction_of_floor": step_s / floor_s,
        "mbu": roofline.mbu(step, step_s, rates),
        "mfu": roofline.mfu(step, step_s, rates),
        "step_weight_bytes": step.weight_bytes,
        "step_cache_read_bytes": step.cache_read_bytes,
        "step_flops": step.flops,
        "prefill_floor_ms": 1000 * roofline.floor_seconds(prefill, rates),
        **rates.row_fields(),
        "stream_gb_s": rates.stream_rate(step.bytes) / 1e9,  # the read rate for this step's bytes: its floor's
        "run_read_gb_s": run_read / 1e9,  # the run's start-of-run rate past any cache, beside the cell's
        **reads,
    }


CELL_READ_REPEATS = 3  # passes a size in a cell's sweeps: two sweeps of ~2 GiB cost ~0.5 s a cell at 31 GB/s


def read_gauge(settings: CompareSettings) -> torch.Tensor | None:
    """The buffer a CPU run's cells sweep their read rates over, held for the run (a fresh one's pages cost a fill
    each time); None on CUDA, where the run's copy rate prices every cell."""
    return None if is_cuda(settings.device) else roofline.read_buffer()


def cell_read_rates(buffer: torch.Tensor | None, step_bytes: int) -> roofline.ReadRates | None:
    """A read sweep over `buffer` at every size the run's sweep has and at the step's own bytes (an MoE step's are
    fewer where its steps read fewer experts: priced at the sizes below them) (None without a buffer)."""
    return None if buffer is None else roofline.measure_read_rates(CELL_READ_REPEATS, buffer=buffer,
                                                                   also=(step_bytes,))


def measure_rates(settings: CompareSettings) -> roofline.MachineRates:
    """The machine's ceilings in this run's dtype and device, once per run, on the preset's gqa weights (a fixed
    reference, so runs over different architectures share a yardstick)."""
    return roofline.measure_machine(build_model("gqa", settings), settings.device)


def rates_for(cells: list[dict], settings: CompareSettings) -> roofline.MachineRates | None:
    """The rates of the machine that measures `cells`, where one needs a floor (a diffusion cell has none)."""
    return measure_rates(settings) if any(not c["steps"] for c in cells) else None


def disturbance_text(rates: roofline.MachineRates | None, settings: CompareSettings) -> str:
    """After the cells, on a CPU: whether the read rate moved since `rates` (a run shared with other work is noise)."""
    if rates is None or is_cuda(settings.device):
        return ""
    return roofline.disturbance(rates.stream_bytes_per_s, roofline.measure_read_rate())


def model_of(cell: dict) -> tuple[str, str]:
    """The model a cell runs on: consecutive cells sharing it share one build, quantization and validation score."""
    return cell["arch"], cell["quant"]


def cell_label(cell: dict) -> str:
    diffusion = f" steps={cell['steps']} cache={cell['diffusion_cache']}" if cell["steps"] else ""
    return f"{cell['arch']} ctx={cell['context']} batch={cell['batch']}{diffusion}"


def measure_cells(cells: list[dict], settings: CompareSettings, trained: dict[str, TrainedModel],
                  rates: roofline.MachineRates | None, on_cell: Callable[[dict], None] = lambda cell: None
                  ) -> Iterator[dict]:
    """Each cell's row as it finishes (the local loop and each Ray task's); on_cell(cell) is told before it runs.
    A model is built (or loaded), quantized and scored once per run of consecutive cells of it."""
    validation = validation_set(trained) if trained else None
    buffer = read_gauge(settings) if rates is not None else None
    current, model, reference, quality = None, None, {}, {}
    for cell in cells:
        on_cell(cell)
        if model_of(cell) != current:
            current, reference = model_of(cell), {}
            arch = cell["arch"]
            model = load_trained(trained[arch], settings) if trained else build_model(arch, settings)
            model = quantized(model, cell["quant"], settings,
                              trained[arch].state["settings"]["corpus"] if trained else None)
            quality = validation.fields(model, trained[arch]) if validation else {}
        if cell["steps"]:
            yield {**measure_diffusion_cell(model, cell, settings.seed, reference), **quality}
        elif skipped := skip_reason(model, cell, settings.device):
            yield {**cell, "skipped": skipped}  # recorded, so a re-run on this device skips it too
        else:
            yield {**measure_cell(model, cell, rates, settings.seed, read_buffer=buffer), **quality}


def measure_model_cells(cells: list[dict], settings: CompareSettings, trained: dict[str, TrainedModel]
                        ) -> Iterator[dict | str]:
    """One model's cells as a Ray task runs them: each row, then a line on whether the machine's read rate moved
    while they ran (none on CUDA)."""
    rates = rates_for(cells, settings)
    yield from measure_cells(cells, settings, trained, rates)
    if text := disturbance_text(rates, settings):
        yield f"{' quant '.join(model_of(cells[0]))} cells: {text}"


def run_compare(settings: CompareSettings, show_progress: bool = True) -> list[dict]:
    """Measure every cell not already in results.jsonl; returns all rows of this settings' cells. With weights,
    each architecture's rows also carry its validation figure, measured once per model. A cell whose cache would
    not fit in the device's free memory is not run: its row holds the reason under "skipped". With settings.ray,
    each model's cells run as a Ray task (harness/compare_ray.py); this process alone writes results.jsonl."""
    trained = settings.validate()
    store = ResultStore(settings.out / "results.jsonl", CELL_KEY, defaults=KEY_DEFAULTS)
    todo = [c for c in settings.cells(trained) if not store.done(c)]
    if todo:
        bar = tqdm(total=len(todo), desc="zoo compare", unit="cell", disable=not show_progress)
        if settings.ray is not None:
            from harness.compare_ray import measure_on_ray  # Ray is an optional extra

            groups = [list(cells) for _, cells in groupby(todo, key=model_of)]
            measure_on_ray(groups, partial(measure_model_cells, settings=settings, trained=trained), settings.ray,
                           settings.device, store, bar)
        else:
            rates = rates_for(todo, settings)
            for row in measure_cells(todo, settings, trained, rates, lambda c: bar.set_postfix_str(cell_label(c))):
                store.append(row)
                bar.update()
            if text := disturbance_text(rates, settings):
                print(text, flush=True)
        bar.close()
    wanted = {store.key(c) for c in settings.cells(trained)}
    return [r for r in store.rows if store.key(r) in wanted]
