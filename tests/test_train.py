"""`zoo train`: the corpus split, batches by (seed, step), the schedule, the unigram baseline, learning, and a killed
run that resumes to the very weights of an uninterrupted one."""
import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch

import zoo
from harness import cli
from harness.train import TrainSettings, load_corpus, run_train, training_batch, unigram_bpb, validation_windows
from harness.train import checkpoint, objective, trainer
from harness.train.corpus import (VALIDATION_SHARE, hash_fraction, stdlib_files, stdlib_root, training_starts,
                                  validation_starts)
from harness.train.schedule import FINAL_SHARE, lr_factor, progress

# a run that takes a second: the tiny preset on 32-byte windows, 8 per step, steps only (no clock in the schedule)
TINY = {"preset": "tiny", "context": 32, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "minutes": None,
        "eval_windows": 16, "autocast": "off"}
STDLIB_PACKAGES = ("json", "logging", "http", "urllib", "email/mime")


def copy_corpus(folder):
    """Real text, small: a few standard-library packages' sources, under their own relative paths."""
    root = stdlib_root()
    for package in STDLIB_PACKAGES:
        for file in sorted((root / package).glob("*.py")):
            target = folder / file.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, target)
    return folder


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return copy_corpus(tmp_path_factory.mktemp("corpus"))


def tiny(out, corpus, **kw) -> TrainSettings:
    return TrainSettings(**{**TINY, "corpus": corpus, "out": out, **kw})


# ---- the corpus --------------------------------------------------------------------------------------------------


def test_stdlib_split_is_by_file_deterministic_disjoint_and_sized():
    first, again = load_corpus(), load_corpus()
    assert np.array_equal(first.train, again.train) and np.array_equal(first.validation, again.validation)
    root = stdlib_root()
    files = sorted(stdlib_files(root), key=lambda p: p.relative_to(root).as_posix())
    assert not any({"site-packages", "dist-packages"} & set(p.relative_to(root).parts) for p in files)
    held_out = [p for p in files if hash_fraction(p.relative_to(root).as_posix()) < VALIDATION_SHARE]
    d = first.description
    assert (d["train_files"], d["validation_files"]) == (len(files) - len(held_out), len(held_out))
    assert (d["train_bytes"], d["validation_bytes"]) == (len(first.train), len(first.validation))
    assert d["train_bytes"] + d["validation_bytes"] == sum(p.stat().st_size for p in files)
    assert first.validation.tobytes() == b"".join(p.read_bytes() for p in held_out)  # in sorted order, whole files
    assert 0.02 < d["validation_bytes"] / (d["train_bytes"] + d["validation_bytes"]) < 0.1


def test_folder_and_file_corpora(tmp_path):
    corpus_dir = copy_corpus(tmp_path / "corpus")
    corpus = load_corpus(corpus_dir)
    names = sorted(p.relative_to(corpus_dir).as_posix() for p in corpus_dir.rglob("*.py"))
    fractions = {name: hash_fraction(name) for name in names}
    non_empty = [n for n in names if (corpus_dir / n).stat().st_size]
    held_out = [n for n in names if fractions[n] < VALIDATION_SHARE] or [min(non_empty, key=fractions.get)]
    assert corpus.validation.tobytes() == b"".join((corpus_dir / n).read_bytes() for n in held_out)
    assert corpus.train.tobytes() == b"".join((corpus_dir / n).read_bytes() for n in names if n not in held_out)
    (corpus_dir / ".git").mkdir(exist_ok=True)
    (corpus_dir / ".git" / "objects").write_bytes(b"\xff" * 1000)  # hidden folders are not text to learn
    assert load_corpus(corpus_dir).description == corpus.description
    text = tmp_path / "one.txt"
    text.write_bytes(bytes(range(200)))
    single = load_corpus(text)
    assert single.train.tobytes() == bytes(range(190)) and single.validation.tobytes() == bytes(range(190, 200))
    assert single.description["train_bytes"] == 190 and single.description["source"] == "file"


def test_batches_are_a_function_of_seed_and_step(corpus_dir):
    corpus = load_corpus(corpus_dir)
    batch = training_batch(corpus, seed=0, step=5, batch_size=4, length=33)
    assert batch.shape == (4, 33) and batch.dtype == torch.long and int(batch.max()) < 256
    assert torch.equal(batch, training_batch(corpus, seed=0, step=5, batch_size=4, length=33))
    assert not torch.equal(batch, training_batch(corpus, seed=0, step=6, batch_size=4, length=33))
    assert not torch.equal(batch, training_batch(corpus, seed=1, step=5, batch_size=4, length=33))
    train = corpus.train.tobytes()
    assert all(bytes(row.tolist()) in train for row in batch)  # windows of the train split
    windows = validation_windows(corpus, 8, 33)
    assert torch.equal(windows, validation_windows(corpus, 8, 33))
    assert all(bytes(row.tolist()) in corpus.validation.tobytes() for row in windows)


