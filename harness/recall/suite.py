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
from harness.recall.train import RECIPE_LAYERS, TrainConfig, model_identity, train_recall
from harness.results import ResultStore, check_output_folder
from zoo import checks

# The fields that identify a run: a re-run skips rows that match on all of them.
RUN_KEY = ("arch", "n_layers", "d_model", "lr", "seq_len", "kv_pairs", "vocab_size", "train_examples", "max_steps",
           "seed")
KEY_DEFAULTS = {"n_layers": RECIPE_LAYERS}  # rows written before runs had depths were trained at the recipe's


@dataclass
class RecallSettings:
    archs: list[str] = field(default_factory=zoo.registry.recall_defaults)  # the entries marked recall_default
    seq_len: int = 64
    # widths, pairs, lr and steps sized so the CPU default's attention runs reach recall in < 15 min (BENCHMARKS.md)
    kv_pairs: list[int] = field(default_factory=lambda: [4, 8])  # one model trains on all of them, mixed
    vocab_size: int = 8192
    d_models: list[int] = field(default_factory=lambda: [32, 64])
    lrs: list[float] = field(default_factory=lambda: [2e-3])
    train_examples: int = 32_000  # per kv-pairs setting
    test_examples: int = 500  # per kv-pairs setting
    max_steps: int = 800
    batch_size: int = 64
    seed: int = 0
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
        for n in self.kv_pairs:
            MQARSetting(self.seq_len, n, self.vocab_size).validate()
        checks.integer_list("d_models", self.d_models, minimum=1)
        if not isinstance(self.lrs, (list, tuple)) or not self.lrs:
            raise ValueError(f"lrs must be a non-empty list of learning rates > 0, got {self.lrs!r}")
        for lr in self.lrs:
            checks.real("learning rate", lr, minimum=0, open_min=True)
        for name in ("train_examples", "test_examples", "max_steps", "batch_size", "workers"):
            checks.integer(name, getattr(self, name), minimum=1)
        checks.integer("seed", self.seed, minimum=0, maximum=2**64 - 1)  # what torch.manual_seed takes
        checks.device("device", self.device)
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray):
            raise ValueError(f"ray must be a cluster address, 'auto' or 'local', got {self.ray!r}")
        if self.ray is not None and importlib.util.find_spec("ray") is None:
            raise ValueError(f"ray={self.ray!r} needs Ray installed: pip install -e '.[ray]'")
        check_output_folder(self.out)

    def runs(self) -> list[dict]:
        common = {"seq_len": self.seq_len, "kv_pairs": ",".join(map(str, self.kv_pairs)), "vocab_size": self.vocab_size,
                  "train_examples": self.train_examples, "max_steps": self.max_steps, "seed": self.seed}
        return [{"arch": a, "n_layers": layers, "d_model": d, "lr": lr, **common}
                for a in self.archs for layers in zoo.registry.recall_layers(a) for d in self.d_models for lr in self.lrs]


def run_recall(settings: RecallSettings, show_progress: bool = True) -> list[dict]:
    """Train every run not already in results.jsonl, appending each row as its run finishes (an interrupted
    sweep loses only the runs in flight); returns all rows of this settings' runs."""
    settings.validate()
    store = ResultStore(settings.out / "results.jsonl", RUN_KEY, KEY_DEFAULTS)
    todo = [r for r in settings.runs() if not store.done(r)]
    twins = copy_twins(todo, settings, store)  # runs whose model another run trains (or has trained)
    todo = [r for r in todo if r not in twins and not store.done(r)]
    if todo:
        mqar = [MQARSetting(settings.seq_len, n, settings.vocab_size) for n in settings.kv_pairs]
        (train_inputs, train_labels, _), tests = make_splits([(s, settings.train_examples) for s in mqar],
                                                             [(s, settings.test_examples) for s in mqar], settings.seed)
        data = ((train_inputs, train_labels), dict(zip(setting_names(settings), tests)))
        bar = tqdm(total=len(todo), desc="zoo recall", unit="run", disable=not show_progress)
        if settings.ray is not None:
            from harness.recall.ray_runner import train_on_ray  # Ray is an optional extra

            train_on_ray(todo, settings, data, store, bar)
        elif settings.workers == 1:
            for run in todo:
                store.append(train_run(run, settings, data, lambda text: bar.set_postfix_str(text)))
                bar.update()
        else:
            train_in_workers(sorted(todo, key=expected_cost, reverse=True), settings, data, store, bar)
        bar.close()
    copy_twins(twins, settings, store)
    wanted = {store.key(r) for r in settings.runs()}
    return [r for r in store.rows if store.key(r) in wanted]


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
    return TrainConfig(arch=run["arch"], n_layers=run["n_layers"], d_model=run["d_model"], lr=run["lr"],
                       batch_size=settings.batch_size,
                       max_steps=settings.max_steps, seed=settings.seed, device=settings.device,
                       vocab_size=settings.vocab_size)


