"""Sizes are bounded before torch allocates them: an absurd config field or mixer parameter fails by name, a model
or a training run larger than the memory limit is refused by its estimate, and neither allocates more than a few
MB first (issue 33)."""
import json
import subprocess
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zoo
from harness import cli
from harness.train import TrainSettings
from harness.train.memory import training_bytes
from tests.conftest import REPO_ROOT
from zoo import MixerSpec, ModelConfig
from zoo.checkpoint import CONFIG_FILE
from zoo.model import model_bytes

FEW_MB = 4 * 2**20


class Allocations(TorchDispatchMode):
    """Every tensor an aten op returns while active, summed in bytes (what a build would ask the allocator for)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.nbytes += sum(t.nbytes for t in (out if isinstance(out, (list, tuple)) else [out])
                           if isinstance(t, torch.Tensor))
        return out


def refused(call, match: str) -> Allocations:
    """call() raises a ValueError matching `match`; returns what it allocated first."""
    with Allocations() as allocations, pytest.raises(ValueError, match=match):
        call()
    return allocations


def attention(**params) -> MixerSpec:
    return MixerSpec("attention", {"n_heads": 4, **params})


def config(**fields) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 256, "d_model": 64, "layers": [attention()], **fields})


@pytest.mark.parametrize("fields,match", [
    ({"d_model": 10**9}, r"d_model must be <= 131,072 \(a bound far above any real model's\), got 1,000,000,000"),
    ({"vocab_size": 10**12}, r"vocab_size must be <= 16,777,216 .*got 1,000,000,000,000"),
    ({"mlp_hidden": 10**10}, r"mlp_hidden must be <= 1,048,576 .*got 10,000,000,000"),
    ({"max_seq_len": 10**12}, r"max_seq_len must be <= 16,777,216 .*got 1,000,000,000,000"),
    ({"layers": [attention()] * 20_000}, r"n_layers \(the length of layers\) must be <= 4,096 .*got 20,000"),
])
def test_an_absurd_config_field_fails_by_name(fields, match):
    assert refused(lambda: config(**fields), match).nbytes == 0


@pytest.mark.parametrize("params,match", [
    ({"head_dim": 10**8}, r"mixer 'attention' \(layer 0\): head_dim must be <= 16,384 .*got 100,000,000"),
    ({"n_heads": 10**6}, r"mixer 'attention' \(layer 0\): n_heads must be <= 4,096 .*got 1,000,000"),
    ({"window": 10**12}, r"mixer 'attention' \(layer 0\): window must be <= 16,777,216"),
])
def test_an_absurd_mixer_parameter_fails_by_name(params, match):
    bad = config(layers=[attention(), attention(**params)])
    match = match.replace("layer 0", "layer 1")
    assert refused(lambda: zoo.build(bad), match).nbytes == 0


@pytest.mark.parametrize("overrides,match", [
    ({"n_layers": 100_000}, r"n_layers must be <= 4,096 .*got 100,000"),
    ({"d_model": 10**9}, r"d_model must be <= 131,072"),
    ({"head_dim": 10**8}, r"head_dim must be <= 16,384"),
    ({"vocab_size": 10**12}, r"vocab_size must be <= 16,777,216"),
    ({"n_kv_heads": 10**5}, r"n_kv_heads must be <= 4,096"),
    ({"mlp_hidden": 10**10}, r"mlp_hidden must be <= 1,048,576"),
])
def test_registry_overrides_are_bounded(overrides, match):
    assert refused(lambda: zoo.make_config("gqa", "tiny", **overrides), match).nbytes == 0


@pytest.mark.parametrize("arch,overrides,match", [
    ("mla", {"kv_lora_rank": 10**6}, r"kv_lora_rank must be <= 16,384"),
    ("mamba", {"d_state": 10**6}, r"d_state must be <= 16,384"),
    ("mamba", {"expand": 10**4}, r"expand must be <= 1,024"),
    ("swa", {"window": 10**9}, r"window must be <= 16,777,216"),
    ("cla", {"share": 10**5}, r"share must be <= 4,096"),
])
def test_architecture_settings_are_bounded(arch, overrides, match):
    assert refused(lambda: zoo.make_config(arch, "tiny", **overrides), match).nbytes == 0


def test_a_model_over_the_limit_is_refused_before_allocating(monkeypatch):
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(2**20))
    estimate = f"{model_bytes(zoo.make_config('gqa', 'small')):,}"
    allocations = refused(lambda: zoo.build("gqa", preset="small"),
                          rf"the model's parameters and buffers \(vocab_size=512, d_model=512, .*\) would take "
                          rf"{estimate} B, more than the ZOO_MEMORY_LIMIT limit \(1,048,576 B\): lower vocab_size")
    assert allocations.nbytes == 0


def test_sizes_within_bounds_but_beyond_memory_are_refused():
    """2^17 wide with 2^24 ids passes every bound but asks for 8 TiB of embedding: the machine's free memory says no."""
    huge = config(d_model=2**17, vocab_size=2**24, layers=[attention(n_heads=1024)])
    allocations = refused(lambda: zoo.build(huge), r"would take [\d,]+ B, more than .*free memory")
    assert allocations.nbytes == 0


