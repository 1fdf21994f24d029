"""`zoo recall`: every architecture x width x learning rate trained on MQAR, written as it goes, resumable."""
import importlib.util
import multiprocessing
import os
import queue as queue_module
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import zoo
from harness.recall.data import MQARSetting, make_splits
from harness.recall.train import (RECIPE_LAYERS, ROUTING_FIELD, TrainConfig, build_recall_model, convergence,
                                  model_identity, recall_model_config, train_recall, training_loss)
from harness.results import ResultStore, check_output_folder
from harness.train.moe_losses import BALANCE_WEIGHT, Z_WEIGHT, check_weights, has_moe_layers
from zoo import checks

# The fields that identify a run: a re-run skips rows that match on all of them.
RUN_KEY = ("arch", "n_layers", "d_model", "lr", "seq_len", "kv_pairs", "held_out_kv_pairs", "vocab_size",
           "train_examples", "min_steps", "max_steps", "seed", "moe_balance_weight", "moe_z_weight")
# what rows written before a field existed were run with: the recipe's depth, no held-out N, no plateau stop, no MoE
# auxiliary losses (None, as a run whose model has no MoE layers records them: the weights did not apply)
KEY_DEFAULTS = {"n_layers": RECIPE_LAYERS, "held_out_kv_pairs": "", "min_steps": None, "moe_balance_weight": None,
                "moe_z_weight": None}


@dataclass
class RecallSettings:
    archs: list[str] = field(default_factory=zoo.registry.recall_defaults)  # the entries marked recall_default
    seq_len: int = 64
    # sized so that the CPU default converges or plateaus in < 15 min on 2 cores (BENCHMARKS.md: the budget search)
    kv_pairs: list[int] = field(default_factory=lambda: [4, 8])  # one model trains on all of them, mixed
    held_out_kv_pairs: list[int] = field(default_factory=lambda: [16])  # also tested, never trained on
    vocab_size: int = 8192
    d_models: list[int] = field(default_factory=lambda: [64])
    # widths also trained for the fixed-state architectures, whose recall grows with their state (Zoology's trade-off)
    state_d_models: list[int] = field(default_factory=lambda: [32])
    lrs: list[float] | None = None  # None: each architecture's registry recall_lr; a list: every run at each
    train_examples: int = 32_000  # per kv-pairs setting
    test_examples: int = 500  # per kv-pairs setting
    min_steps: int | None = 600  # a run stops at a plateau only after this many steps (None: never)
    max_steps: int = 1500
    batch_size: int = 64
    seeds: list[int] = field(default_factory=lambda: [0])  # several: the report shows their mean and range
    # the MoE auxiliary losses' weights (harness/train/moe_losses.py); a model without MoE layers ignores them
    moe_balance_weight: float = BALANCE_WEIGHT
    moe_z_weight: float = Z_WEIGHT
    device: str = "cpu"
    workers: int | None = None  # runs trained at once; None = one per CPU core up to 2 on CPU, 1 on CUDA
    out: Path = Path("results/recall")
    ray: str | None = None  # run each run as a Ray task on the cluster at this address ("local": start one here)

    def __post_init__(self):
        if self.workers is None:
            self.workers = 1 if self.device != "cpu" else max(1, min(2, os.cpu_count() or 1))

    def validate(self) -> None:
        """Every bad setting is reported before any model trains."""
        if not self.archs:
            raise ValueError(f"no architectures to train (archs is empty); allowed: {', '.join(zoo.architectures())}")
        for arch in self.archs:
            zoo.registry.check_architecture(arch)
        checks.integer_list("kv_pairs", self.kv_pairs, minimum=1)
        checks.integer_list("held_out_kv_pairs", self.held_out_kv_pairs, minimum=1, may_be_empty=True)
        for n in [*self.kv_pairs, *self.held_out_kv_pairs]:
            MQARSetting(self.seq_len, n, self.vocab_size).validate()
        checks.integer_list("d_models", self.d_models, minimum=1)
        checks.integer_list("state_d_models", self.state_d_models, minimum=1, may_be_empty=True)
        if self.lrs is not None and (not isinstance(self.lrs, (list, tuple)) or not self.lrs):
            raise ValueError(f"lrs must be None (each architecture's own) or a non-empty list of learning rates > 0, "
                             f"got {self.lrs!r}")
        for lr in self.lrs or []:
            checks.real("learning rate", lr, minimum=0, open_min=True)
        for name in ("train_examples", "test_examples", "max_steps", "batch_size", "workers"):
            checks.integer(name, getattr(self, name), minimum=1)
        checks.optional_integer("min_steps", self.min_steps, minimum=1)
        checks.integer_list("seeds", self.seeds, minimum=0, maximum=2**64 - 1)  # what torch.manual_seed takes
        checks.device("device", self.device)
        check_weights(self.moe_balance_weight, self.moe_z_weight)
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray):
            raise ValueError(f"ray must be a cluster address, 'auto' or 'local', got {self.ray!r}")
        if self.ray is not None and importlib.util.find_spec("ray") is None:
            raise ValueError(f"ray={self.ray!r} needs Ray installed: pip install -e '.[ray]'")
        check_output_folder(self.out)

    def runs(self) -> list[dict]:
        common = {"seq_len": self.seq_len, "kv_pairs": ",".join(map(str, self.kv_pairs)),
                  "held_out_kv_pairs": ",".join(map(str, self.held_out_kv_pairs)), "vocab_size": self.vocab_size,
                  "train_examples": self.train_examples, "min_steps": self.min_steps, "max_steps": self.max_steps}
        return [{"arch": a, "n_layers": layers, "d_model": d, "lr": lr, **common, "seed": seed,
                 **self.moe_weights(a, layers, d)}
                for a in self.archs for layers in zoo.registry.recall_layers(a) for d in self.widths(a)
                for lr in self.lrs or [zoo.registry.recall_lr(a)] for seed in self.seeds]

    def moe_weights(self, arch: str, n_layers: int, d_model: int) -> dict:
        """The MoE weights a run applies: the settings' where its model has MoE layers, else None (not applying)."""
        config = recall_model_config(TrainConfig(arch, d_model=d_model, n_layers=n_layers), self.vocab_size,
                                     self.seq_len)
        applies = has_moe_layers(config)
        return {"moe_balance_weight": self.moe_balance_weight if applies else None,
                "moe_z_weight": self.moe_z_weight if applies else None}

    def widths(self, arch: str) -> list[int]:
        extra = self.state_d_models if has_fixed_state(arch) else []
        return sorted(set(self.d_models) | set(extra))


