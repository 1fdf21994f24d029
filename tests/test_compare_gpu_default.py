"""`zoo compare --device cuda`: the GPU defaults resolved from the device alone (no GPU needed), explicit settings over
them, the large preset sized on the meta device, decode-probe cells and memory skips run on the CPU."""
import json

import pytest
import torch

import zoo
from harness import cli, compare, compare_device, roofline
from harness.compare import CompareSettings, run_compare

H100_COPY_BYTES_PER_S = 3.0e12  # device-to-device copy, read + write counted (BENCHMARKS.md: 2993 GB/s measured)
H200_COPY_BYTES_PER_S = 4.3e12
GPU_DEFAULT = {"preset": "large", "contexts": [1024, 8192, 32768], "batches": [1, 16, 64], "dtype": "bfloat16",
               "kv_cache": "paged", "measure": "decode-probe", "cuda_graphs": None, "new_tokens": 16}
CPU_DEFAULT = {"preset": "small", "contexts": [256, 1024, 2048], "batches": [1, 2, 4], "dtype": "float32",
               "kv_cache": "contiguous", "measure": "generate", "cuda_graphs": None, "new_tokens": 64}


def settings_fields(settings: CompareSettings, names) -> dict:
    return {name: getattr(settings, name) for name in names}


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_resolves_the_gpu_defaults_without_a_gpu(device):
    settings = CompareSettings(device=device)
    assert settings_fields(settings, GPU_DEFAULT) == GPU_DEFAULT
    assert settings.archs == zoo.compare_defaults()
    cells = settings.cells()
    assert len(cells) == len(zoo.compare_defaults()) * 3 * 3
    # graphs "auto": the engine's default, which is on for a CUDA model
    assert {(c["measure"], c["graphs"], c["dtype"], c["kv_cache"]) for c in cells} == {
        ("decode-probe", "auto", "bfloat16", "paged")}


def test_the_cpu_defaults_are_unchanged():
    settings = CompareSettings()
    assert settings_fields(settings, CPU_DEFAULT) == CPU_DEFAULT
    cells = settings.cells()
    assert [(c["arch"], c["context"], c["batch"]) for c in cells] == [
        (a, c, b) for a in zoo.compare_defaults() for c in (256, 1024, 2048) for b in (1, 2, 4)]
    assert {(c["measure"], c["graphs"]) for c in cells} == {("generate", "auto")}


@pytest.mark.parametrize("name,value", [("preset", "base"), ("contexts", [512]), ("batches", [2, 8]),
                                        ("dtype", "float32"), ("kv_cache", "contiguous"), ("measure", "generate"),
                                        ("cuda_graphs", False), ("new_tokens", 32)])
def test_an_explicit_setting_wins_over_the_gpu_default(name, value):
    settings = CompareSettings(device="cuda", **{name: value})
    assert getattr(settings, name) == value
    others = {k: v for k, v in GPU_DEFAULT.items() if k != name}
    assert settings_fields(settings, others) == others


