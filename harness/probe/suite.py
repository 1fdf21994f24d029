"""`zoo probe`: every architecture trained on each probe task (MAD-Lab's six, parity, S5 / A5) over a learning-rate
x weight-decay grid, at set widths or sized to a state or parameter target; written as it goes, resumable.

A run trains with `zoo recall`'s trainer (harness/recall/train.py: AdamW, cosine, the same convergence verdicts) on
the task's "train" split (every next token, for the recall tasks) and is scored on the "test" split (the probed
positions only). The model is the recall recipe's (2 layers, tied embeddings, no channel mixer); `mlp` adds one
after each sequence mixer, as MAD-Lab's blocks have. Parity trains on lengths up to 40 and is also tested on 40 to 256
("parity-long"): its learning curve and its "solved" (every set above the target accuracy) include that set, so a
run that fits the trained lengths trains on while its length generalisation is still forming (gdn-neg: 0.99 on the
trained lengths at step 100, 0.75 on the long ones).
"""
import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import zoo
from harness.probe.tasks import (BASELINES, CHANGES, DEFAULT_NUM_TRAIN_EXAMPLES, NUM_TEST_EXAMPLES, NUM_TRAIN_EXAMPLES,
                                 Variant, make_examples, variants)
from harness.recall.suite import has_fixed_state, train_in_workers  # zoo recall's process pool
from harness.recall.train import TrainConfig, build_recall_model, label_chance, train_recall
from harness.results import ResultStore, check_output_folder, settings_dict
from zoo import checks

# The fields that identify a run: a re-run skips rows that match on all of them.
RUN_KEY = ("task", "change", "arch", "n_layers", "d_model", "mode", "target", "lr", "weight_decay", "train_examples",
           "test_examples", "batch_size", "min_steps", "max_steps", "mlp", "seed")
MODES = ("fixed", "iso-state", "iso-params")
# the sets a task's model is also tested on, once at the end: length generalisation (Grazzi et al. 2024)
EXTRA_TESTS = {"parity": ("parity-long",)}
TEST_SEED = 1_000_003  # the test sets are the same draw for every run and seed
# widths an iso-state / iso-parameter run may be sized to (each architecture takes those it can build): steps of 8
# up to 128, then about 6% apart
SIZE_CANDIDATES = (*range(8, 129, 8), *range(144, 257, 16), *range(288, 513, 32), *range(576, 1025, 64))
SIZE_TOLERANCE = 2.0  # a target no candidate width reaches within this factor is an error, not a silent mismatch
DATA_BYTES_LIMIT = 8 << 30  # one run's training and test tensors (int64 inputs and labels)


def task_names() -> list[str]:
    return [name for name in BASELINES if name not in {t for extra in EXTRA_TESTS.values() for t in extra}]


def parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def task_variant(spec: str, train_examples: int | None = None) -> Variant:
    """"task" (its baseline) or "task:field=value" (a field of the baseline changed, e.g. MAD-Lab's
    "in-context-recall:vocab_size=64", or "num_train_examples=800"; several joined by '+': "seq_len=64+vocab_size=64");
    train_examples, if given, replaces the baseline's training-set size where the change does not set it."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task {spec!r}: expected a task name or 'task:field=value'; tasks: {', '.join(task_names())}")
    task, _, change = spec.partition(":")
    if task not in task_names():
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(task_names())}")
    base = Variant(task, "baseline", BASELINES[task].validate(),
                   NUM_TRAIN_EXAMPLES.get(task, DEFAULT_NUM_TRAIN_EXAMPLES))
    size = train_examples or base.num_train_examples
    if not change or change == "baseline":
        return dataclasses.replace(base, num_train_examples=size)
    fields = [f.name for f in dataclasses.fields(base.setting)] + ["num_train_examples"]
    values = {}
    for part in change.split("+"):
        name, eq, text = part.partition("=")
        if not eq or name not in fields or name in values:
            raise ValueError(f"task {spec!r}: a change is field=value (several joined by '+'), each field once, "
                             f"a field one of {', '.join(fields)}")
        values[name] = parse_value(text)
    size = checks.integer("num_train_examples", values.pop("num_train_examples", size), minimum=1)
    setting = dataclasses.replace(base.setting, **values).validate()  # a value out of range raises here
    return Variant(task, change, setting, size)


def full_grid(tasks: list[str]) -> list[str]:
    """Every MAD-Lab setting (baseline and changes) of these tasks as task specs; tasks without changes: baseline."""
    return [spec for task in tasks
            for spec in ([f"{task}:{v.change}" for v in variants(task)] if task in CHANGES else [task])]


def vocabulary(setting) -> int:
    """The ids a setting's generator uses (parity: 0, 1 and the pad)."""
    return getattr(setting, "vocab_size", None) or setting.pad + 1