def has_fixed_state(arch: str) -> bool:
    """Every layer keeps a recurrent state of fixed size (linear attention, the SSMs): the family whose recall
    Zoology plots against state size."""
    return all(spec.kind == "state" for spec in zoo.build(arch, preset="tiny").cache_specs())


def run_recall(settings: RecallSettings, show_progress: bool = True) -> list[dict]:
    """Train every run not already in results.jsonl, appending each row as its run finishes (an interrupted
    sweep loses only the runs in flight); returns all rows of this settings' runs."""
    settings.validate()
    store = ResultStore(settings.out / "results.jsonl", RUN_KEY, KEY_DEFAULTS)
    todo = [r for r in settings.runs() if not store.done(r)]
    twins = copy_twins(todo, settings, store)  # runs whose model another run trains (or has trained)
    todo = [r for r in todo if r not in twins and not store.done(r)]
    if todo:
        data = {seed: make_data(settings, seed) for seed in sorted({run["seed"] for run in todo})}
        bar = tqdm(total=len(todo), desc="zoo recall", unit="run", disable=not show_progress)
        if settings.ray is not None:
            from harness.recall.ray_runner import train_on_ray  # Ray is an optional extra

            train_on_ray(todo, settings, data, store, bar, train_fn=train_run)
        elif settings.workers == 1:
            for run in todo:
                store.append(train_run(run, settings, data[run["seed"]], lambda text: bar.set_postfix_str(text)))
                bar.update()
        else:
            cost = {run_label(run): step_seconds(run, settings, data[run["seed"]]) for run in todo}
            train_in_workers(sorted(todo, key=lambda run: cost[run_label(run)], reverse=True), settings, data, store, bar)
        bar.close()
    copy_twins(twins, settings, store)
    wanted = {store.key(r) for r in settings.runs()}
    return [r for r in store.rows if store.key(r) in wanted]


def make_data(settings: RecallSettings, seed: int):
    """((train inputs, labels), {test set name: (inputs, labels)}): the trained settings mixed into one training set
    drawn from `seed`; one test set per trained and held-out N, the same for every seed."""
    trained = [MQARSetting(settings.seq_len, n, settings.vocab_size) for n in settings.kv_pairs]
    tested = [MQARSetting(settings.seq_len, n, settings.vocab_size) for n in test_kv_pairs(settings)]
    (train_inputs, train_labels, _), tests = make_splits([(s, settings.train_examples) for s in trained],
                                                         [(s, settings.test_examples) for s in tested], seed)
    return (train_inputs, train_labels), dict(zip(setting_names(settings), tests))


