"""`zoo train`: train a registry architecture as a byte-level LM on a local corpus, resumably.

AdamW (betas 0.9/0.95; weight decay 0.1 on the weights of linear and embedding layers, none on norms, biases and
state-space parameters), linear warmup then cosine decay to 10% of the peak rate over whichever budget ends first
(harness/train/schedule.py), gradients clipped to norm 1.0, optional bf16 autocast. Validation every eval_every
steps and at the end on a fixed set of windows; each evaluation writes a checkpoint (harness/train/checkpoint.py)
and rewrites results.jsonl. A model with MoE layers also trains on the MoE auxiliary losses, and each evaluation
reports its routing (harness/train/moe_losses.py). Running the same settings with the same OUT continues from the
newest checkpoint: batches and masking draws are seeded by (seed, step), so the continued run takes the steps an
uninterrupted one would.
"""
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import zoo
from harness.results import write_atomic
from harness.train import objective
from harness.train.baseline import unigram_bpb
from harness.train.checkpoint import LINK, checkpoint_folder, read_optimizer_state, read_train_state, save_checkpoint
from harness.train.corpus import Corpus, check_window_fits, load_corpus, training_batch, validation_windows
from harness.train.moe_losses import MoETraining, routing_line
from harness.train.schedule import lr_factor, progress
from harness.train.settings import TrainSettings

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
RUN_FIELDS = ("arch", "preset", "overrides", "context", "batch_size", "seed")  # what names a run in results.jsonl


@dataclass
class Run:
    """A training run in flight: what it trains, on what, and where it stands (`state`, as checkpointed)."""

    settings: TrainSettings
    model: nn.Module
    optimizer: torch.optim.Optimizer
    corpus: Corpus
    state: dict
    moe: MoETraining  # the auxiliary losses' weights and the routing statistics since the last evaluation
    teacher: nn.Module | None = None  # distillation: the model whose next-byte distributions the student learns

    def fraction_done(self) -> float:
        """Progress through the budget, in [0, 1]."""
        return progress(self.state["step"], self.state["trained_s"], self.settings.max_steps, self.settings.minutes)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the weights of linear and embedding layers only (a tied head is one of them)."""
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    params = list(model.parameters())  # each tensor once, a tied head included
    groups = [{"params": [p for p in params if id(p) in decayed], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def hardware(device: str) -> str:
    """What trained the model, for the record and a chart's title."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()}-core CPU"


def start_run(settings: TrainSettings) -> Run:
    """A fresh run, or OUT's newest checkpoint with its optimizer state; every setting is checked first."""
    config = settings.validate()
    saved = read_train_state(settings.out)
    corpus = load_corpus(settings.corpus)
    check_window_fits(corpus, settings.context + 1)
    if saved is None:
        torch.manual_seed(settings.seed)
        if settings.init is not None and settings.init_weights:  # a saved student: a pruned or converted model
            model = zoo.load(settings.init, settings.device).float()
        else:
            model = zoo.build(config).to(settings.device)
        state = {"step": 0, "tokens": 0, "trained_s": 0.0, "wall_s": 0.0, "history": [],
                 "unigram_bpb": unigram_bpb(corpus.train, corpus.validation), "corpus": corpus.description,
                 "metric": objective.metric(model), "hardware": hardware(settings.device), "torch": torch.__version__}
    else:
        check_same_corpus(saved["corpus"], corpus)
        model = zoo.load(checkpoint_folder(settings.out), settings.device)
        state = saved
    optimizer = make_optimizer(model.train(), settings.lr)
    if saved is not None:
        optimizer.load_state_dict(read_optimizer_state(checkpoint_folder(settings.out), settings.device))
    moe = MoETraining.for_model(model, settings.moe_balance_weight, settings.moe_z_weight)
    teacher = None if settings.teacher is None else zoo.load(settings.teacher, settings.device).float().eval()
    return Run(settings, model, optimizer, corpus, {**state, "settings": settings.record()}, moe,  # budgets given now
               teacher)


def check_same_corpus(saved: dict, corpus: Corpus) -> None:
    """The corpus a checkpoint was trained on still holds what it held (files and bytes per split)."""
    differ = [f"{name} {saved.get(name)!r} (checkpoint) vs {value!r} (now)" for name, value in corpus.description.items()
              if saved.get(name) != value]
    if differ:
        raise ValueError(f"the corpus changed since the checkpoint was written: {'; '.join(differ)}; pass another "
                         f"--out to start afresh on it")