def test_a_window_start_is_traced_to_its_file(tmp_path):
    # the files are told apart by their bytes: file i is all byte i
    folder = tmp_path / "corpus"
    folder.mkdir()
    sizes = [300, 50, 700, 1, 120, 400, 90, 260]
    for i, size in enumerate(sizes):
        (folder / f"f{i}.txt").write_bytes(bytes([i]) * size)
    corpus = load_corpus(folder)
    for side, data in (("train", corpus.train), ("validation", corpus.validation)):
        names = corpus.file_names[side]
        assert corpus.file_ends[side][-1] == len(data)
        offsets = np.arange(len(data))
        assert [names[i] for i in corpus.files_at(side, offsets)] == [f"f{b}.txt" for b in data.tolist()]
    starts = validation_starts(corpus, 16, 1)
    assert torch.equal(validation_windows(corpus, 16, 1)[:, 0], torch.from_numpy(corpus.validation[starts]).long())
    starts = training_starts(corpus, 3, 2, 16, 1)
    assert torch.equal(training_batch(corpus, 3, 2, 16, 1)[:, 0], torch.from_numpy(corpus.train[starts]).long())
    text = tmp_path / "one.txt"
    text.write_bytes(bytes(range(200)))
    single = load_corpus(text)
    assert single.file_names == {"train": ("one.txt",), "validation": ("one.txt",)}
    assert single.files_at("validation", [0, 9]).tolist() == [0, 0]


# ---- schedule and baseline ---------------------------------------------------------------------------------------


def test_lr_schedule_warms_up_then_decays_to_a_tenth_by_either_budget():
    assert [lr_factor(step, 0.0, 4) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(10, 0.0, 4) == 1.0 and lr_factor(10, 0.0, 0) == 1.0
    assert lr_factor(10, 0.5, 4) == pytest.approx(FINAL_SHARE + (1 - FINAL_SHARE) / 2)
    assert lr_factor(10, 1.0, 4) == pytest.approx(FINAL_SHARE)
    assert progress(50, 0.0, 100, None) == 0.5
    assert progress(50, 90.0, 100, 2.0) == 0.75  # 90 s of a 2-minute budget is further along than 50 of 100 steps
    assert progress(10, 30.0, None, 1.0) == 0.5
    assert progress(200, 0.0, 100, None) == 1.0


def test_unigram_baseline_against_a_hand_computed_value():
    train, validation = np.frombuffer(b"aab", np.uint8), np.frombuffer(b"abz", np.uint8)
    # add-one smoothing over 256 byte values: a 2 + 1, b 1 + 1, every other byte 0 + 1; total 3 + 256
    expected = -(math.log2(3 / 259) + math.log2(2 / 259) + math.log2(1 / 259)) / 3
    assert unigram_bpb(train, validation) == pytest.approx(expected, rel=1e-12)


# ---- training ----------------------------------------------------------------------------------------------------


def test_a_few_steps_lower_the_validation_bpb(tmp_path, corpus_dir):
    settings = tiny(tmp_path, corpus_dir, max_steps=30, eval_every=10)
    corpus = load_corpus(corpus_dir)
    torch.manual_seed(0)
    untrained = objective.validation_bpb(zoo.build("gqa", preset="tiny"), validation_windows(corpus, 16, 33), 8)
    assert untrained == pytest.approx(math.log2(512), abs=0.5)  # near uniform over the preset's 512 ids
    result = run_train(settings, show_progress=False)
    history = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [10, 20, 30] and history[-1]["budget_end"]
    assert history[-1]["val_bpb"] < history[0]["val_bpb"] < untrained - 1
    assert result["val_bpb"] == history[-1]["val_bpb"] and result["tokens"] == 30 * 8 * 32
    assert result["unigram_bpb"] == pytest.approx(unigram_bpb(corpus.train, corpus.validation))
    assert result["val_metric"] == "bits per byte" and history[0]["arch"] == "gqa"


@pytest.mark.parametrize("arch", ["gqa", "diffusion"])
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path, corpus_dir, monkeypatch, arch):
    straight = run_train(tiny(tmp_path / "straight", corpus_dir, arch=arch, max_steps=12, eval_every=6),
                         show_progress=False)
    real_step = trainer.train_step

    def killed_at_step_9(run, lr, use_autocast):
        if run.state["step"] == 9:
            raise KeyboardInterrupt
        return real_step(run, lr, use_autocast)

    monkeypatch.setattr(trainer, "train_step", killed_at_step_9)
    with pytest.raises(KeyboardInterrupt):
        run_train(tiny(tmp_path / "resumed", corpus_dir, arch=arch, max_steps=12, eval_every=6), show_progress=False)
    assert checkpoint.read_train_state(tmp_path / "resumed")["step"] == 6  # the last checkpoint before the kill
    monkeypatch.setattr(trainer, "train_step", real_step)
    resumed = run_train(tiny(tmp_path / "resumed", corpus_dir, arch=arch, max_steps=12, eval_every=6),
                        show_progress=False)
    a, b = zoo.load(tmp_path / "straight" / "checkpoint"), zoo.load(tmp_path / "resumed" / "checkpoint")
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert resumed["val_bpb"] == straight["val_bpb"] and resumed["step"] == 12
    optimizer = [checkpoint.read_optimizer_state(tmp_path / run / "checkpoint", "cpu") for run in ("straight", "resumed")]
    assert all(torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
               for x, y in zip(optimizer[0]["state"].values(), optimizer[1]["state"].values()))
    assert len((tmp_path / "resumed" / "results.jsonl").read_text().splitlines()) == 2
    if arch == "diffusion":
        assert resumed["val_metric"] == objective.ELBO_BOUND


