"""Trained models for `zoo compare --weights DIR`: DIR holds one `zoo train` output folder per architecture, named by
it (DIR/gqa, DIR/mamba, ...). Every folder is read and checked before any work; each model's validation figure is
then measured by compare itself, on the same fixed validation windows for every architecture.

The rule for sizes: the checkpoints decide them. They must share one preset (a comparison at one size), and a
--preset given beside --weights must name that preset. They must also share one corpus, so their figures are
comparable. The validation windows are EVAL_WINDOWS windows of the shortest training context among them.
"""
from dataclasses import dataclass
from pathlib import Path

import torch

import zoo
from harness.train import objective
from harness.train.baseline import unigram_bpb
from harness.train.checkpoint import checkpoint_folder, read_train_state
from harness.train.corpus import load_corpus, validation_windows
from harness.train.settings import TrainSettings
from zoo.checkpoint import load_config

EVAL_WINDOWS = TrainSettings().eval_windows  # the trainer's default: the same figure `zoo train` prints
EVAL_BATCH = TrainSettings().batch_size


@dataclass(frozen=True)
class TrainedModel:
    folder: Path  # the checkpoint folder zoo.load reads
    config: zoo.ModelConfig
    state: dict  # its train_state.json

    @property
    def preset(self) -> str:
        return self.state["settings"]["preset"]

    def budget(self) -> str:
        """The budget the run was given, e.g. "3 min" or "2000 steps" or "3 min or 2000 steps"."""
        settings = self.state["settings"]
        parts = ([f"{settings['minutes']:g} min"] if settings["minutes"] is not None else []) + (
            [f"{settings['max_steps']} steps"] if settings["max_steps"] is not None else [])
        return " or ".join(parts)

    def row_fields(self) -> dict:
        return {"train_steps": self.state["step"], "train_tokens": self.state["tokens"],
                "train_minutes": self.state["trained_s"] / 60, "train_budget": self.budget(),
                "train_hardware": self.state["hardware"], "train_overrides": self.state["settings"]["overrides"]}


def read_trained(weights: Path, archs: list[str], preset: str | None) -> dict[str, TrainedModel]:
    """Each architecture's trained model in `weights`, checked: a folder per architecture holding a `zoo train`
    checkpoint of that architecture, one preset (`preset` if given) and one corpus for all."""
    weights = Path(weights)
    if not weights.is_dir():
        raise ValueError(f"weights folder {str(weights)!r} {'is not a folder' if weights.exists() else 'does not exist'} "
                         f"(it holds one `zoo train` output folder per architecture: {weights}/gqa, ...)")
    trained = {}
    for arch in archs:
        out = weights / arch
        state = read_train_state(out) if out.is_dir() else None
        if state is None:
            raise ValueError(f"architecture {arch!r} has no trained model in {weights}: {out} "
                             f"{'holds no checkpoint' if out.is_dir() else 'does not exist'} (train one with "
                             f"`zoo train --arch {arch} --out {out}`)")
        if state["settings"]["arch"] != arch:
            raise ValueError(f"{out} holds a trained {state['settings']['arch']!r}, not {arch!r}: the folder must be "
                             f"named by its architecture")
        folder = checkpoint_folder(out)
        trained[arch] = TrainedModel(folder, load_config(folder), state)
    presets = {arch: t.preset for arch, t in trained.items()}
    if len(set(presets.values())) > 1 or (preset is not None and set(presets.values()) != {preset}):
        given = f"--preset {preset!r} was given, but " if preset is not None else ""
        raise ValueError(f"{given}the checkpoints in {weights} must share one preset (their size decides the "
                         f"comparison's; leave --preset out to use theirs): {presets}")
    corpora = {arch: t.state["corpus"] for arch, t in trained.items()}
    if any(corpus != next(iter(corpora.values())) for corpus in corpora.values()):
        raise ValueError(f"the checkpoints in {weights} were trained on different corpora, so their bits per byte "
                         f"are not comparable: {corpora}")
    return trained


@dataclass(frozen=True)
class ValidationSet:
    windows: torch.Tensor  # token ids [EVAL_WINDOWS, context + 1]
    context: int
    unigram_bpb: float

    def fields(self, model, trained: TrainedModel) -> dict:
        """A row's quality fields: the model's validation figure measured here, and how it was trained."""
        return {"val_bpb": objective.validation_bpb(model, self.windows, EVAL_BATCH),
                "val_metric": objective.metric(model), "val_context": self.context, "val_windows": len(self.windows),
                "unigram_bpb": self.unigram_bpb, **trained.row_fields()}


def validation_set(trained: dict[str, TrainedModel]) -> ValidationSet:
    """The shared corpus's fixed validation windows, at the shortest training context; the corpus must still hold
    what the checkpoints were trained on."""
    first = next(iter(trained.values()))
    path = first.state["settings"]["corpus"]
    corpus = load_corpus(None if path is None else Path(path))
    if corpus.description != first.state["corpus"]:
        raise ValueError(f"the corpus changed since the checkpoints were trained: {first.state['corpus']} (then) vs "
                         f"{corpus.description} (now)")
    context = min(t.state["settings"]["context"] for t in trained.values())
    return ValidationSet(validation_windows(corpus, EVAL_WINDOWS, context + 1), context,
                         unigram_bpb(corpus.train, corpus.validation))