def test_explicit_cli_flags_win_over_the_gpu_default(tmp_path, monkeypatch):
    """The CLI leaves unset options None, so the settings' device rule sees what the user gave."""
    given = []
    monkeypatch.setattr(cli, "run_compare", lambda settings, show_progress: given.append(settings) or [])
    argv = ["compare", "--device", "cuda", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    assert settings_fields(given[-1], GPU_DEFAULT) == GPU_DEFAULT
    assert cli.main(argv + ["--dtype", "float16", "--contexts", "4096", "--measure", "generate",
                            "--no-cuda-graphs", "--preset", "base"]) == 0
    assert settings_fields(given[-1], GPU_DEFAULT) == {**GPU_DEFAULT, "dtype": "float16", "contexts": [4096],
                                                      "measure": "generate", "cuda_graphs": False, "preset": "base"}
    assert cli.main(["compare", "--out", str(tmp_path), "--quiet"]) == 0
    assert settings_fields(given[-1], CPU_DEFAULT) == CPU_DEFAULT


def test_compare_help_mentions_the_cuda_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "with --device cuda, each option you leave out takes the GPU default" in text
    for default in ("CUDA default: large", "CUDA default: 1024,8192,32768", "CUDA default: 1,16,64",
                    "CUDA default: bfloat16", "CUDA default: paged", "CUDA default: decode-probe", "--cuda-graphs",
                    "on for CUDA", "docs/gpu.md"):
        assert default in text


@pytest.fixture(scope="module")
def large_models() -> dict:
    """Every compare-default architecture at the large preset in bf16, on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return {arch: zoo.build(arch, preset="large").to(torch.bfloat16) for arch in zoo.compare_defaults()}


def test_the_large_preset_streams_its_bf16_weights_for_over_a_millisecond(large_models):
    """On an H100's copy rate, and on an H200's, for every compare-default architecture: sized without allocating."""
    preset = zoo.PRESETS["large"]
    assert preset.d_model // preset.n_heads == 128 and preset.max_seq_len >= 32768 + 16
    for arch, model in large_models.items():
        assert all(p.is_meta for p in model.parameters())
        weight_bytes = roofline.weight_bytes(model, torch.bfloat16)  # what one decode step streams
        assert weight_bytes >= H100_COPY_BYTES_PER_S * 1e-3, arch
        assert weight_bytes >= H200_COPY_BYTES_PER_S * 1e-3, arch
    params = sum(p.numel() for p in large_models["gqa"].parameters())
    assert 2.2e9 < params < 2.6e9  # "large" is ~2.4B at gqa


def test_gpu_default_cells_that_would_not_fit_an_h100_are_named(large_models):
    """Which GPU-default cells an H100 skips, from the declarations alone: ~79 GB free once the weights are in."""
    free = 79e9
    skipped = [(c["arch"], c["context"], c["batch"]) for c in CompareSettings(device="cuda").cells()
               if compare_device.memory_shortfall(compare_device.cell_cache_bytes(large_models[c["arch"]], c), free)]
    assert skipped == [("mha", 8192, 64), ("mha", 32768, 16), ("mha", 32768, 64), ("gqa", 32768, 64),
                       ("mla", 32768, 64), ("cla", 32768, 64)]


def test_memory_shortfall_names_the_bytes():
    assert compare_device.memory_shortfall(10**9, None) == ""  # the CPU: no cell is sized against memory
    assert compare_device.memory_shortfall(10**9, 10**9 + compare_device.WORKING_BYTES) == ""
    reason = compare_device.memory_shortfall(70 * 10**9, 40 * 10**9)
    assert reason.startswith("does not fit in device memory: 70.0 GB of cache") and "40.0 GB free" in reason


def tiny_probe_settings(tmp_path, **kw) -> CompareSettings:
    return CompareSettings(archs=["mha", "mqa", "mamba"], preset="tiny", contexts=[16, 40], batches=[1, 3],
                           new_tokens=3, kv_cache="paged", measure="decode-probe", out=tmp_path, **kw)


@pytest.mark.usefixtures("machine_rates_once")
def test_decode_probe_cells_time_the_step_at_the_context_without_a_prefill(tmp_path):
    rows = run_compare(tiny_probe_settings(tmp_path), show_progress=False)
    assert len(rows) == 12
    for row in rows:
        assert row["measure"] == "decode-probe" and row["graphs"] == "auto"
        assert row["ttft_ms"] is None and row["tpot_ms"] is None  # no prefill ran
        assert row["step_ms_p50"] > 0 and row["decode_tok_s"] == pytest.approx(row["batch"] / row["step_ms_p50"] * 1000)
        assert row["floor_context"] == row["context"]  # every timed step starts from the context
        assert row["cuda_graphs"] is False and row["graph_bytes"] == 0 and "cpu" in row["cuda_graphs_off"]
        assert row["measured_cache_bytes"] >= row["analytic_cache_bytes"] > 0


@pytest.mark.usefixtures("machine_rates_once")
def test_cli_writes_table_and_charts_for_decode_probe_rows(tmp_path, capsys):
    argv = ["compare", "--archs", "gqa", "--preset", "tiny", "--contexts", "16,32", "--batches", "1,2",
            "--new-tokens", "3", "--measure", "decode-probe", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| gqa | 16 | 2 |" in out and "decode-probe: 4 cells timed 3 decode steps" in out
    for name in ("table.md", "cache_bytes_vs_context.png", "decode_throughput_vs_batch.png",
                 "latency_vs_context.png", "step_vs_floor.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.usefixtures("machine_rates_once")
def test_cells_that_do_not_fit_are_skipped_with_the_reason_before_any_engine(tmp_path, monkeypatch, capsys):
    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built for a cell that does not fit")

    monkeypatch.setattr(compare_device, "free_device_bytes", lambda device: 2**30)  # less than the working room alone
    monkeypatch.setattr(compare, "Engine", no_engine)
    argv = ["compare", "--archs", "gqa", "--preset", "tiny", "--contexts", "16", "--batches", "1,2",
            "--new-tokens", "3", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["skipped"].startswith("does not fit in device memory") for r in rows)
    out = capsys.readouterr().out
    assert "Skipped (not run" in out and "- gqa context 16 batch 2: does not fit in device memory" in out
    assert "Skipped (not run" in (tmp_path / "table.md").read_text()
    assert cli.main(argv) == 0  # a re-run finds them recorded and builds nothing


def test_rows_written_before_measure_and_graphs_resume(tmp_path, monkeypatch):
    settings = CompareSettings(archs=["gqa"], preset="tiny", contexts=[16], batches=[1], new_tokens=3, out=tmp_path)
    (cell,) = settings.cells()
    old = {k: v for k, v in cell.items() if k not in ("measure", "graphs")}
    (tmp_path / "results.jsonl").write_text(json.dumps({**old, "ttft_ms": 1.0}) + "\n")
    monkeypatch.setattr(compare, "measure_rates", lambda settings: None)
    monkeypatch.setattr(compare, "build_model", lambda arch, settings: None)
    monkeypatch.setattr(compare, "measure_cell", lambda *args: pytest.fail("an old row's cell was measured again"))
    assert [r["ttft_ms"] for r in run_compare(settings, show_progress=False)] == [1.0]


@pytest.mark.parametrize("change,message", [
    ({"cuda_graphs": True}, "cuda_graphs=True needs a CUDA device, got device 'cpu'"),
    ({"cuda_graphs": "yes"}, "cuda_graphs must be None"),
    ({"measure": "prefill"}, "measure"),
])
def test_bad_gpu_settings_fail_before_any_work(tmp_path, monkeypatch, change, message):
    monkeypatch.setattr(compare, "build_model", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=message):
        run_compare(CompareSettings(preset="tiny", out=tmp_path, **change), show_progress=False)

