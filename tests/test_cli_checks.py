"""The `zoo` commands fail fast: every bad option is one `zoo <command>: error: ...` line and exit status 2, before
any model is built, measured or trained; repeated list values are dropped; damaged result rows are re-run."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

import zoo
from harness import cli, compare
from harness.recall import cli as recall_cli
from harness.recall import suite
from harness.results import ResultStore
from helpers import spread_weights  # tests/ is on sys.path under pytest

COMPARE = ["compare", "--archs", "gqa", "--preset", "tiny", "--contexts", "16", "--batches", "1", "--new-tokens", "3",
           "--quiet"]
RECALL = ["recall", "--archs", "gqa", "--seq-len", "16", "--kv-pairs", "2", "--held-out-kv-pairs", "", "--vocab-size",
          "64", "--min-steps", "1", "--max-steps", "1", "--quiet"]
GENERATE = ["generate", "--arch", "gqa", "--preset", "tiny", "--prompt", "hi", "--max-new-tokens", "3"]


def fail_if_called(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran before the bad option was reported")

    return fail


@pytest.fixture
def no_work(monkeypatch):
    """Building, measuring or training anything fails the test."""
    monkeypatch.setattr(compare, "build_model", fail_if_called("compare.build_model"))
    monkeypatch.setattr(compare, "measure_rates", fail_if_called("compare.measure_rates"))
    monkeypatch.setattr(suite, "make_splits", fail_if_called("recall data"))
    monkeypatch.setattr(suite, "train_recall", fail_if_called("recall training"))
    monkeypatch.setattr(zoo, "build", fail_if_called("zoo.build"))


def error_line(capsys, command: str) -> str:
    """The one line the command printed to stderr, which must be its error."""
    err = capsys.readouterr().err
    assert err.startswith(f"zoo {command}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# --out


@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (RECALL, "recall")])
def test_out_that_is_a_file_fails_before_work(tmp_path, capsys, no_work, argv, command):
    target = tmp_path / "results"
    target.write_text("not a folder")
    assert cli.main(argv + ["--out", str(target)]) == 2
    assert f"output folder '{target}' exists and is not a folder" in error_line(capsys, command)


@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (RECALL, "recall")])
def test_out_that_cannot_be_created_fails_before_work(tmp_path, capsys, no_work, argv, command):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "results"
    assert cli.main(argv + ["--out", str(target)]) == 2
    assert f"cannot create output folder '{target}': '{tmp_path / 'file'}' is a file" in error_line(capsys, command)
    assert not target.exists()


@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (RECALL, "recall")])
def test_out_that_cannot_be_written_fails_before_work(tmp_path, capsys, monkeypatch, no_work, argv, command):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # a read-only folder, as root (who may write anywhere) cannot make one with chmod
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    assert cli.main(argv + ["--out", str(locked / "new")]) == 2
    assert f"cannot write output folder '{locked / 'new'}': '{locked}' is not writable" in error_line(capsys, command)


# --archs


@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (RECALL, "recall")])
def test_empty_archs_is_an_error(tmp_path, capsys, no_work, argv, command):
    assert cli.main(argv + ["--archs", "", "--out", str(tmp_path)]) == 2
    assert "no architectures to" in error_line(capsys, command)
    assert list(tmp_path.iterdir()) == []  # no table.md.tmp, no results.jsonl


@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (RECALL, "recall")])
def test_unknown_arch_fails_before_work(tmp_path, capsys, no_work, argv, command):
    assert cli.main(argv + ["--archs", "gqa,nope", "--out", str(tmp_path)]) == 2
    assert "unknown architecture 'nope'; allowed: mha" in error_line(capsys, command)


# --device


@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (RECALL, "recall")])
def test_unknown_device_names_the_allowed_forms(tmp_path, capsys, no_work, argv, command):
    assert cli.main(argv + ["--device", "foo", "--out", str(tmp_path)]) == 2
    line = error_line(capsys, command)
    assert "unknown device 'foo'; allowed: cpu, cuda, cuda:N" in line
    assert ("CUDA is not available" in line) != torch.cuda.is_available()


@pytest.mark.parametrize("argv,command", [(COMPARE, "compare"), (RECALL, "recall")])
def test_missing_gpu_is_an_error(tmp_path, capsys, no_work, argv, command):
    gpu = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, or any GPU on a machine without CUDA
    assert cli.main(argv + ["--device", gpu, "--out", str(tmp_path)]) == 2
    assert f"device '{gpu}' is not available" in error_line(capsys, command)


# repeated list values


class Captured(Exception):
    """Raised in place of the run, carrying its settings."""


@pytest.fixture
def capture_runs(monkeypatch):
    def capture(settings, show_progress=True):
        raise Captured(settings)

    monkeypatch.setattr(cli, "run_compare", capture)
    monkeypatch.setattr(recall_cli, "run_recall", capture)


def test_compare_drops_repeated_values_keeping_order(tmp_path, capture_runs):
    argv = ["compare", "--archs", "mqa,gqa,mqa", "--preset", "tiny", "--contexts", "32,16,32", "--batches", "2,1,2,2",
            "--new-tokens", "8", "--out", str(tmp_path)]
    with pytest.raises(Captured) as run:
        cli.main(argv)
    settings = run.value.args[0]
    assert (settings.archs, settings.contexts, settings.batches) == (["mqa", "gqa"], [32, 16], [2, 1])
    assert len(settings.cells()) == 8


def test_compare_drops_repeated_diffusion_values(tmp_path, capture_runs):
    argv = ["compare", "--archs", "diffusion", "--preset", "tiny", "--contexts", "16", "--batches", "1",
            "--new-tokens", "8", "--diffusion-steps", "8,2,8", "--diffusion-caches", "none,dual,none", "--out",
            str(tmp_path)]
    with pytest.raises(Captured) as run:
        cli.main(argv)
    settings = run.value.args[0]
    assert (settings.diffusion_steps, settings.diffusion_caches) == ([8, 2], ["none", "dual"])


def test_recall_drops_repeated_values_keeping_order(tmp_path, capture_runs):
    argv = RECALL + ["--archs", "mqa,gqa,gqa", "--kv-pairs", "4,2,4", "--d-model", "24,16,24",
                     "--lrs", "3e-3,1e-3,0.003", "--out", str(tmp_path)]
    with pytest.raises(Captured) as run:
        cli.main(argv)
    settings = run.value.args[0]
    assert (settings.archs, settings.kv_pairs, settings.d_models, settings.lrs) == (["mqa", "gqa"], [4, 2], [24, 16],
                                                                                    [3e-3, 1e-3])


def test_list_of_non_integers_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(COMPARE + ["--batches", "1,x"])
    assert exit.value.code == 2
    assert "expected comma-separated integers, got '1,x'" in capsys.readouterr().err


# sizes and seeds


@pytest.mark.parametrize("option,value,message", [
    ("--contexts", "0", "contexts must be >= 1, got 0"),
    ("--contexts", "16,-4", "contexts must be >= 1, got -4"),
    ("--contexts", "", "contexts must be a non-empty list"),
    ("--batches", "0", "batches must be >= 1, got 0"),
    ("--batches", "", "batches must be a non-empty list"),
    ("--new-tokens", "0", "new_tokens (TPOT needs two tokens) must be >= 2, got 0"),
    ("--new-tokens", "-3", "new_tokens (TPOT needs two tokens) must be >= 2, got -3"),
    ("--block-length", "0", "block_length must be >= 1, got 0"),
    ("--block-size", "0", "block_size must be >= 1, got 0"),
    ("--block-size", "12", "block_size must be a power of two >= 1, got 12"),
    ("--seed", "-1", "seed must be in [0, 18446744073709551615], got -1"),
    ("--seed", str(2**64), f"seed must be in [0, 18446744073709551615], got {2**64}"),
])
def test_bad_compare_sizes_fail_before_work(tmp_path, capsys, no_work, option, value, message):
    assert cli.main(COMPARE + ["--out", str(tmp_path), option, value]) == 2
    assert message in error_line(capsys, "compare")


@pytest.mark.parametrize("option,value,message", [
    ("--seeds", "-1", "seeds must be in [0, 18446744073709551615], got -1"),
    ("--seeds", f"0,{2**64}", "seeds must be in [0, 18446744073709551615]"),
    ("--seeds", "", "seeds must be a non-empty list"),
    ("--d-model", "0", "d_models must be >= 1, got 0"),
    ("--state-d-model", "0", "state_d_models must be >= 1, got 0"),
    ("--held-out-kv-pairs", "5", "num_kv_pairs=5 too large for seq_len=16"),
    ("--min-steps", "0", "min_steps must be >= 1, got 0"),
    ("--kv-pairs", "", "kv_pairs must be a non-empty list"),
    ("--lrs", "nan", "learning rate must be a finite number > 0, got nan"),
    ("--lrs", "0", "learning rate must be a finite number > 0, got 0.0"),
    ("--workers", "0", "workers must be >= 1, got 0"),
])
def test_bad_recall_settings_fail_before_work(tmp_path, capsys, no_work, option, value, message):
    assert cli.main(RECALL + ["--out", str(tmp_path), option, value]) == 2
    assert message in error_line(capsys, "recall")


@pytest.mark.parametrize("option,value,message", [
    ("--max-new-tokens", "0", "max_new_tokens must be >= 1, got 0"),
    ("--seed", "-1", "seed must be in [0, 18446744073709551615], got -1"),
    ("--seed", str(2**64), "seed must be in [0, 18446744073709551615]"),
    ("--temperature", "-1", "temperature"),
    ("--top-p", "0", "top_p"),
])
def test_bad_generate_arguments_fail_before_the_model_is_built(capsys, no_work, option, value, message):
    assert cli.main(GENERATE + [option, value]) == 2
    assert message in error_line(capsys, "generate")


# --weights


def test_missing_weights_file_fails_before_the_model_is_built(tmp_path, capsys, no_work):
    path = tmp_path / "nothing.safetensors"
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    assert f"weights file '{path}' does not exist" in error_line(capsys, "generate")


def test_weights_folder_fails_before_the_model_is_built(tmp_path, capsys, no_work):
    assert cli.main(GENERATE + ["--weights", str(tmp_path)]) == 2  # a folder is read as a zoo.save checkpoint
    assert f"checkpoint folder '{tmp_path}' has no config.json and no model.safetensors" in error_line(capsys, "generate")


@pytest.mark.parametrize("suffix,reason", [(".pt", ""), (".safetensors", "Error while deserializing header")])
@pytest.mark.parametrize("content", [b"", b"garbage " * 64], ids=["empty", "garbage"])
def test_damaged_weights_file(tmp_path, capsys, suffix, reason, content):
    path = tmp_path / f"weights{suffix}"
    path.write_bytes(content)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    line = error_line(capsys, "generate")
    assert f"weights file '{path}' is damaged or not a " in line and reason in line


def test_truncated_checkpoint(tmp_path, capsys):
    path = tmp_path / "weights.pt"
    torch.save(zoo.build("gqa", preset="tiny").state_dict(), path)
    path.write_bytes(path.read_bytes()[:1000])
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    assert f"weights file '{path}' is damaged or not a PyTorch (torch.save) file (" in error_line(capsys, "generate")


class Payload:
    """A class a checkpoint must not make zoo import and run."""


def test_pickled_code_is_refused_without_advice_to_unpickle_it(tmp_path, capsys):
    path = tmp_path / "weights.pt"
    torch.save({"embed.weight": torch.zeros(2), "payload": Payload()}, path)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    line = error_line(capsys, "generate")
    assert f"weights file '{path}' holds pickled Python objects" in line and "Payload" in line
    assert "never unpickles code" in line
    assert "weights_only" not in line and "trust" not in line


def test_checkpoint_that_is_not_a_state_dict(tmp_path, capsys):
    path = tmp_path / "weights.pt"
    torch.save([torch.zeros(2)], path)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    assert f"weights file '{path}' holds a list, not a state dict" in error_line(capsys, "generate")
    torch.save({"embed.weight": torch.zeros(2), "step": 7}, path)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    assert "is not a state dict of tensors: not tensors (1): step" in error_line(capsys, "generate")


def test_weights_with_missing_and_unexpected_names(tmp_path, capsys):
    state = zoo.build("gqa", preset="tiny").state_dict()
    del state["blocks.1.mlp.up_proj.weight"]
    state["blocks.2.mixer.q_proj.weight"] = torch.zeros(64, 64)
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    line = error_line(capsys, "generate")
    assert f"weights file '{path}' does not fit gqa (preset tiny): " in line
    assert "missing (1): blocks.1.mlp.up_proj.weight; unexpected (1): blocks.2.mixer.q_proj.weight" in line


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_weights_of_another_shape(tmp_path, capsys, suffix):
    """mqa's K/V projections are half gqa's at the tiny size: the names fit, the shapes do not."""
    other = zoo.build("mqa", preset="tiny")
    path = tmp_path / f"weights{suffix}"
    save_model(other, str(path)) if suffix == ".safetensors" else torch.save(other.state_dict(), path)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    line = error_line(capsys, "generate")
    assert f"weights file '{path}' does not fit gqa (preset tiny): wrong shape (4): " in line
    assert "blocks.0.mixer.k_proj.weight 16x64 (the model's: 32x64)" in line
    assert "missing" not in line and "unexpected" not in line


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_tied_head_may_be_stored_once_or_twice(tmp_path, capsys, suffix):
    """The preset ties its head to the embedding: save_model stores the tensor once, torch.save(state_dict()) twice."""
    model = spread_weights(zoo.build("gqa", preset="tiny"), seed=3)
    path = tmp_path / f"weights{suffix}"
    save_model(model, str(path)) if suffix == ".safetensors" else torch.save(model.state_dict(), path)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 0
    assert capsys.readouterr().out.startswith("hi")


def test_untied_weights_do_not_fit_a_tied_model(tmp_path, capsys):
    path = tmp_path / "weights.pt"
    torch.save(zoo.build("gqa", preset="tiny", tie_embeddings=False).state_dict(), path)
    assert cli.main(GENERATE + ["--weights", str(path)]) == 2
    line = error_line(capsys, "generate")
    assert "one tensor in the model (tied), different in the file (1): embed.weight = head.weight" in line


# results.jsonl


def test_damaged_rows_are_skipped_with_a_warning_naming_each(tmp_path):
    path = tmp_path / "results.jsonl"
    good = {"arch": "gqa", "batch": 1, "ttft_ms": 3.0}
    lines = [json.dumps(good), "[1, 2]", '"x"', '{"arch": "gqa", "bat', "{}", "", '{"arch": "gqa"}',
             '{"arch": ["gqa"], "batch": 2}']
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe{}\n")
    with pytest.warns(UserWarning) as caught:
        store = ResultStore(path, ("arch", "batch"))
    reasons = {2: "a JSON list, not an object)", 3: "a JSON str, not an object)", 4: "not JSON: ",
               5: "no arch, batch)", 7: "no batch)", 8: "arch not a plain value)", 9: "not UTF-8 text)"}
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(reasons)
    for message, (number, reason) in zip(messages, reasons.items()):
        assert message.startswith(f"{path}:{number}: skipped a damaged row ({reason}"), message
        assert message.endswith("its cell will be run again")
    assert store.rows == [good]
    assert store.done({"arch": "gqa", "batch": 1}) and not store.done({"arch": "gqa", "batch": 2})
    store.append({"arch": "gqa", "batch": 2})  # the rewrite leaves the damaged lines behind
    assert [json.loads(line) for line in path.read_text().splitlines()] == [good, {"arch": "gqa", "batch": 2}]


def test_compare_runs_the_cell_of_a_damaged_row_again(tmp_path, monkeypatch):
    settings = compare.CompareSettings(archs=["gqa"], preset="tiny", contexts=[16], batches=[1, 2], new_tokens=3,
                                       out=tmp_path)
    first, second = settings.cells()
    torn = json.dumps({**second, "ttft_ms": 2.0})[:40]
    (tmp_path / "results.jsonl").write_text(json.dumps({**first, "ttft_ms": 1.0}) + "\n" + torn + "\n")
    measured = []
    monkeypatch.setattr(compare, "measure_rates", lambda settings: None)
    monkeypatch.setattr(compare, "build_model", lambda arch, settings: None)
    monkeypatch.setattr(compare, "measure_cell", lambda model, cell, rates, seed, **_: measured.append(cell) or
                        {**cell, "ttft_ms": 3.0})
    with pytest.warns(UserWarning, match=r"results.jsonl:2: skipped a damaged row \(not JSON"):
        rows = compare.run_compare(settings, show_progress=False)
    assert measured == [second]
    assert [row["ttft_ms"] for row in rows] == [1.0, 3.0]
