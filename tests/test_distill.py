"""`zoo distill`: the loss against a hand computation, a saved student that starts as saved, a teacher whose
distributions it moves toward, the from-scratch twin, resume, and refusals before any work."""
import math

import pytest
import torch

import zoo
from harness import cli
from harness.train import TrainSettings, objective, run_train
from harness.train.checkpoint import read_train_state
from harness.train.trainer import start_run
from helpers import random_model  # tests/ is on sys.path under pytest
from test_train import TINY, copy_corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return copy_corpus(tmp_path_factory.mktemp("corpus"))  # a few standard-library packages' sources


def test_the_distillation_loss_is_hinton_s_by_hand():
    student, teacher = random_model("gqa", seed=1), random_model("gqa", seed=2)
    windows = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    temperature, weight = 2.0, 0.3
    cross_entropy, loss = objective.distillation_loss(student, teacher, windows, temperature, weight)
    with torch.no_grad():
        s, t = student(windows[:, :-1]).double(), teacher(windows[:, :-1]).double()
    targets = windows[:, 1:]
    want_ce = -torch.log_softmax(s, -1).gather(-1, targets[..., None]).mean()
    p, q = torch.softmax(t / temperature, -1), torch.softmax(s / temperature, -1)
    kl = (p * (p.log() - q.log())).sum(-1).mean()  # per token: sum over the vocabulary
    assert cross_entropy.item() == pytest.approx(want_ce.item(), rel=1e-5)
    assert loss.item() == pytest.approx((1 - weight) * want_ce.item() + weight * temperature**2 * kl.item(), rel=1e-5)
    _, same = objective.distillation_loss(student, student, windows, temperature, 1.0)
    assert abs(same.item()) < 1e-6  # a student that is its teacher has nothing to learn from it


def saved_pair(tmp_path) -> tuple:
    """(teacher folder, student folder): a tiny gqa and a copy of it with half its FFN channels cut."""
    teacher = random_model("gqa", tie_embeddings=True)
    student = zoo.prune(teacher, zoo.PrunePlan((0, 1), channels={0: tuple(range(0, 192, 2)),
                                                                  1: tuple(range(0, 192, 2))}))
    return zoo.save(teacher, tmp_path / "teacher"), zoo.save(student, tmp_path / "student")


def settings(tmp_path, corpus, teacher, student, **kw) -> TrainSettings:
    return TrainSettings(**{**TINY, "corpus": corpus, "out": tmp_path / "out", "arch": "gqa-pruned",
                            "preset": "saved", "init": student, "teacher": teacher, "max_steps": 6,
                            "eval_every": 3, **kw})


def test_a_saved_student_starts_as_saved_and_its_twin_from_random_weights(tmp_path, corpus_dir):
    teacher, student = saved_pair(tmp_path)
    saved = zoo.load(student).state_dict()
    run = start_run(settings(tmp_path, corpus_dir, teacher, student))
    assert all(torch.equal(run.model.state_dict()[name], tensor) for name, tensor in saved.items())
    assert run.teacher is not None and not run.teacher.training
    twin = start_run(settings(tmp_path, corpus_dir, None, student, init_weights=False, out=tmp_path / "twin"))
    assert twin.teacher is None and twin.model.config.layers == zoo.load(student).config.layers
    name = "blocks.0.mlp.down_proj.weight"
    assert not torch.equal(twin.model.state_dict()[name], saved[name])


@torch.no_grad()
def kl_to(teacher, student, windows) -> float:
    _, loss = objective.distillation_loss(student, teacher, windows, 1.0, 1.0)
    return loss.item()


def test_distilling_moves_the_student_toward_its_teacher_and_resumes(tmp_path, corpus_dir):
    teacher, student = saved_pair(tmp_path)
    windows = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(3))
    before = kl_to(zoo.load(teacher), zoo.load(student), windows)
    for weight, out in ((1.0, "kl"), (0.0, "bytes")):  # the teacher's distributions alone, the bytes alone
        run_train(settings(tmp_path, corpus_dir, teacher, student, distill_weight=weight, lr=1e-2, max_steps=12,
                           out=tmp_path / out), show_progress=False)
    kl, bytes_only = (kl_to(zoo.load(teacher), zoo.load(tmp_path / out / "checkpoint"), windows)
                      for out in ("kl", "bytes"))
    assert kl < before and kl < 0.7 * bytes_only  # (the random teacher is far from the bytes: they pull away)
    longer = run_train(settings(tmp_path, corpus_dir, teacher, student, distill_weight=1.0, lr=1e-2, max_steps=15,
                                out=tmp_path / "kl"), show_progress=False)
    assert longer["step"] == 15 and [r["step"] for r in read_train_state(tmp_path / "kl")["history"]] == [3, 6, 9,
                                                                                                            12, 15]


@pytest.mark.parametrize("change, message", [
    ({"distill_temperature": 0.0}, "distill_temperature must be"),
    ({"distill_weight": 1.5}, "distill_weight must be"),
    ({"context": 5000}, "context 5000 is longer than"),
])
def test_bad_distillation_settings_are_refused_before_work(tmp_path, corpus_dir, change, message):
    teacher, student = saved_pair(tmp_path)
    with pytest.raises(ValueError, match=message):
        settings(tmp_path, corpus_dir, teacher, student, **change).validate()
    assert not (tmp_path / "out").exists()


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path, corpus_dir):
    _, student = saved_pair(tmp_path)
    other = zoo.save(random_model("gqa", vocab_size=300), tmp_path / "other")
    with pytest.raises(ValueError, match="the teacher's vocab_size 300 differs from the student's 512"):
        settings(tmp_path, corpus_dir, other, student).validate()


def test_cli_distills_and_trains_the_twin(tmp_path, corpus_dir, capsys):
    teacher, student = saved_pair(tmp_path)
    common = ["--student", str(student), "--corpus", str(corpus_dir), "--context", "32", "--batch-size", "4",
              "--max-steps", "2", "--minutes", "none", "--eval-every", "2", "--eval-windows", "4", "--quiet"]
    assert cli.main(["distill", "--teacher", str(teacher), "--out", str(tmp_path / "d"), *common]) == 0
    assert cli.main(["distill", "--scratch", "--out", str(tmp_path / "s"), *common]) == 0
    out = capsys.readouterr().out
    assert out.count("gqa-pruned/saved: val bpb") == 2
    assert read_train_state(tmp_path / "d")["settings"]["teacher"] == str(teacher.resolve())
    assert read_train_state(tmp_path / "s")["settings"]["teacher"] is None
    with pytest.raises(SystemExit, match="--teacher is needed"):
        cli.main(["distill", "--out", str(tmp_path / "x"), *common])
    assert math.isfinite(read_train_state(tmp_path / "s")["history"][-1]["val_bpb"])