def train_step(run: Run, lr: float, use_autocast: bool) -> float:
    """One optimizer step at rate lr on the batch of the run's current step, on the task loss (with a teacher, the
    distillation loss) plus any MoE auxiliary losses; returns the task loss in nats per token."""
    settings, step = run.settings, run.state["step"]
    batch = training_batch(run.corpus, settings.seed, step, settings.batch_size, settings.context + 1)
    generator = None if run.model.config.causal else objective.masking_generator(settings.seed, step, settings.device)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    with objective.autocast(settings.device, use_autocast):
        if run.teacher is None:
            loss = trained_on = objective.loss(run.model, batch.to(settings.device), generator)
        else:
            loss, trained_on = objective.distillation_loss(run.model, run.teacher, batch.to(settings.device),
                                                           settings.distill_temperature, settings.distill_weight)
    run.optimizer.zero_grad(set_to_none=True)
    (trained_on + run.moe.step_loss(run.model)).backward()
    nn.utils.clip_grad_norm_(run.model.parameters(), CLIP_NORM)
    run.optimizer.step()
    return float(loss.detach())


def evaluate(run: Run, windows: torch.Tensor, lr: float, losses: list[float]) -> dict:
    """Score the fixed validation windows and record the evaluation in the run's history (losses: the training
    task losses since the last evaluation, in bits per byte; with them, the MoE weights and routing statistics)."""
    state = run.state
    row = {"step": state["step"], "tokens": state["tokens"], "trained_s": state["trained_s"], "lr": lr,
           "train_loss_bpb": sum(losses) / len(losses),
           "val_bpb": objective.validation_bpb(run.model, windows, run.settings.batch_size),
           "val_metric": state["metric"], "unigram_bpb": state["unigram_bpb"], "budget_end": run.fraction_done() >= 1.0,
           **run.moe.report()}
    state["history"].append(row)
    return row


def write_results(state: dict, out: Path) -> None:
    """results.jsonl from the checkpoint's evaluations, each with the settings that name the run (rewritten whole,
    so a row written after the checkpoint a kill kept is dropped on resume)."""
    run = {name: state["settings"][name] for name in RUN_FIELDS}
    write_atomic(out / "results.jsonl", "".join(json.dumps({**run, **row}) + "\n" for row in state["history"]))


def figure_name(metric: str) -> str:
    return "val bpb" if metric == objective.BPB else "val ELBO bound on bpb"


def run_train(settings: TrainSettings, show_progress: bool = True) -> dict:
    """Train until the budget ends, continuing OUT's checkpoint if it has one; returns the last evaluation with the
    run's names, wall_s (all sessions) and the checkpoint path."""
    started = time.perf_counter()
    run = start_run(settings)
    state = run.state
    if state["history"]:  # resumed: results.jsonl as the checkpoint has it
        write_results(state, settings.out)
    windows = validation_windows(run.corpus, settings.eval_windows, settings.context + 1)
    use_autocast = settings.autocast_enabled(run.model.config)
    wall_before, tokens_before, trained_before = state["wall_s"], state["tokens"], state["trained_s"]
    losses: list[float] = []  # bits per byte of the steps since the last evaluation
    bar = tqdm(total=100, desc=f"zoo train {settings.arch}", disable=not show_progress,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")
    while run.fraction_done() < 1.0:
        start = time.perf_counter()
        lr = settings.lr * lr_factor(state["step"], run.fraction_done(), settings.warmup_steps)
        loss = train_step(run, lr, use_autocast) / objective.LN2
        losses.append(loss)
        state["step"] += 1
        state["tokens"] += settings.batch_size * settings.context
        state["trained_s"] += time.perf_counter() - start
        if state["step"] % settings.eval_every == 0 or run.fraction_done() >= 1.0:
            row = evaluate(run, windows, lr, losses)
            state["wall_s"] = wall_before + time.perf_counter() - started
            save_checkpoint(settings.out, run.model, run.optimizer, state)
            write_results(state, settings.out)
            bar.write(f"step {row['step']:,}: {figure_name(row['val_metric'])} {row['val_bpb']:.3f} (unigram "
                      f"{row['unigram_bpb']:.3f}), train loss {row['train_loss_bpb']:.3f} bpb, lr {lr:.2e}"
                      f"{routing_line(row)}")
            losses = []
        tok_s = (state["tokens"] - tokens_before) / max(state["trained_s"] - trained_before, 1e-9)
        bar.update(round(100 * run.fraction_done(), 1) - bar.n)
        bar.set_postfix_str(f"step {state['step']:,}, loss {loss:.3f} bpb, {tok_s:,.0f} tok/s")
    bar.close()
    return {"arch": settings.arch, "preset": settings.preset, **state["history"][-1], "wall_s": state["wall_s"],
            "checkpoint": str(settings.out / LINK)}


def summary_line(result: dict) -> str:
    return (f"{result['arch']}/{result['preset']}: {figure_name(result['val_metric'])} {result['val_bpb']:.3f} "
            f"(unigram baseline {result['unigram_bpb']:.3f} bpb) after {result['step']:,} steps, "
            f"{result['tokens'] / 1e6:.2f}M tokens, {result['trained_s'] / 60:.2f} min training "
            f"({result['wall_s'] / 60:.2f} min wall); checkpoint {result['checkpoint']}")
