"""`zoo serve-bench`: an open-loop load generator on the engine, in process (no HTTP server: the numbers are the
engine's own). Requests arrive as a Poisson process at each request rate, or N at a time in a closed loop, and each
(architecture x load) cell gives one row of vLLM benchmark_serving figures, written to OUT/results.jsonl as it ends.

The synthetic workload (vLLM's "random" dataset, and its prefix-repetition one): prompt and output lengths are
uniform integers in [len * (1 - range_ratio), len * (1 + range_ratio)], token ids uniform over the vocabulary. With
num_prefixes > 0, each prompt is one of num_prefixes random system prompts of prefix_len tokens (picked at random)
followed by its own suffix_len random tokens. Every draw is seeded, so every cell serves the same requests."""
import asyncio
import random
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

import zoo
from harness.engine.block_manager import ADMISSIONS
from harness.engine import Engine
from harness.metrics import serving_metrics
from harness.results import ResultStore, check_output_folder
from harness.engine.sampling import SamplingParams
from harness.serve_bench_http import run_cell, served_model
from harness.table import table
from zoo import checks

# The fields that identify a cell: a re-run skips rows that match on all of them. The SLOs are among them because
# goodput is counted against them.
CELL_KEY = ("arch", "preset", "request_rate", "concurrency", "num_requests", "input_len", "output_len", "range_ratio",
            "num_prefixes", "prefix_len", "suffix_len", "ttft_slo_ms", "tpot_slo_ms", "admission",
            "max_num_batched_tokens", "prefix_caching", "max_batch", "num_blocks", "seed", "backend")
IN_PROCESS = "engine"  # a row's backend: the engine in this process, or the URL of the server measured
WARMUP_PROMPT_LEN = 8  # shorter than a cache block, so the warm-up leaves nothing in the prefix cache


