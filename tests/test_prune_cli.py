"""`zoo prune` end to end on a small saved model: it lands on its target, writes a loadable model and its figures,
continues after a kill, and refuses bad input before any work."""
import inspect
import json
from pathlib import Path

import pytest
import torch

import zoo
from harness import cli
from harness.prune import cli as prune_cli
from helpers import random_model  # tests/ is on sys.path under pytest


@pytest.fixture
def saved(tmp_path) -> tuple[Path, Path]:
    """(a saved tiny gqa model, a text file to calibrate on: real Python source)."""
    corpus = tmp_path / "text.py"
    corpus.write_text(inspect.getsource(json) * 4)
    return zoo.save(random_model("gqa", n_layers=3), tmp_path / "weights"), corpus


def prune(weights: Path, corpus: Path, out: Path, *extra: str) -> None:
    cli.main(["prune", "--weights", str(weights), "--corpus", str(corpus), "--out", str(out), "--windows", "4",
              "--context", "32", "--eval-windows", "4", *extra])


def test_prune_lands_on_its_target_and_writes_a_loadable_model(saved, tmp_path, capsys):
    weights, corpus = saved
    prune(weights, corpus, tmp_path / "out", "--target", "0.6", "--by", "depth+mlp")
    report = json.loads((tmp_path / "out" / "prune.json").read_text())
    before = zoo.parameter_counts(zoo.load(weights)).total
    assert report["parameters_before"] == before and report["target"] == round(0.6 * before)
    assert abs(report["parameters_after"] - report["target"]) <= 0.02 * report["target"]
    pruned = zoo.load(tmp_path / "out" / "model")
    assert zoo.parameter_counts(pruned).total == report["parameters_after"]
    assert len(pruned.blocks) == len(report["layers_kept"]) < 3
    assert report["bpb_after"] > 0 and report["bpb_before"] > 0
    assert f"-> {report['parameters_after']:,} parameters" in capsys.readouterr().out


def test_a_rerun_continues_from_what_was_written(saved, tmp_path, monkeypatch, capsys):
    weights, corpus = saved
    out = tmp_path / "out"
    prune(weights, corpus, out, "--target", "0.7")
    first = (out / "prune.json").read_text()

    def measured_again(*args, **kwargs):
        raise AssertionError("calibration ran again")
    monkeypatch.setattr(prune_cli, "measure_importance", measured_again)
    prune(weights, corpus, out, "--target", "0.7")  # finished: only the summary
    assert (out / "prune.json").read_text() == first
    (out / "prune.json").unlink()  # killed after the scores were written: they are reused
    for file in (out / "model").iterdir():
        file.unlink()
    (out / "model").rmdir()
    prune(weights, corpus, out, "--target", "0.7")
    assert json.loads((out / "prune.json").read_text()) == json.loads(first)
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(zoo.load(out / "model")(x), zoo.prune(zoo.load(weights), plan_of(out))(x))


def plan_of(out: Path) -> zoo.PrunePlan:
    """The plan prune.json's figures describe, rebuilt from importance.json (the same scores, the same target)."""
    from harness.prune.importance import Importance
    from harness.prune.plan import plan_for_target
    report, scores = (json.loads((out / name).read_text()) for name in ("prune.json", "importance.json"))
    model = zoo.load(Path(report["calibration"]["weights"]))
    return plan_for_target(model, Importance.from_json(scores["importance"]), report["target"], report["by"],
                           report["kv_heads"])


def test_embedding_channels_prune_to_the_target_and_report_the_cache(saved, tmp_path):
    weights, corpus = saved
    prune(weights, corpus, tmp_path / "out", "--target", "0.5", "--by", "embedding")
    report = json.loads((tmp_path / "out" / "prune.json").read_text())
    pruned = zoo.load(tmp_path / "out" / "model")
    assert pruned.config.d_model == report["embedding_kept"] < 64
    assert abs(report["parameters_after"] - report["target"]) <= 0.02 * report["target"]
    assert report["cache_bytes_per_token_after"] == report["cache_bytes_per_token_before"]  # head_dim kept
    assert report["decode_weight_bytes_after"] < report["decode_weight_bytes_before"]


