"""zoo.save / zoo.load: a model folder (config.json + model.safetensors) round-trips exactly for every kind of
layer, and every way the folder can be wrong is one ValueError naming it."""
import json

import pytest
import torch
from safetensors.torch import save_file

import zoo
from zoo.checkpoint import config_from_json, config_to_json
from helpers import spread_weights  # tests/ is on sys.path under pytest


@pytest.mark.parametrize("arch,overrides", [
    ("gqa", {}), ("mla", {}), ("cla", {}), ("mamba", {}), ("mamba2", {}), ("gdn", {}), ("linear", {}),
    ("hybrid", {"layers": "swa,mamba,gqa", "window": 8}), ("diffusion", {}), ("gqa", {"tie_embeddings": False}),
])
def test_round_trip_is_exact(tmp_path, arch, overrides):
    torch.manual_seed(0)
    model = spread_weights(zoo.build(arch, preset="tiny", **overrides))
    zoo.save(model, tmp_path / "model")
    loaded = zoo.load(tmp_path / "model")
    assert not loaded.training
    assert loaded.config == model.config
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    if model.config.tie_embeddings:
        assert loaded.head.weight is loaded.embed.weight
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded(tokens))


def test_a_bfloat16_model_loads_in_bfloat16(tmp_path):
    model = zoo.build("gqa", preset="tiny").to(torch.bfloat16)
    loaded = zoo.load(zoo.save(model, tmp_path / "bf16"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_config_json_round_trip_keeps_every_layer():
    config = zoo.make_config("hybrid", preset="tiny", layers="swa,mla,mamba2", n_layers=3, window=4)
    again = config_from_json(config_to_json(config))
    assert again == config
    assert [layer.kind for layer in again.layers] == ["attention", "mla", "mamba2"]


def saved(tmp_path):
    return zoo.save(zoo.build("gqa", preset="tiny"), tmp_path / "model")


@pytest.mark.parametrize("damage,message", [
    (lambda folder: folder.parent / "absent", "does not exist"),
    (lambda folder: (folder / "config.json"), "is not a folder"),
    (lambda folder: (folder / "config.json").unlink() or folder, "has no config.json"),
    (lambda folder: (folder / "model.safetensors").unlink() or folder, "has no model.safetensors"),
    (lambda folder: (folder / "config.json").write_text("{not json") and folder, "config.json is damaged (not JSON"),
    (lambda folder: (folder / "config.json").write_text("[1, 2]") and folder, "holds a JSON list, not a ModelConfig"),
    (lambda folder: (folder / "model.safetensors").write_bytes(b"\x00" * 40) and folder,
     "is damaged or not a safetensors file"),
])
def test_a_bad_folder_is_one_clear_error(tmp_path, damage, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        zoo.load(damage(saved(tmp_path)))


def test_a_train_output_folder_loads_its_checkpoint(tmp_path):
    model = zoo.build("gqa", preset="tiny")
    zoo.save(model, tmp_path / "run" / "checkpoint")
    loaded = zoo.load(tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_config_fields_are_checked(tmp_path):
    folder = saved(tmp_path)
    fields = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**fields, "colour": "red", "d_model": "wide"}))
    with pytest.raises(ValueError, match=r"unknown fields \['colour'\]"):
        zoo.load(folder)
    (folder / "config.json").write_text(json.dumps({**fields, "d_model": "wide"}))
    with pytest.raises(ValueError, match="config.json: d_model must be an integer"):
        zoo.load(folder)


def test_weights_that_do_not_fit_the_config_are_named(tmp_path):
    folder = saved(tmp_path)
    save_file({"embed.weight": torch.zeros(3, 3)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not fit its config.json: missing .*wrong shape \(1\): embed.weight 3x3"):
        zoo.load(folder)


def test_save_takes_a_zoo_model_and_a_folder(tmp_path):
    with pytest.raises(ValueError, match="takes a zoo model"):
        zoo.save(torch.nn.Linear(2, 2), tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        zoo.save(zoo.build("gqa", preset="tiny"), tmp_path / "file")