@dataclass
class ServeBenchSettings:
    archs: list[str] = field(default_factory=lambda: ["gqa", "mla", "swa", "mamba"])  # full, latent, window, state
    preset: str = "small"
    request_rates: list[float] = field(default_factory=lambda: [2.0, 4.0, 8.0])  # req/s: light, near, past CPU capacity
    concurrency: list[int] | None = None  # closed loop with N requests in flight, instead of Poisson arrivals
    num_requests: int = 40  # per cell
    input_len: int = 128  # mean prompt length (random workload)
    output_len: int = 32  # mean output length; every request decodes exactly its drawn length
    range_ratio: float = 0.5  # lengths uniform in [len * (1 - r), len * (1 + r)]
    num_prefixes: int = 0  # > 0: the shared-prefix workload instead of input_len
    prefix_len: int = 256
    suffix_len: int = 32
    ttft_slo_ms: float | None = 250.0  # goodput counts requests meeting every SLO given; None: no such SLO
    tpot_slo_ms: float | None = 50.0
    admission: str = "optimistic"  # vLLM's policy: admit on what the prompt needs now, preempt when the pool runs out
    max_num_batched_tokens: int | None = None  # a token budget per step turns on chunked prefill
    prefix_caching: bool = True  # vLLM V1's default; architectures with a recurrent state turn it off and say why
    max_batch: int = 16
    num_blocks: int | None = None  # None: room for max_batch worst-case requests
    seed: int = 0
    out: Path = Path("results/serve_bench")
    # an OpenAI-compatible server to measure instead of the engine in process (harness/serve_bench_http.py): the
    # model it serves is the one architecture; the engine's own settings above are the server's business
    url: str | None = None

    def validate(self) -> None:
        """Every bad setting is reported, naming the value and what is allowed, before any model is built."""
        if self.url is not None and not (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))):
            raise ValueError(f"url must be an http:// or https:// address of an OpenAI-compatible server, got "
                             f"{self.url!r}")
        if self.url is None and not self.archs:
            raise ValueError(f"no architectures to serve (archs is empty); allowed: {', '.join(causal_archs())}")
        for arch in () if self.url else self.archs:
            if not zoo.is_causal(arch):  # also rejects unknown names, listing every architecture
                raise ValueError(f"{arch!r} is a masked diffusion LM, which the engine cannot serve; allowed: "
                                 f"{', '.join(causal_archs())}")
        zoo.presets.preset_settings(self.preset)
        if self.concurrency is None:
            if not isinstance(self.request_rates, (list, tuple)) or not self.request_rates:
                raise ValueError(f"request_rates must be a non-empty list of rates in req/s, "
                                 f"got {self.request_rates!r}")
            for rate in self.request_rates:
                checks.real("request rate (req/s)", rate, minimum=0, open_min=True)
        else:
            checks.integer_list("concurrency (requests in flight)", self.concurrency, minimum=1)
        checks.integer("num_requests", self.num_requests, minimum=1)
        self.check_concurrency_reachable()
        checks.real("range_ratio", self.range_ratio, minimum=0, maximum=1, open_max=True)
        checks.integer("num_prefixes (0 = the random workload)", self.num_prefixes, minimum=0)
        if self.num_prefixes:
            checks.integer("prefix_len", self.prefix_len, minimum=1)
            checks.integer("suffix_len", self.suffix_len, minimum=1)
        else:
            length_range("input_len", self.input_len, self.range_ratio)
        length_range("output_len", self.output_len, self.range_ratio)
        limit = zoo.PRESETS[self.preset].max_seq_len
        if self.max_prompt_len + self.max_output_len > limit:
            raise ValueError(f"the longest prompt ({self.max_prompt_len} tokens) + the longest output "
                             f"({self.max_output_len}) exceeds the {self.preset!r} preset's max_seq_len={limit}")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            if getattr(self, name) is not None:
                checks.real(name, getattr(self, name), minimum=0, open_min=True)
        checks.choice("admission", self.admission, ADMISSIONS)
        checks.optional_integer("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        checks.boolean("prefix_caching", self.prefix_caching)
        checks.integer("max_batch", self.max_batch, minimum=1)
        checks.optional_integer("num_blocks", self.num_blocks, minimum=1)
        checks.integer("seed", self.seed, minimum=0, maximum=2**64 - 1)  # what torch.manual_seed takes
        check_output_folder(self.out)

    def check_concurrency_reachable(self) -> None:
        """A closed loop never has more requests in flight than the cell serves: a higher concurrency would run as
        num_requests and be recorded as what it did not run."""
        over = [n for n in self.concurrency or () if n > self.num_requests]
        if over:
            raise ValueError(f"concurrency {over} exceeds num_requests={self.num_requests}: at most "
                             f"{self.num_requests} requests are ever in flight; lower concurrency to <= "
                             f"{self.num_requests} or raise num_requests")

    @property
    def max_prompt_len(self) -> int:
        if self.num_prefixes:
            return self.prefix_len + self.suffix_len
        return length_range("input_len", self.input_len, self.range_ratio)[1]

    @property
    def max_output_len(self) -> int:
        return length_range("output_len", self.output_len, self.range_ratio)[1]

    def cells(self) -> list[dict]:
        """One cell per architecture x load; fields a workload does not use are None, so they key no row."""
        shared = bool(self.num_prefixes)
        common = {
            "preset": self.preset, "num_requests": self.num_requests,
            "input_len": None if shared else self.input_len, "output_len": self.output_len,
            "range_ratio": self.range_ratio, "num_prefixes": self.num_prefixes,
            "prefix_len": self.prefix_len if shared else None, "suffix_len": self.suffix_len if shared else None,
            "ttft_slo_ms": self.ttft_slo_ms, "tpot_slo_ms": self.tpot_slo_ms, "admission": self.admission,
            "max_num_batched_tokens": self.max_num_batched_tokens, "prefix_caching": self.prefix_caching,
            "max_batch": self.max_batch, "num_blocks": self.num_blocks, "seed": self.seed,
        }
        loads = ([{"request_rate": None, "concurrency": n} for n in self.concurrency] if self.concurrency is not None
                 else [{"request_rate": float(r), "concurrency": None} for r in self.request_rates])
        if self.url is not None:  # one model, the server's; its engine settings are not ours to record
            common.update(admission=None, max_num_batched_tokens=None, prefix_caching=None, max_batch=None,
                          num_blocks=None, backend=self.url)
            return [{"arch": self.archs[0], **load, **common} for load in loads]
        return [{"arch": arch, **load, **common, "backend": IN_PROCESS} for arch in self.archs for load in loads]


def causal_archs() -> list[str]:
    return [a for a in zoo.architectures() if zoo.is_causal(a)]


def length_range(name: str, mean: int, range_ratio: float) -> tuple[int, int]:
    """The integer lengths [lo, hi] a mean and a range ratio draw from; both ends must be >= 1."""
    checks.integer(name, mean, minimum=1)
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    if lo < 1:
        raise ValueError(f"{name}={mean} with range_ratio={range_ratio} draws lengths from [{lo}, {hi}]; lengths must "
                         f"be >= 1: raise {name} or lower range_ratio")
    return lo, hi


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def workload(settings: ServeBenchSettings, vocab_size: int) -> list[Request]:
    """The seeded synthetic requests (see the module docstring): the same for every architecture and load."""
    rng = random.Random(settings.seed)
    n = settings.num_requests

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(count)]

    if settings.num_prefixes:
        prefixes = [tokens(settings.prefix_len) for _ in range(settings.num_prefixes)]
        prompts = [rng.choice(prefixes) + tokens(settings.suffix_len) for _ in range(n)]
    else:
        lo, hi = length_range("input_len", settings.input_len, settings.range_ratio)
        prompts = [tokens(rng.randint(lo, hi)) for _ in range(n)]
    lo, hi = length_range("output_len", settings.output_len, settings.range_ratio)
    return [Request(prompt, rng.randint(lo, hi)) for prompt in prompts]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Scheduled arrival times in seconds from the start: the first at 0, then exponential gaps of mean 1 / rate
    (a Poisson process). A seed draws the same unit gaps at every rate, so cells differ only in the time scale."""
    rng = random.Random(f"arrivals {seed}")  # its own stream: the workload's draws do not shift the gaps
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(1.0) / rate)
    return times


def finished(events) -> list:
    return [event.finished for event in events if event.finished is not None]


def run_open_loop(engine: Engine, requests: list[Request], params: list[SamplingParams],
                  arrivals: list[float]) -> tuple[list, float]:
    """Add each request when its scheduled time has come, step while there is work, sleep until the next arrival
    when idle. A request's arrival is its scheduled time, so its TTFT counts the wait for the step in flight.
    Returns the outputs and the run's duration."""
    start = time.perf_counter()
    outputs, i = [], 0
    while i < len(requests) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(requests) and arrivals[i] <= now:
            engine.add_request(requests[i].prompt, params[i], arrival=start + arrivals[i])
            i += 1
        if engine.has_unfinished():
            outputs += finished(engine.step_tokens())
        elif i < len(requests):
            time.sleep(arrivals[i] - now)
    return outputs, time.perf_counter() - start