@pytest.mark.parametrize("args, message", [
    (["--target", "1e9"], "is not below the model's"),
    (["--target", "50"], "below the .* that cutting by mlp can reach"),
    (["--target", "0.5", "--windows", "0"], "--windows must be >= 1"),
    (["--target", "0.5", "--by", "heads+mlp", "--kv-heads", "3"], "kv_heads must be between 1 and 2"),
    (["--target", "0.5", "--context", "5000"], "--context 5000 needs 5001 positions"),
    (["--target", "1000", "--by", "embedding"], "below the .* that cutting by embedding can reach .*one embedding"),
    ([], "give one of --target .* and --decode-target"),
    (["--target", "0.5", "--decode-target", "0.5"], "give one of --target"),
    (["--decode-target", "1.5"], "decode target must be a share of the decode step's bytes, between 0 and 1, got 1.5"),
    (["--decode-target", "0.5", "--decode-context", "0"], "decode context must be cached tokens >= 1, got 0"),
    (["--decode-target", "0.05"], r"decode target 5.0% of .* bytes a step \(context 1024\) is below the .* that "
                                  "cutting by mlp can reach"),
])
def test_bad_input_is_refused_before_any_work(saved, tmp_path, args, message):
    weights, corpus = saved
    with pytest.raises(SystemExit, match=message):
        prune(weights, corpus, tmp_path / "out", *args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("by", ["heads+mlp", "depth+mlp"])
def test_a_decode_target_prunes_to_the_most_parameters_whose_step_reads_within_it(saved, tmp_path, by):
    from harness.prune.plan import decode_bytes
    weights, corpus = saved
    prune(weights, corpus, tmp_path / "out", "--decode-target", "0.6", "--decode-context", "64", "--by", by)
    report = json.loads((tmp_path / "out" / "prune.json").read_text())
    model, pruned = zoo.load(weights), zoo.load(tmp_path / "out" / "model")
    full = zoo.decode_weight_bytes(model) + zoo.cache_bytes(model, 64)
    step = zoo.decode_weight_bytes(pruned) + zoo.cache_bytes(pruned, 64)
    assert report["decode_step_bytes_before"] == full and report["decode_step_bytes_after"] == step
    assert 0.5 * full < step <= 0.6 * full  # within the budget, and not far under it
    assert report["target"] is None and report["parameters_after"] < report["parameters_before"]
    assert decode_bytes(model, zoo.PrunePlan((0, 1, 2)), 64) == full


def test_a_cache_target_chooses_the_kv_groups_every_layer_keeps(tmp_path):
    """mha tiny: 4 KV heads a layer; half the cache a token keeps 2 in every layer, and the parameter target still
    lands within 2% (channels make up the rest)."""
    corpus = tmp_path / "text.py"
    corpus.write_text(inspect.getsource(json) * 4)
    weights = zoo.save(random_model("mha", n_layers=2), tmp_path / "weights")
    prune(weights, corpus, tmp_path / "out", "--target", "0.6", "--by", "heads+mlp", "--cache-target", "0.5")
    report = json.loads((tmp_path / "out" / "prune.json").read_text())
    assert report["kv_heads"] == 2 and set(report["kv_heads_kept"].values()) == {2}
    assert report["cache_bytes_per_token_after"] * 2 == report["cache_bytes_per_token_before"]
    assert abs(report["parameters_after"] - report["target"]) <= 0.02 * report["target"]


@pytest.mark.parametrize("args, message", [
    (["--cache-target", "0.1"], "below the .* that one KV group in every cuttable attention layer keeps"),
    (["--cache-target", "1e9"], "is not below the model.s"),
    (["--cache-target", "0.5", "--kv-heads", "1"], "--cache-target chooses --kv-heads"),
])
def test_a_cache_target_no_plan_can_meet_is_refused_before_work(saved, tmp_path, args, message):
    weights, corpus = saved
    with pytest.raises(SystemExit, match=message):
        prune(weights, corpus, tmp_path / "out", "--target", "0.6", "--by", "heads+mlp", *args)
    assert not (tmp_path / "out").exists()