def test_a_raised_budget_continues_and_a_spent_one_returns_at_once(tmp_path, corpus_dir, capsys):
    run_train(tiny(tmp_path, corpus_dir, max_steps=4, eval_every=3), show_progress=False)
    assert [r["step"] for r in checkpoint.read_train_state(tmp_path)["history"]] == [3, 4]
    longer = run_train(tiny(tmp_path, corpus_dir, max_steps=8, eval_every=3), show_progress=False)
    assert longer["step"] == 8
    assert [r["step"] for r in checkpoint.read_train_state(tmp_path)["history"]] == [3, 4, 6, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "results.jsonl", "step-00000008"]
    capsys.readouterr()
    again = run_train(tiny(tmp_path, corpus_dir, max_steps=8, eval_every=3), show_progress=False)
    assert again == longer and "step" not in capsys.readouterr().out  # nothing trained or evaluated


@pytest.mark.parametrize("fails", ["torch.save", "os.symlink"])
def test_a_kill_while_saving_leaves_the_previous_checkpoint(tmp_path, corpus_dir, monkeypatch, fails):
    """Killed mid-write (the optimizer file) or after the rename but before the link moved: the link still names
    the previous, complete checkpoint, which resumes; the next save clears the leftovers."""
    module, name = (checkpoint.torch, "save") if fails == "torch.save" else (checkpoint.os, "symlink")
    real, calls = getattr(module, name), []

    def dies_on_second_save(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, dies_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        run_train(tiny(tmp_path, corpus_dir, max_steps=6, eval_every=3), show_progress=False)
    monkeypatch.setattr(module, name, real)
    assert os.readlink(tmp_path / "checkpoint") == "step-00000003"
    assert checkpoint.read_train_state(tmp_path)["step"] == 3
    leftover = "step-00000006.tmp" if fails == "torch.save" else "step-00000006"
    assert (tmp_path / leftover).is_dir()
    zoo.load(tmp_path / "checkpoint")
    assert run_train(tiny(tmp_path, corpus_dir, max_steps=6, eval_every=3), show_progress=False)["step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "results.jsonl", "step-00000006"]


def test_cli_trains_and_prints_the_summary(tmp_path, corpus_dir, capsys):
    argv = ["train", "--corpus", str(corpus_dir), "--context", "32", "--batch-size", "4", "--max-steps", "3",
            "--minutes", "none", "--eval-every", "2", "--eval-windows", "8", "--set", "layers=swa,gqa",
            "--set", "window=8", "--arch", "hybrid", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "hybrid/tiny: val bpb" in out and "unigram baseline" in out and "after 3 steps" in out
    model = zoo.load(tmp_path / "checkpoint")
    assert [layer.params.get("window") for layer in model.config.layers] == [8, None]
    assert checkpoint.read_train_state(tmp_path)["settings"]["overrides"] == {"layers": "swa,gqa", "window": 8}


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    blocks = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:")[1])
    helps = {block.split()[0]: " ".join(block.split()) for block in blocks if block.strip()}
    options = ["--arch", "--preset", "--set", "--corpus", "--context", "--batch-size", "--lr", "--warmup-steps",
               "--minutes", "--max-steps", "--eval-every", "--eval-windows", "--autocast", "--device", "--seed", "--out"]
    assert set(options) <= set(helps)
    for option in options:
        assert "(default: " in helps[option], helps[option]