def setting_names(settings: RecallSettings) -> list[str]:
    return [f"L={settings.seq_len},N={n}" for n in settings.kv_pairs]


def train_run(run: dict, settings: RecallSettings, data, report) -> dict:
    """One run's row; report(text) is told the step and the worst test accuracy after every evaluation."""
    label = run_label(run)
    report(label)

    def progress(event: dict) -> None:
        if "eval" in event:
            report(f"{label} step {event['step']}/{event['max_steps']} acc(min N) {min(event['eval'].values()):.3f}")

    result = train_recall(train_config(run, settings), *data, progress=progress)
    names = setting_names(settings)
    return {
        **run,
        "accuracy": result["accuracy"],
        "token_accuracy": result["token_accuracy"],
        "accuracy_per_kv_pairs": {str(n): result["per_setting"][name]["accuracy"]  # json keys are strings
                                  for n, name in zip(settings.kv_pairs, names)},
        "state_bytes": result["state_bytes"],
        "parameters": result["parameters"],
        "steps": result["steps"],
        "solved": result["solved"],
        "convergence": result["convergence"],
        "wall_s": result["wall_s"],
        "history": result["history"],
    }


def run_label(run: dict) -> str:
    depth = "" if run["n_layers"] == RECIPE_LAYERS else f" {run['n_layers']} layers"
    return f"{run['arch']}{depth} d={run['d_model']} lr={run['lr']:g}"


def expected_cost(run: dict) -> tuple:
    """Longest first keeps the last worker from finishing alone: wider runs cost more, and recurrent-state
    architectures train through a sequential scan on CPU (several times an attention step)."""
    specs = zoo.build(run["arch"], preset="tiny").cache_specs()
    return run["d_model"] * run["n_layers"], any(spec.kind == "state" for spec in specs)


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


def _worker_run(run, settings, data) -> dict:
    return train_run(run, settings, data, lambda text: _worker_events.put((run_label(run), text)))


def train_in_workers(todo: list[dict], settings: RecallSettings, data, store: ResultStore, bar) -> None:
    """Runs in `settings.workers` processes (one thread each per core); this process alone writes results.jsonl."""
    context = multiprocessing.get_context("spawn")  # fork after torch has started threads can deadlock
    threads = max(1, (os.cpu_count() or 1) // settings.workers)
    events = context.Queue()
    with ProcessPoolExecutor(settings.workers, mp_context=context, initializer=_worker_init,
                             initargs=(threads, events)) as pool:
        pending = {pool.submit(_worker_run, run, settings, data): run for run in todo}
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
                    status.pop(run_label(run), None)
                    bar.update()
                bar.set_postfix_str(" | ".join(status.values()))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # finished rows are on disk; drop the queued runs
            raise


def best_over_lr(rows: list[dict]) -> list[dict]:
    """Per (architecture, depth, d_model): the run with the best test accuracy, as Zoology reports its sweeps."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["arch"], row.get("n_layers", RECIPE_LAYERS), row["d_model"])
        if key not in best or row["accuracy"] > best[key]["accuracy"]:
            best[key] = row
    return sorted(best.values(), key=lambda r: (r["arch"], r.get("n_layers", RECIPE_LAYERS), r["d_model"]))