def copy_twins(runs: list[dict], settings: RecallSettings, store: ResultStore) -> list[dict]:
    """Runs whose model is identical to another run's (same weights, data and seed: the same result) are not
    trained twice. Each run whose twin is already in `store` gets a copy of its row, named for the run and
    marked `same_model_as`; returns the runs whose twin is not in `store`, except the first of each identity."""
    def identity(run: dict) -> tuple:
        return (model_identity(train_config(run, settings), settings.vocab_size, settings.seq_len),
                *(run[f] for f in RUN_KEY if f != "arch"))

    finished = {identity(row): row for row in store.rows if all(f in row for f in RUN_KEY)}
    waiting, first = [], set()
    for run in runs:
        key = identity(run)
        if key in finished:
            twin = finished[key]
            store.append({**twin, "arch": run["arch"], "same_model_as": twin.get("same_model_as", twin["arch"])})
        elif key in first:
            waiting.append(run)
        else:
            first.add(key)
    return waiting


def train_config(run: dict, settings: RecallSettings) -> TrainConfig:
    trained = tuple(f"L={settings.seq_len},N={n}" for n in settings.kv_pairs)
    return TrainConfig(arch=run["arch"], n_layers=run["n_layers"], d_model=run["d_model"], lr=run["lr"],
                       batch_size=settings.batch_size, min_steps=settings.min_steps, max_steps=settings.max_steps,
                       seed=run["seed"], device=settings.device, vocab_size=settings.vocab_size, trained_sets=trained,
                       moe_balance_weight=settings.moe_balance_weight, moe_z_weight=settings.moe_z_weight)


def test_kv_pairs(settings: RecallSettings) -> list[int]:
    """The trained N, then the held-out ones."""
    return list(dict.fromkeys([*settings.kv_pairs, *settings.held_out_kv_pairs]))


def setting_names(settings: RecallSettings) -> list[str]:
    return [f"L={settings.seq_len},N={n}" for n in test_kv_pairs(settings)]


def train_run(run: dict, settings: RecallSettings, data, report) -> dict:
    """One run's row; report(text) is told the step and the worst test accuracy after every evaluation."""
    label = run_label(run)
    report(label)

    def progress(event: dict) -> None:
        if "eval" in event:
            report(f"{label} step {event['step']}/{event['max_steps']} acc(min N) {min(event['eval'].values()):.3f}")

    config = train_config(run, settings)
    result = train_recall(config, *data, progress=progress)
    names = setting_names(settings)
    trained = [result["per_setting"][name] for name in config.trained_sets]
    return {
        **run,
        "accuracy": sum(r["accuracy"] for r in trained) / len(trained),  # over the trained N; held-out N shown apart
        "token_accuracy": sum(r["token_accuracy"] for r in trained) / len(trained),
        "accuracy_per_kv_pairs": {str(n): result["per_setting"][name]["accuracy"]  # json keys are strings
                                  for n, name in zip(test_kv_pairs(settings), names)},
        "state_bytes": result["state_bytes"],
        "parameters": result["parameters"],
        "steps": result["steps"],
        "solved": result["solved"],
        "convergence": result["convergence"],
        "stopped": result["stopped"],
        "chance": result["chance"],
        "wall_s": result["wall_s"],
        "history": result["history"],
        **({ROUTING_FIELD: result[ROUTING_FIELD]} if ROUTING_FIELD in result else {}),
    }


def run_label(run: dict) -> str:
    depth = "" if run["n_layers"] == RECIPE_LAYERS else f" {run['n_layers']} layers"
    return f"{run['arch']}{depth} d={run['d_model']} lr={run['lr']:g} seed={run['seed']}"


def step_seconds(run: dict, settings: RecallSettings, data) -> float:
    """One training step of this run's model on one batch, timed (after one untimed): the cost per step
    that orders the runs, longest first, so the last worker does not finish alone. Recurrent-state models cost
    two to three times an attention step on CPU, which no shape-based guess captured."""
    (inputs, labels), _ = data
    config = train_config(run, settings)
    torch.manual_seed(0)
    model = build_recall_model(config, settings.vocab_size, settings.seq_len).to(settings.device)
    generator = torch.Generator(settings.device).manual_seed(0)
    x, y = inputs[:settings.batch_size].to(settings.device), labels[:settings.batch_size].to(settings.device)
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        training_loss(model, x, y, generator).backward()
        timings.append(time.perf_counter() - start)
    return timings[-1]