def test_a_model_within_the_limit_builds(monkeypatch):
    """At exactly its estimate a model builds; the allocation probe sees its weights (so a refusal's 0 B means
    nothing was made)."""
    tiny = zoo.make_config("gqa", "tiny")
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(model_bytes(tiny)))
    with Allocations() as allocations:
        assert zoo.build(tiny).config is tiny
    assert allocations.nbytes >= model_bytes(tiny)


def test_a_meta_device_build_is_never_refused(monkeypatch):
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", "0")
    with torch.device("meta"):
        model = zoo.build("gqa", preset="large")
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="more than the ZOO_MEMORY_LIMIT limit"):
        zoo.build("gqa", preset="tiny")


def test_load_refuses_a_config_json_over_the_limit(tmp_path, monkeypatch):
    folder = zoo.save(zoo.build("gqa", preset="tiny"), tmp_path / "model")
    fields = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**fields, "d_model": 10**9}))
    with pytest.raises(ValueError, match=r"config.json: d_model must be <= 131,072"):
        zoo.load(folder)
    (folder / CONFIG_FILE).write_text(json.dumps({**fields, "d_model": 2**16, "vocab_size": 2**20}))
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(2**30))
    allocations = refused(lambda: zoo.load(folder), r"would take [\d,]+ B, more than the ZOO_MEMORY_LIMIT limit")
    assert allocations.nbytes < FEW_MB  # the saved tiny model's weights, read before the config is built


def test_a_refused_build_grows_no_resident_memory():
    """In a fresh process: gqa base (0.5 GB of fp32 weights) under a 1 MB limit leaves the peak RSS where it was."""
    script = ("import os, resource, zoo\n"
              "os.environ['ZOO_MEMORY_LIMIT'] = str(2**20)\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "try:\n    zoo.build('gqa', preset='base')\nexcept ValueError as error:\n    print('refused', error)\n"
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused the model's parameters") and int(lines[-1]) * 1024 < FEW_MB, out.stdout


def test_mamba2_divisor_listing_stays_quick_at_the_widest_width():
    wide = config(d_model=2**17, layers=[MixerSpec("mamba2", {"expand": 2**10, "head_dim": 3})])
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"allowed head_dim: \[1, 2, 4, .*, 134217728\]"):
        zoo.build(wide)
    assert time.perf_counter() - started < 1


# ---- zoo train --------------------------------------------------------------------------------------------------

def test_train_with_100000_layers_fails_fast_and_by_name(tmp_path, capsys):
    started = time.perf_counter()
    assert cli.main(["train", "--set", "n_layers=100000", "--out", str(tmp_path), "--quiet"]) == 2
    assert "n_layers must be <= 4,096 (a bound far above any real model's), got 100,000" in capsys.readouterr().err
    assert time.perf_counter() - started < 2


def test_train_refuses_a_step_beyond_the_limit(tmp_path, monkeypatch):
    settings = TrainSettings(batch_size=4096, context=512, max_steps=1, out=tmp_path)
    need = training_bytes(zoo.make_config("gqa", "tiny"), 4096, 512)
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(need - 1))
    with Allocations() as allocations, pytest.raises(ValueError, match=(
            rf"training gqa \(d_model=64, n_layers=2, vocab_size=512\) at batch_size=4,096 and context=512 would "
            rf"take {need:,} B, more than the ZOO_MEMORY_LIMIT limit .*: lower batch_size, context")):
        settings.validate()
    assert allocations.nbytes < FEW_MB
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(need))
    assert settings.validate().n_layers == 2


def test_train_refuses_deep_models_on_their_estimate(tmp_path, capsys):
    """4,096 layers pass the bound; at the default batch and context their weights, AdamW state and activations do
    not fit a small limit, and that is said before any model is built."""
    args = ["train", "--set", "n_layers=4096", "--out", str(tmp_path), "--quiet"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZOO_MEMORY_LIMIT", str(2**30))
        assert cli.main(args) == 2
    assert "lower batch_size, context, or the model's size" in capsys.readouterr().err


def test_training_estimate_grows_with_batch_context_and_depth():
    tiny = zoo.make_config("gqa", "tiny")
    deeper = zoo.make_config("gqa", "tiny", n_layers=4)
    assert training_bytes(tiny, 2, 64) < training_bytes(tiny, 4, 64) < training_bytes(tiny, 4, 128)
    assert training_bytes(tiny, 4, 128) < training_bytes(deeper, 4, 128)
    assert training_bytes(tiny, 1, 1) > 4 * model_bytes(tiny)  # weights, gradients and AdamW's two moments