def test_settings(variant: Variant) -> dict:
    """{set name: setting} the run is scored on: the trained setting, then any extra (held-out) ones."""
    return {variant.task: variant.setting, **{name: BASELINES[name] for name in EXTRA_TESTS.get(variant.task, ())}}


@dataclass
class ProbeSettings:
    archs: list[str] = field(default_factory=lambda: ["gqa", "mamba2", "gdn", "gdn-neg"])
    tasks: list[str] = field(default_factory=lambda: ["in-context-recall"])  # task specs (see task_variant)
    d_models: list[int] = field(default_factory=lambda: [64])  # mode "fixed"
    iso_state: list[int] = field(default_factory=list)  # state / KV bytes per sequence each architecture is sized to
    iso_params: list[int] = field(default_factory=list)  # non-embedding parameters each architecture is sized to
    n_layers: int = 2
    # the channel mixer after each sequence mixer: none, as Zoology's recall recipe (MAD-Lab's blocks have one; on
    # CPU budgets a SwiGLU delays attention's induction jump on in-context recall from ~1,300 to ~2,300 steps)
    mlp: str = "none"
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3])
    weight_decays: list[float] = field(default_factory=lambda: [0.0, 0.1])
    train_examples: int | None = None  # None: each task's MAD-Lab size (12,800; memorization 256)
    test_examples: int = NUM_TEST_EXAMPLES
    min_steps: int | None = 300
    max_steps: int = 1000
    batch_size: int = 64
    seeds: list[int] = field(default_factory=lambda: [0])
    device: str = "cpu"
    workers: int | None = None  # None: one per CPU core up to 2 on CPU; 1 on CUDA
    out: Path = Path("results/probe")
    ray: str | None = None

    def __post_init__(self):
        if self.workers is None:
            self.workers = 1 if self.device != "cpu" else max(1, min(2, os.cpu_count() or 1))

    def variants(self) -> list[Variant]:
        return [task_variant(spec, self.train_examples) for spec in self.tasks]

    def validate(self) -> None:
        """Every bad setting is reported before any model trains."""
        if not self.archs:
            raise ValueError(f"no architectures to train (archs is empty); allowed: {', '.join(zoo.architectures())}")
        for arch in self.archs:
            zoo.registry.check_architecture(arch)
            if not zoo.is_causal(arch):
                raise ValueError(f"architecture {arch!r} is not causal; zoo probe trains next-token models")
        if not self.tasks:
            raise ValueError(f"no tasks (tasks is empty); allowed: {', '.join(task_names())}")
        checks.integer_list("d_models", self.d_models, minimum=1, may_be_empty=True)
        checks.integer_list("iso_state", self.iso_state, minimum=1, may_be_empty=True)
        checks.integer_list("iso_params", self.iso_params, minimum=1, may_be_empty=True)
        if not (self.d_models or self.iso_state or self.iso_params):
            raise ValueError("an empty grid: give d_models, iso_state or iso_params")
        for name in ("lrs", "weight_decays"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"{name} must be a non-empty list, got {values!r}")
        for lr in self.lrs:
            checks.real("learning rate", lr, minimum=0, open_min=True)
        for wd in self.weight_decays:
            checks.real("weight decay", wd, minimum=0)
        checks.integer("n_layers", self.n_layers, minimum=1)
        checks.choice("mlp", self.mlp, zoo.config.MLP_KINDS)
        checks.optional_integer("train_examples", self.train_examples, minimum=1)
        for name in ("test_examples", "max_steps", "batch_size", "workers"):
            checks.integer(name, getattr(self, name), minimum=1)
        checks.optional_integer("min_steps", self.min_steps, minimum=1)
        checks.integer_list("seeds", self.seeds, minimum=0, maximum=2**63 - 1)
        checks.device("device", self.device)
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray):
            raise ValueError(f"ray must be a cluster address, 'auto' or 'local', got {self.ray!r}")
        if self.ray is not None and not _ray_installed():
            raise ValueError(f"ray={self.ray!r} needs Ray installed: pip install -e '.[ray]'")
        for variant in self.variants():
            check_data_bytes(variant, self.test_examples)
        self.runs()  # sizes every iso-state / iso-parameter run: an unreachable target fails here
        check_output_folder(self.out)

    def runs(self) -> list[dict]:
        common = {"n_layers": self.n_layers, "test_examples": self.test_examples, "batch_size": self.batch_size,
                  "min_steps": self.min_steps, "max_steps": self.max_steps, "mlp": self.mlp}
        runs = []
        for variant in self.variants():
            for arch in self.archs:
                for mode, target, d_model in self.sizes(arch, variant):
                    for lr in self.lrs:
                        for wd in self.weight_decays:
                            for seed in self.seeds:
                                runs.append({"task": variant.task, "change": variant.change, "arch": arch,
                                             "d_model": d_model, "mode": mode, "target": target, "lr": lr,
                                             "weight_decay": wd, "train_examples": variant.num_train_examples,
                                             **common, "seed": seed})
        return runs

    def sizes(self, arch: str, variant: Variant) -> list[tuple[str, int | None, int]]:
        """(mode, target, d_model) for each width and each target."""
        out = [("fixed", None, d) for d in self.d_models]
        for mode, targets in (("iso-state", self.iso_state), ("iso-params", self.iso_params)):
            out += [(mode, target, sized_width(arch, mode, target, variant, self.n_layers, self.mlp))
                    for target in targets]
        return out


