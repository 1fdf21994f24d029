"""`zoo recall`: every architecture x width x learning rate trained on MQAR, written as it goes, resumable."""
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

import zoo
from harness.recall.data import MQARSetting, make_splits
from harness.recall.train import TrainConfig, train_recall
from harness.results import ResultStore

# The fields that identify a run: a re-run skips rows that match on all of them.
RUN_KEY = ("arch", "d_model", "lr", "seq_len", "kv_pairs", "vocab_size", "train_examples", "max_steps", "seed")


@dataclass
class RecallSettings:
    archs: list[str] = field(default_factory=zoo.architectures)
    seq_len: int = 64
    kv_pairs: list[int] = field(default_factory=lambda: [4, 8, 16])  # one model trains on all of them, mixed
    vocab_size: int = 8192
    d_models: list[int] = field(default_factory=lambda: [64, 128])
    lrs: list[float] = field(default_factory=lambda: [3e-3])
    train_examples: int = 20_000  # per kv-pairs setting
    test_examples: int = 500  # per kv-pairs setting
    max_steps: int = 600
    batch_size: int = 64
    seed: int = 0
    device: str = "cpu"
    out: Path = Path("results/recall")

    def validate(self) -> None:
        """Every bad setting is reported before any model trains."""
        for arch in self.archs:
            zoo.registry.check_architecture(arch)
        for n in self.kv_pairs:
            MQARSetting(self.seq_len, n, self.vocab_size).validate()
        if not self.d_models or min(self.d_models) < 1:
            raise ValueError(f"d_model values must be >= 1, got {self.d_models}")
        if not self.lrs or min(self.lrs) <= 0:
            raise ValueError(f"learning rates must be > 0, got {self.lrs}")
        if min(self.train_examples, self.test_examples, self.max_steps, self.batch_size) < 1:
            raise ValueError("train_examples, test_examples, max_steps and batch_size must be >= 1")

    def runs(self) -> list[dict]:
        common = {"seq_len": self.seq_len, "kv_pairs": ",".join(map(str, self.kv_pairs)), "vocab_size": self.vocab_size,
                  "train_examples": self.train_examples, "max_steps": self.max_steps, "seed": self.seed}
        return [{"arch": a, "d_model": d, "lr": lr, **common} for a in self.archs for d in self.d_models for lr in self.lrs]


def run_recall(settings: RecallSettings, show_progress: bool = True) -> list[dict]:
    """Train every run not already in results.jsonl; returns all rows of this settings' runs."""
    settings.validate()
    store = ResultStore(settings.out / "results.jsonl", RUN_KEY)
    todo = [r for r in settings.runs() if not store.done(r)]
    if todo:
        mqar = [MQARSetting(settings.seq_len, n, settings.vocab_size) for n in settings.kv_pairs]
        (train_inputs, train_labels, _), tests = make_splits([(s, settings.train_examples) for s in mqar],
                                                             [(s, settings.test_examples) for s in mqar], settings.seed)
        names = {n: f"L={settings.seq_len},N={n}" for n in settings.kv_pairs}
        test_sets = {names[n]: test for n, test in zip(settings.kv_pairs, tests)}
        bar = tqdm(todo, desc="zoo recall", unit="run", disable=not show_progress)
        for run in bar:
            label = f"{run['arch']} d={run['d_model']} lr={run['lr']:g}"
            bar.set_postfix_str(label)

            def progress(event: dict, label=label) -> None:
                if "eval" in event:
                    worst = min(event["eval"].values())
                    bar.set_postfix_str(f"{label} step {event['step']}/{event['max_steps']} acc(min N) {worst:.3f}")

            config = TrainConfig(arch=run["arch"], d_model=run["d_model"], lr=run["lr"], batch_size=settings.batch_size,
                                 max_steps=settings.max_steps, seed=settings.seed, device=settings.device,
                                 vocab_size=settings.vocab_size)
            result = train_recall(config, (train_inputs, train_labels), test_sets, progress=progress)
            store.append({
                **run,
                "accuracy": result["accuracy"],
                "token_accuracy": result["token_accuracy"],
                "accuracy_per_kv_pairs": {str(n): result["per_setting"][names[n]]["accuracy"] for n in settings.kv_pairs},  # json keys
                "state_bytes": result["state_bytes"],
                "parameters": result["parameters"],
                "steps": result["steps"],
                "solved": result["solved"],
                "wall_s": result["wall_s"],
                "history": result["history"],
            })
    wanted = {store.key(r) for r in settings.runs()}
    return [r for r in store.rows if store.key(r) in wanted]


def best_over_lr(rows: list[dict]) -> list[dict]:
    """Per (architecture, d_model): the run with the best test accuracy, as Zoology reports its sweeps."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["arch"], row["d_model"])
        if key not in best or row["accuracy"] > best[key]["accuracy"]:
            best[key] = row
    return sorted(best.values(), key=lambda r: (r["arch"], r["d_model"]))


def settings_dict(settings: RecallSettings) -> dict:
    d = asdict(settings)
    d["out"] = str(settings.out)
    return d
