"""Resumable training checkpoints, written so a kill at any moment leaves the previous checkpoint or the new one.

    OUT/checkpoint -> step-00001200     a symbolic link to the newest complete checkpoint
    OUT/step-00001200/
        config.json, model.safetensors  zoo.save: zoo.load("OUT/checkpoint") rebuilds the model
        optimizer.pt                    torch.save(optimizer.state_dict()), read back with weights_only=True
        train_state.json                step, tokens, trained seconds, evaluations, settings, unigram baseline, corpus
    OUT/results.jsonl                   one row per evaluation

A checkpoint is written into step-N.tmp, renamed to step-N, and then published by replacing the link with a new
one (os.replace of a link is atomic); the previous step folder is removed after that. Leftovers of a run killed
mid-write (a .tmp folder, a step folder never linked) are removed by the next save.
"""
import json
import os
import re
import shutil
from pathlib import Path

import torch

import zoo

LINK = "checkpoint"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.json"
STATE_FIELDS = ("step", "tokens", "trained_s", "wall_s", "history", "settings", "unigram_bpb", "corpus")
OWN_ENTRIES = re.compile(r"step-\d{8}(\.tmp)?|checkpoint\.tmp")  # what a save may remove from OUT


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_folder(out: Path) -> Path | None:
    """The folder OUT's link names, or None when OUT holds no checkpoint."""
    link = Path(out) / LINK
    if not link.is_symlink():
        if link.exists():
            raise ValueError(f"{link} is not a checkpoint link (zoo train makes it a link to a step folder)")
        return None
    folder = link.resolve()
    if not folder.is_dir():
        raise ValueError(f"{link} points to {folder}, which is missing: the checkpoint is damaged")
    return folder


def read_train_state(out: Path) -> dict | None:
    """The newest checkpoint's train state, or None when OUT holds no checkpoint."""
    folder = checkpoint_folder(out)
    if folder is None:
        return None
    file = folder / STATE_FILE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is missing or damaged ({type(error).__name__}): the checkpoint cannot be resumed; "
                         f"pass another --out to start afresh") from None
    missing = [name for name in STATE_FIELDS if not isinstance(state, dict) or name not in state]
    if missing:
        raise ValueError(f"{file} is not a zoo train state: no {', '.join(missing)}")
    return state


def read_optimizer_state(folder: Path, device: str) -> dict:
    file = folder / OPTIMIZER_FILE
    try:
        return torch.load(file, map_location=device, weights_only=True)  # tensors and numbers only, never code
    except Exception as error:  # a damaged file fails inside torch with errors of any type
        raise ValueError(f"{file} is missing or damaged ({type(error).__name__}): the checkpoint cannot be "
                         f"resumed; pass another --out to start afresh") from None


def save_checkpoint(out: Path, model, optimizer, state: dict) -> Path:
    """Write model, optimizer and train state as OUT's newest checkpoint; returns its folder."""
    out = Path(out)
    linked = checkpoint_folder(out)
    for entry in out.iterdir() if out.exists() else ():
        if OWN_ENTRIES.fullmatch(entry.name) and (linked is None or entry.resolve() != linked):
            remove(entry)
    name = step_name(state["step"])
    tmp = out / f"{name}.tmp"
    zoo.save(model, tmp)
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, out / name)
    link_tmp = out / f"{LINK}.tmp"
    os.symlink(name, link_tmp)  # relative: OUT can be moved or copied whole
    os.replace(link_tmp, out / LINK)
    if linked is not None:
        shutil.rmtree(linked)
    return out / name


def remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()