def run_closed_loop(engine: Engine, requests: list[Request], params: list[SamplingParams],
                    concurrency: int) -> tuple[list, float]:
    """Keep `concurrency` requests in flight: the first ones start at once, and each that ends lets the next in."""
    start = time.perf_counter()
    pending = iter(zip(requests, params))
    outputs = []
    for request, p in islice(pending, concurrency):
        engine.add_request(request.prompt, p)
    while engine.has_unfinished():
        done = finished(engine.step_tokens())
        outputs += done
        for request, p in islice(pending, len(done)):
            engine.add_request(request.prompt, p)
    return outputs, time.perf_counter() - start


def build_model(arch: str, settings: ServeBenchSettings):
    torch.manual_seed(settings.seed)
    return zoo.build(arch, preset=settings.preset).eval()


def measure_cell(model, cell: dict, requests: list[Request], max_seq_len: int) -> dict:
    """Serve the workload at the cell's load on a fresh engine (an empty prefix cache), after a warm-up."""
    engine = Engine(model, max_batch=cell["max_batch"], max_seq_len=max_seq_len, kv_cache="paged",
                    num_blocks=cell["num_blocks"], admission=cell["admission"],
                    max_num_batched_tokens=cell["max_num_batched_tokens"], prefix_caching=cell["prefix_caching"])
    # greedy, no stop tokens: each request decodes exactly its drawn output length (vLLM's ignore_eos)
    params = [SamplingParams(max_new_tokens=r.output_len, temperature=0.0) for r in requests]
    for request, p in zip(requests, params):
        engine.make_sequence(request.prompt, p)  # a request the pool cannot hold fails here, not part-way through
    # two short requests batched together: first-call costs (kernel loads, allocations) stay out of the timed run
    warm_up = [[0] * WARMUP_PROMPT_LEN, [1] * WARMUP_PROMPT_LEN]
    engine.generate(warm_up, SamplingParams(max_new_tokens=2, temperature=0.0))
    scheduler = engine.scheduler
    warm_up_tokens, warm_up_cached = scheduler.prompt_tokens, scheduler.cached_prompt_tokens  # left out of the rate
    if cell["concurrency"] is None:
        arrivals = poisson_arrivals(len(requests), cell["request_rate"], cell["seed"])
        outputs, duration = run_open_loop(engine, requests, params, arrivals)
    else:
        outputs, duration = run_closed_loop(engine, requests, params, cell["concurrency"])
    prompt_tokens = scheduler.prompt_tokens - warm_up_tokens
    cached_tokens = scheduler.cached_prompt_tokens - warm_up_cached
    return {
        **cell,
        **serving_metrics(outputs, duration, cell["ttft_slo_ms"], cell["tpot_slo_ms"]),
        "duration": duration,
        "preemptions": sum(o.preemptions for o in outputs),
        "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,  # the engine's rule
        "prefix_caching_off": engine.prefix_caching_off,
    }