def _ray_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("ray") is not None


def check_data_bytes(variant: Variant, test_examples: int) -> None:
    """A run's int64 inputs and labels, estimated before any tensor is made."""
    sets = test_settings(variant)
    widths = [variant.num_train_examples * variant.setting.width] + [test_examples * s.width for s in sets.values()]
    need = 2 * 8 * sum(widths)
    if need > DATA_BYTES_LIMIT:
        raise ValueError(f"task {variant.task} ({variant.change}): {variant.num_train_examples} training and "
                         f"{test_examples} test examples need {need / 2**30:.1f} GiB of token tensors; the limit is "
                         f"{DATA_BYTES_LIMIT / 2**30:.0f} GiB: use fewer examples")


def probe_config(arch: str, d_model: int, n_layers: int, mlp: str, **kw) -> TrainConfig:
    # the channel mixer twice as wide as the model: small enough for the CPU default, the same rule for every mixer
    overrides = {"mlp": mlp, **({"mlp_hidden": 2 * d_model} if mlp != "none" else {})}
    return TrainConfig(arch=arch, d_model=d_model, n_layers=n_layers, overrides=overrides, **kw)


def model_sizes(arch: str, d_model: int, variant: Variant, n_layers: int, mlp: str) -> tuple[int, int]:
    """(state bytes per sequence at the task's widest test, non-embedding parameters)."""
    seq_len = max(s.width for s in test_settings(variant).values())
    return meta_model_sizes(arch, d_model, seq_len, n_layers, mlp)


@functools.lru_cache(maxsize=4096)
def meta_model_sizes(arch: str, d_model: int, seq_len: int, n_layers: int, mlp: str) -> tuple[int, int]:
    """model_sizes from a model on the meta device (no memory, no weights); the vocabulary changes only the
    embedding, which neither count includes."""
    with torch.device("meta"):
        model = build_recall_model(probe_config(arch, d_model, n_layers, mlp), 16, seq_len)
    state = zoo.cache_bytes(model, seq_len=seq_len, dtype=torch.float32)
    return state, sum(p.numel() for p in model.parameters()) - model.embed.weight.numel()


def sized_width(arch: str, mode: str, target: int, variant: Variant, n_layers: int, mlp: str) -> int:
    """The candidate width whose state bytes (iso-state) or non-embedding parameters (iso-params) come closest to
    target on a log scale; ValueError where none is within SIZE_TOLERANCE of it."""
    best, reached = None, []
    for d_model in SIZE_CANDIDATES:
        try:
            state, params = model_sizes(arch, d_model, variant, n_layers, mlp)
        except ValueError:  # a width this architecture cannot take (heads, groups)
            continue
        value = state if mode == "iso-state" else params
        reached.append(value)
        gap = abs(math.log(value / target)) if value > 0 else math.inf
        if best is None or gap < best[0]:
            best = (gap, d_model)
    if best is None or best[0] > math.log(SIZE_TOLERANCE):
        span = f"{min(reached)}..{max(reached)}" if reached else "none"
        raise ValueError(f"{mode} target {target} for {arch} on {variant.task}: no width in {SIZE_CANDIDATES[0]}.."
                         f"{SIZE_CANDIDATES[-1]} comes within {SIZE_TOLERANCE:g}x of it (reachable: {span})")
    return best[1]


def make_data(run: dict):
    """((train inputs, labels), {set name: (inputs, labels)}) for a run: training data from its seed, test sets
    from TEST_SEED (the same for every run)."""
    variant = task_variant(f"{run['task']}:{run['change']}")
    variant = dataclasses.replace(variant, num_train_examples=run["train_examples"])
    train = make_examples(variant.setting, variant.num_train_examples, run["seed"], split="train")
    tests = {name: make_examples(setting, run["test_examples"], TEST_SEED, split="test")
             for name, setting in test_settings(variant).items()}
    ids = vocabulary(variant.setting)
    for name, (x, y) in [("train", train), *tests.items()]:
        if int(x.max()) >= ids or int(y.max()) >= ids:  # the generator broke its own vocabulary: a bug, not data
            raise RuntimeError(f"{run['task']} {name} set has ids >= its vocabulary {ids}")
    return train, tests


