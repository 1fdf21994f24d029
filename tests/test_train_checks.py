"""`zoo train` fails fast: every bad option is one `zoo train: error: ...` line and exit status 2, before the corpus
is read or a model is built; a checkpoint is continued only by the settings that wrote it."""
import pytest

import zoo
from harness import cli
from harness.train import TrainSettings, run_train, trainer
from test_cli_checks import fail_if_called  # tests/ is on sys.path under pytest
from test_train import TINY, copy_corpus

TRAIN = ["train", "--context", "32", "--batch-size", "4", "--max-steps", "2", "--eval-windows", "4", "--quiet"]


@pytest.fixture
def no_work(monkeypatch):
    """Reading the corpus or building a model fails the test."""
    monkeypatch.setattr(trainer, "load_corpus", fail_if_called("the corpus"))
    monkeypatch.setattr(zoo, "build", fail_if_called("zoo.build"))
    monkeypatch.setattr(zoo, "load", fail_if_called("zoo.load"))


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("zoo train: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return copy_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("options,message", [
    (["--arch", "transformer"], "unknown architecture 'transformer'; allowed: mha, gqa"),
    (["--set", "vocab_size=128"], "vocab_size 128 is too small for a byte-level model"),
    (["--arch", "diffusion", "--set", "vocab_size=255"], "vocab_size 255 is too small"),
    (["--set", "colour=red"], "unknown setting(s) ['colour'] for 'gqa'"),
    (["--arch", "hybrid", "--set", "layers=swa,lstm"], "names unknown layer kind(s) ['lstm']"),
    (["--context", "600"], "context 600 is longer than the model's max_seq_len 512"),
    (["--context", "0"], "context must be >= 1, got 0"),
    (["--minutes", "0"], "minutes must be a finite number > 0, got 0.0"),
    (["--minutes", "-2"], "minutes must be a finite number > 0, got -2.0"),
    (["--minutes", "none", "--max-steps", "0"], "max_steps must be >= 1, got 0"),
    (["--batch-size", "0"], "batch_size must be >= 1, got 0"),
    (["--lr", "0"], "lr must be a finite number > 0"),
    (["--eval-every", "0"], "eval_every must be >= 1, got 0"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_a_bad_option_fails_before_work(tmp_path, capsys, no_work, options, message):
    assert cli.main(TRAIN + ["--out", str(tmp_path)] + options) == 2
    assert message in error_line(capsys)


def test_no_budget_at_all_fails(tmp_path, capsys, no_work):
    assert cli.main(["train", "--minutes", "none", "--out", str(tmp_path)]) == 2
    assert "no budget: give minutes, max_steps or both" in error_line(capsys)


@pytest.mark.parametrize("kind,message", [
    ("absent", "does not exist (pass a text file or a folder of them)"),
    ("empty file", "is empty"),
    ("folder of empty files", "holds no non-empty file outside hidden folders"),
])
def test_a_missing_or_empty_corpus_fails_before_work(tmp_path, capsys, no_work, kind, message):
    corpus = tmp_path / "corpus"
    if kind == "empty file":
        corpus.write_text("")
    elif kind == "folder of empty files":
        (corpus / ".hidden").mkdir(parents=True)
        (corpus / "empty.py").write_text("")
        (corpus / ".hidden" / "text.py").write_text("print('hidden')")
    assert cli.main(TRAIN + ["--out", str(tmp_path / "out"), "--corpus", str(corpus)]) == 2
    assert message in error_line(capsys)


def test_an_output_path_that_is_a_file_fails(tmp_path, capsys, no_work):
    (tmp_path / "out").write_text("")
    assert cli.main(TRAIN + ["--out", str(tmp_path / "out")]) == 2
    assert "exists and is not a folder" in error_line(capsys)


def test_a_corpus_too_small_for_one_window_fails_before_training(tmp_path, monkeypatch):
    (tmp_path / "short.txt").write_text("x" * 200)  # validation: the last 10 bytes
    monkeypatch.setattr(trainer, "train_step", fail_if_called("training"))
    with pytest.raises(ValueError, match="validation split holds 10 bytes, fewer than one window of 33"):
        run_train(TrainSettings(**{**TINY, "max_steps": 1}, corpus=tmp_path / "short.txt", out=tmp_path / "out"),
                  show_progress=False)


def test_a_checkpoint_is_continued_only_with_its_own_settings(tmp_path, corpus_dir, capsys, monkeypatch):
    out = ["--out", str(tmp_path), "--corpus", str(corpus_dir)]
    assert cli.main(TRAIN + out) == 0
    capsys.readouterr()
    monkeypatch.setattr(trainer, "load_corpus", fail_if_called("the corpus"))
    assert cli.main(TRAIN + out + ["--context", "16", "--lr", "0.02", "--set", "n_kv_heads=4"]) == 2
    err = error_line(capsys)
    assert "holds a checkpoint trained with other settings" in err
    assert "overrides {} (checkpoint) vs {'n_kv_heads': 4} (now)" in err
    assert "context 32 (checkpoint) vs 16 (now)" in err and "lr 0.01 (checkpoint) vs 0.02 (now)" in err
    assert "only minutes, max_steps, eval_every, autocast, device, out may change" in err