def measure_http_cell(cell: dict, requests: list[Request]) -> dict:
    """The cell's load sent to the server at cell["backend"] (harness/serve_bench_http.py)."""
    arrivals = None if cell["concurrency"] is not None else poisson_arrivals(len(requests), cell["request_rate"],
                                                                              cell["seed"])
    outputs, duration = asyncio.run(run_cell(cell["backend"], cell["arch"], requests, arrivals, cell["concurrency"]))
    errors = sorted({o.error for o in outputs if o.error})
    return {**cell, **serving_metrics(outputs, duration, cell["ttft_slo_ms"], cell["tpot_slo_ms"]),
            "duration": duration, "preemptions": None, "prefix_cache_hit_rate": None, "prefix_caching_off": None,
            "errors": errors[:3]}


def run_serve_bench(settings: ServeBenchSettings, show_progress: bool = True) -> list[dict]:
    """Measure every cell not already in results.jsonl; returns all rows of this settings' cells."""
    settings.validate()
    if settings.url is not None:
        settings.archs = [served_model(settings.url)]  # the name its requests ask for
    store = ResultStore(settings.out / "results.jsonl", CELL_KEY, defaults={"backend": IN_PROCESS})
    todo = [c for c in settings.cells() if not store.done(c)]
    requests = workload(settings, zoo.PRESETS[settings.preset].vocab_size)
    max_seq_len = settings.max_prompt_len + settings.max_output_len
    model_arch, model = None, None
    bar = tqdm(todo, desc="zoo serve-bench", unit="cell", disable=not show_progress)
    for cell in bar:
        load = f"{cell['request_rate']} req/s" if cell["concurrency"] is None else f"concurrency {cell['concurrency']}"
        bar.set_postfix_str(f"{cell['arch']} {load}")
        if settings.url is not None:
            store.append(measure_http_cell(cell, requests))
            continue
        if cell["arch"] != model_arch:
            model_arch, model = cell["arch"], build_model(cell["arch"], settings)
        store.append(measure_cell(model, cell, requests, max_seq_len))
    wanted = {store.key(c) for c in settings.cells()}
    return [r for r in store.rows if store.key(r) in wanted]


COLUMNS = [
    ("TTFT p50 / p99 (ms)", ("median_ttft_ms", "p99_ttft_ms"), "{:.0f} / {:.0f}"),
    ("TPOT mean (ms)", "mean_tpot_ms", "{:.1f}"),
    ("ITL p50 / p99 (ms)", ("median_itl_ms", "p99_itl_ms"), "{:.1f} / {:.1f}"),
    ("E2EL p50 (ms)", "median_e2el_ms", "{:.0f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("goodput (req/s)", "request_goodput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.0f}"),
    ("done", "completed", "{}"),
    ("preempted", "preemptions", "{}"),
    ("prefix hit", "prefix_cache_hit_rate", "{:.0%}"),
    ("duration (s)", "duration", "{:.1f}"),
]


def markdown_table(rows: list[dict], archs: list[str]) -> str:
    """One line per cell, architectures in the order asked, load rising; then why prefix caching was off where
    it was."""
    closed = any(r["concurrency"] is not None for r in rows)
    load = ("concurrency", "concurrency", "{}") if closed else ("rate (req/s)", "request_rate", "{:g}")
    lines = table(rows, [("arch", "arch", "{}"), load, *COLUMNS],
                  lambda r: (archs.index(r["arch"]), r["concurrency"] or 0, r["request_rate"] or 0))
    off = {r["arch"]: r["prefix_caching_off"] for r in rows if r["prefix_caching_off"]}
    if off:
        lines += [""] + [f"{arch}: prefix caching off: {why}" for arch, why in off.items()]
    return "\n".join(lines) + "\n"