def train_probe(run: dict, settings: ProbeSettings, data, report) -> dict:
    """One run's row (data is unused: each worker makes its run's data from the run's seed, cheaper than
    shipping it); report(text) is told the step and the test accuracy after every evaluation."""
    label = run_label(run)
    report(label)
    train, tests = make_data(run)
    variant = task_variant(f"{run['task']}:{run['change']}")

    def progress(event: dict) -> None:
        if "eval" in event:
            report(f"{label} step {event['step']}/{event['max_steps']} acc {event['eval'][run['task']]:.3f}")

    config = probe_config(run["arch"], run["d_model"], run["n_layers"], run["mlp"], lr=run["lr"],
                          weight_decay=run["weight_decay"], batch_size=run["batch_size"],
                          min_steps=run["min_steps"], max_steps=run["max_steps"], seed=run["seed"],
                          device=settings.device, vocab_size=vocabulary(variant.setting),
                          trained_sets=tuple(tests), chance=label_chance(tests[run["task"]][1]))
    result = train_recall(config, train, tests, progress=progress)
    trained = result["per_setting"][run["task"]]
    return {
        **run,
        "accuracy": trained["accuracy"],
        "token_accuracy": trained["token_accuracy"],
        "accuracy_per_set": {name: r["accuracy"] for name, r in result["per_setting"].items()},
        "chance": result["chance"],
        "state_bytes": result["state_bytes"],
        "parameters": result["parameters"],
        "non_embedding_parameters": model_sizes(run["arch"], run["d_model"], variant, run["n_layers"],
                                                run["mlp"])[1],
        "steps": result["steps"],
        "solved": result["solved"],
        "convergence": result["convergence"],
        "stopped": result["stopped"],
        "wall_s": result["wall_s"],
        "history": result["history"],
    }


def run_label(run: dict) -> str:
    size = f"d={run['d_model']}" + (f" {run['mode']} {run['target']}" if run["mode"] != "fixed" else "")
    change = "" if run["change"] == "baseline" else f" {run['change']}"
    return f"{run['task']}{change} {run['arch']} {size} lr={run['lr']:g} wd={run['weight_decay']:g} seed={run['seed']}"


STATE_STEP_COST = 3.0  # a fixed-state mixer's training step against attention's on CPU (2.5-3.2x at length 64)


def run_cost(run: dict) -> float:
    """A run's relative cost (tokens x width x steps, x STATE_STEP_COST for a fixed-state mixer), longest first so
    the last worker does not finish alone."""
    variant = task_variant(f"{run['task']}:{run['change']}")
    factor = STATE_STEP_COST if has_fixed_state(run["arch"]) else 1.0
    return factor * variant.setting.width * run["d_model"] * run["max_steps"]


def run_probe(settings: "ProbeSettings | list[ProbeSettings]", show_progress: bool = True) -> list[dict]:
    """Train every run not already in results.jsonl, appending each row as its run finishes (an interrupted
    sweep loses only the runs in flight); returns all rows of these settings' runs. Several sweeps (a preset's)
    share one output folder and one pool of workers, so no worker idles at a sweep's end."""
    sweeps = settings if isinstance(settings, list) else [settings]
    for sweep in sweeps:
        sweep.validate()
    first = sweeps[0]
    shared = ("out", "device", "workers", "ray")
    if any(getattr(sweep, name) != getattr(first, name) for sweep in sweeps for name in shared):
        raise ValueError(f"sweeps run together share {', '.join(shared)}; got {[settings_dict(s) for s in sweeps]}")
    store = ResultStore(first.out / "results.jsonl", RUN_KEY)
    runs = list({tuple(run[f] for f in RUN_KEY): run for sweep in sweeps for run in sweep.runs()}.values())
    todo = sorted([r for r in runs if not store.done(r)], key=run_cost, reverse=True)
    if todo:
        data = {seed: None for seed in {run["seed"] for run in todo}}  # each run makes its own data from its seed
        bar = tqdm(total=len(todo), desc="zoo probe", unit="run", disable=not show_progress)
        if first.ray is not None:
            from harness.recall.ray_runner import train_on_ray  # Ray is an optional extra

            train_on_ray(todo, first, data, store, bar, train_fn=train_probe)
        elif first.workers == 1:
            for run in todo:
                store.append(train_probe(run, first, None, lambda text: bar.set_postfix_str(text)))
                bar.update()
        else:
            train_in_workers(todo, first, data, store, bar, train_fn=train_probe, label=run_label)
        bar.close()
    wanted = {store.key(r) for r in runs}
    return [r for r in store.rows if store.key(r) in wanted]