_worker_events = None  # in a worker process only: the queue its progress goes to (a Queue passes only at start)


def _worker_init(threads: int, events) -> None:
    global _worker_events
    _worker_events = events
    torch.set_num_threads(threads)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose parent was killed (not interrupted: Ctrl-C reaches both) stops instead of training on."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_run(train_fn, label, run, settings, data) -> dict:
    return train_fn(run, settings, data, lambda text: _worker_events.put((label, text)))


def train_in_workers(todo: list[dict], settings, data, store: ResultStore, bar, train_fn=None, label=None) -> None:
    """Runs in `settings.workers` processes (one thread each per core); this process alone writes results.jsonl.
    train_fn(run, settings, data[run["seed"]], report) -> row, a module-level function (workers import it by name):
    train_run by default; `zoo probe` passes its own, with label(run) naming a run in the progress bar."""
    train_fn, label = train_fn or train_run, label or run_label
    context = multiprocessing.get_context("spawn")  # fork after torch has started threads can deadlock
    threads = max(1, (os.cpu_count() or 1) // settings.workers)
    events = context.Queue()
    with ProcessPoolExecutor(settings.workers, mp_context=context, initializer=_worker_init,
                             initargs=(threads, events)) as pool:
        pending = {pool.submit(_worker_run, train_fn, label(run), run, settings, data[run["seed"]]): run
                   for run in todo}
        status: dict = {}
        try:
            while pending:
                done, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                while True:
                    try:
                        key, text = events.get_nowait()
                    except queue_module.Empty:
                        break
                    status[key] = text
                for future in done:
                    run = pending.pop(future)
                    store.append(future.result())
                    status.pop(label(run), None)
                    bar.update()
                bar.set_postfix_str(" | ".join(status.values()))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # finished rows are on disk; drop the queued runs
            raise


def best_over_lr(rows: list[dict]) -> list[dict]:
    """Per (architecture, depth, d_model): the learning rate with the best mean test accuracy over seeds, as Zoology
    reports its sweeps; see over_seeds for what a row of several seeds holds."""
    runs: dict[tuple, list[dict]] = {}
    for row in rows:
        runs.setdefault((row["arch"], row.get("n_layers", RECIPE_LAYERS), row["d_model"], row["lr"]), []).append(row)
    best: dict[tuple, dict] = {}
    for (arch, layers, d_model, _), seeds in runs.items():
        row = over_seeds(seeds)
        if (arch, layers, d_model) not in best or row["accuracy"] > best[arch, layers, d_model]["accuracy"]:
            best[arch, layers, d_model] = row
    return [best[key] for key in sorted(best)]


def over_seeds(rows: list[dict]) -> dict:
    """One run's rows over its seeds as one row: mean accuracies, with the per-N range (min, max) and every seed's
    learning curve; "not converged" if any seed was, "solved" only if every seed was; the most steps any seed took,
    the wall time of all. One seed: its row unchanged."""
    if len(rows) == 1:
        return rows[0]
    ns = rows[0]["accuracy_per_kv_pairs"].keys()
    statuses = {row.get("convergence") or convergence(row.get("history", []), row.get("solved", False),
                                                      row.get("chance", 0.0)) for row in rows}
    return {
        **rows[0],
        "seed": [row["seed"] for row in rows],
        "accuracy": sum(row["accuracy"] for row in rows) / len(rows),
        "token_accuracy": sum(row["token_accuracy"] for row in rows) / len(rows),
        "accuracy_per_kv_pairs": {n: sum(row["accuracy_per_kv_pairs"][n] for row in rows) / len(rows) for n in ns},
        "accuracy_range_per_kv_pairs": {n: (min(row["accuracy_per_kv_pairs"][n] for row in rows),
                                            max(row["accuracy_per_kv_pairs"][n] for row in rows)) for n in ns},
        "solved": all(row["solved"] for row in rows),
        "convergence": ("not converged" if "not converged" in statuses else
                        "solved" if statuses == {"solved"} else "plateau"),
        "steps": max(row["steps"] for row in rows),
        "stopped": ", ".join(sorted({row.get("stopped", "") for row in rows} - {""})),  # why each seed ended
        "wall_s": sum(row["wall_s"] for row in rows),
        "histories": [row["history"] for row in rows],
    }
