"""`zoo compare --weights DIR`: trained checkpoints instead of random weights, each row with the validation bits per
byte compare measured itself, the quality chart, and every wrong folder reported before any work."""
import json

import pytest

import zoo
from harness import cli, compare
from harness.charts import budget_title, write_charts
from harness.compare import CompareSettings, run_compare
from harness.quant_calibration import Calibration
from harness.train import TrainSettings, run_train, trained
from test_train import TINY, copy_corpus  # tests/ is on sys.path under pytest
from test_cli_checks import fail_if_called

ARCHS = ("gqa", "mamba")
# the module's compare runs share one measurement of the machine: these tests are about trained checkpoints
pytestmark = pytest.mark.usefixtures("machine_rates_once")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two tiny architectures trained for a handful of steps, one output folder each, named by architecture."""
    corpus = copy_corpus(tmp_path_factory.mktemp("corpus"))
    root = tmp_path_factory.mktemp("weights")
    finals = {}
    for arch in ARCHS:
        settings = TrainSettings(**{**TINY, "eval_windows": trained.EVAL_WINDOWS}, arch=arch, corpus=corpus,
                                 max_steps=6, eval_every=3, out=root / arch)
        finals[arch] = run_train(settings, show_progress=False)
    return root, finals


def settings(tmp_path, root, **kw) -> CompareSettings:
    return CompareSettings(**{"archs": list(ARCHS), "contexts": [16], "batches": [1, 2], "new_tokens": 3,
                              "out": tmp_path, "weights": root, **kw})


def test_rows_carry_the_validation_bpb_measured_in_compare(tmp_path, weights):
    root, finals = weights
    rows = run_compare(settings(tmp_path, root), show_progress=False)
    assert len(rows) == 4 and {r["preset"] for r in rows} == {"tiny"}  # the checkpoints' size
    for row in rows:
        final = finals[row["arch"]]
        # the same fixed windows the trainer scored at its last step (same context, same count)
        assert row["val_bpb"] == pytest.approx(final["val_bpb"], rel=1e-5)
        assert row["val_bpb"] < row["unigram_bpb"] + 4 and row["val_metric"] == "bits per byte"
        assert (row["train_steps"], row["train_tokens"]) == (6, 6 * TINY["batch_size"] * TINY["context"])
        assert row["train_minutes"] == pytest.approx(final["trained_s"] / 60)
        assert row["train_budget"] == "6 steps" and row["val_context"] == TINY["context"]
        assert row["weights"] == str((root / row["arch"] / "checkpoint").resolve())
    assert tmp_path / "quality_vs_cache.png" in write_charts(rows, tmp_path)
    assert rows[0]["train_hardware"].endswith("-core CPU")
    assert budget_title(rows) == f"equal budget: 6 steps / 1.5K tokens each on {rows[0]['train_hardware']}"


def test_cli_compare_with_weights_writes_the_quality_column_and_chart(tmp_path, weights, capsys):
    root, _ = weights
    argv = ["compare", "--archs", ",".join(ARCHS), "--contexts", "16", "--batches", "1", "--new-tokens", "3",
            "--weights", str(root), "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "val bpb" in out and "| gqa | 16 | 1 |" in out
    assert (tmp_path / "quality_vs_cache.png").stat().st_size > 0
    # random weights in the same folder are other cells: measured anew, never mistaken for the trained rows
    assert cli.main(argv[:-5] + ["--preset", "tiny", "--out", str(tmp_path), "--quiet"]) == 0
    assert "val bpb" not in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["weights"] is None for r in rows) == [False, False, True, True]


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(compare, "build_model", fail_if_called("compare.build_model"))
    monkeypatch.setattr(compare, "measure_rates", fail_if_called("compare.measure_rates"))
    monkeypatch.setattr(trained, "load_corpus", fail_if_called("the corpus"))
    monkeypatch.setattr(zoo, "load", fail_if_called("zoo.load"))


@pytest.mark.parametrize("change,message", [
    ({"archs": ["gqa", "mla"]}, "architecture 'mla' has no trained model in {root}: {root}/mla does not exist"),
    ({"preset": "small"}, "--preset 'small' was given, but the checkpoints in {root} must share one preset"),
    ({"weights": "absent"}, "weights folder 'absent' does not exist"),
    ({"contexts": [600]}, "context 600 + new_tokens 3 exceeds gqa's checkpoint's max_seq_len=512"),
])
def test_a_wrong_weights_folder_fails_before_work(tmp_path, weights, no_work, change, message):
    root, _ = weights
    with pytest.raises(ValueError) as error:
        run_compare(settings(tmp_path, root, **change), show_progress=False)
    assert message.format(root=root) in str(error.value)


def test_a_folder_named_for_another_architecture_is_refused(tmp_path, weights, no_work):
    root, _ = weights
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "mqa").symlink_to(root / "gqa")
    with pytest.raises(ValueError, match="holds a trained 'gqa', not 'mqa'"):
        run_compare(settings(tmp_path / "out", tmp_path / "w", archs=["mqa"]), show_progress=False)


def test_quantized_rows_and_the_memory_vs_quality_chart(tmp_path, weights, monkeypatch):
    """--quant adds an axis: each architecture at none, int8 and int4 (RTN and AWQ calibrated on training windows),
    its weight bytes as stored, its own validation figure; memory_vs_quality.png puts them side by side."""
    root, _ = weights
    # compare's AWQ path at test_quant_calibration's size: what calibration gives is that test's; here its wiring
    monkeypatch.setattr(compare, "AWQ_CALIBRATION", Calibration(windows=4, context=64, prompts=4, prompt_len=8,
                                                                new_tokens=8))
    rows = run_compare(settings(tmp_path, root, quant=["none", "int8", "int4"], quant_group=32, batches=[1]),
                       show_progress=False)
    by = {(r["arch"], r["quant"]): r for r in rows}
    assert set(by) == {(a, q) for a in ARCHS for q in ("none", "int8", "int4/g32")}
    for arch in ARCHS:
        none, int8, int4 = by[arch, "none"], by[arch, "int8"], by[arch, "int4/g32"]
        assert int4["weight_bytes"] < int8["weight_bytes"] < none["weight_bytes"]
        assert none["weight_bytes"] == zoo.parameter_bytes(zoo.load(root / arch))
        assert int8["val_bpb"] != none["val_bpb"] and abs(int8["val_bpb"] - none["val_bpb"]) < 0.05
    assert tmp_path / "memory_vs_quality.png" in write_charts(rows, tmp_path)
    awq = run_compare(settings(tmp_path / "awq", root, quant=["int4"], quant_group=32, quant_method="awq",
                               batches=[1]), show_progress=False)
    assert {r["quant"] for r in awq} == {"int4/g32/awq"}
    with pytest.raises(ValueError, match="unknown quant 'int3'"):
        run_compare(settings(tmp_path, root, quant=["int3"]), show_progress=False)
    with pytest.raises(ValueError, match="gqa: group_size=128 does not divide the input width 192"):
        run_compare(settings(tmp_path, root, quant=["int4"], quant_group=128), show_progress=False)
