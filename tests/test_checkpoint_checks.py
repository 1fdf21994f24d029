"""zoo.save / zoo.load refuse, as one ValueError naming the file, the tensor or the path, what they used to take
silently or fail on with a traceback: tensors of the wrong dtype (an int32 or bool tensor where a float or an int8
payload belongs), JSON nested past Python's recursion limit, a damaged quantization.json, a folder under a file, and
a quantized model without its QuantizeConfig."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from helpers import random_model
from zoo.weights import load_weights


def saved(tmp_path, config: zoo.QuantizeConfig | None = None):
    model = random_model("gqa", seed=1)
    return zoo.save(model if config is None else zoo.quantize(model, config), tmp_path / "model")


def rewrite_weights(folder, **changes) -> None:
    """model.safetensors with some tensors replaced."""
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, **changes}, str(folder / "model.safetensors"))


def test_float_weights_of_an_integer_or_bool_dtype_are_refused(tmp_path):
    folder = saved(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    rewrite_weights(folder, **{"embed.weight": state["embed.weight"].to(torch.int32),
                               "norm.weight": state["norm.weight"].bool()})
    with pytest.raises(ValueError, match=r"does not fit its config.json: wrong dtype \(2\): embed.weight int32 \(the "
                                         r"model's: a floating dtype\), norm.weight bool \(the model's: a floating"):
        zoo.load(folder)


@pytest.mark.parametrize("config,payload", [(zoo.QuantizeConfig("int8"), "int8"),
                                            (zoo.QuantizeConfig("int4", group_size=32), "uint8")])
def test_a_quantized_payload_of_another_dtype_is_refused(tmp_path, config, payload):
    folder = saved(tmp_path, config)
    q = load_file(str(folder / "model.safetensors"))["blocks.0.mlp.up_proj.q"]
    for wrong in (q.to(torch.int32), q.float(), q.bool()):
        rewrite_weights(folder, **{"blocks.0.mlp.up_proj.q": wrong})
        with pytest.raises(ValueError, match=rf"does not fit its config.json and quantization.json: wrong dtype \(1\): "
                                             rf"blocks.0.mlp.up_proj.q {str(wrong.dtype)[6:]} \(the model's: {payload}\)"):
            zoo.load(folder)


def test_a_weights_file_of_the_wrong_dtype_is_refused_by_load_weights(tmp_path):
    model = random_model("gqa", seed=2)
    path = tmp_path / "weights.safetensors"
    save_file({name: t.to(torch.int32) if name == "head.weight" else t for name, t in model.state_dict().items()},
              str(path))
    with pytest.raises(ValueError, match=r"does not fit gqa: wrong dtype \(1\): head.weight int32"):
        load_weights(model, path, "gqa")


@pytest.mark.parametrize("file", ["config.json", "quantization.json"])
def test_json_nested_100000_deep_is_a_value_error(tmp_path, file):
    folder = saved(tmp_path, zoo.QuantizeConfig("int8"))
    (folder / file).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=rf"{file} is damaged \(JSON nested deeper than"):
        zoo.load(folder)


@pytest.mark.parametrize("edit,message", [
    (lambda fields: "{not json", "quantization.json is damaged (not JSON"),
    (lambda fields: {k: v for k, v in fields.items() if k != "input_scaled"},
     "quantization.json is not a quantization record: it needs the fields weights, group_size, method, head, "
     "input_scaled, got"),
    (lambda fields: {**fields, "weights": "int3"}, "quantization.json: unknown weights"),
    (lambda fields: {**fields, "input_scaled": "blocks"}, "input_scaled must be a list of layer names, got 'blocks'"),
    (lambda fields: {**fields, "input_scaled": ["blocks.0.mlp", "embed"]},
     "quantization.json does not fit its config.json: input_scaled names layers that are not quantized "
     "(2): blocks.0.mlp, embed"),
    (lambda fields: {**fields, "weights": "int4", "group_size": 128},
     "quantization.json does not fit its config.json: group_size=128 does not divide the input width 192"),
])
def test_a_damaged_quantization_record_is_one_clear_error(tmp_path, edit, message):
    folder = saved(tmp_path, zoo.QuantizeConfig("int8"))
    fields = edit(json.loads((folder / "quantization.json").read_text()))
    (folder / "quantization.json").write_text(fields if isinstance(fields, str) else json.dumps(fields))
    with pytest.raises(ValueError, match=re.escape(message)):
        zoo.load(folder)


def test_a_float_model_saved_over_a_quantized_one_loads_float(tmp_path):
    folder = saved(tmp_path, zoo.QuantizeConfig("int4", group_size=32))
    model = random_model("gqa", seed=3)
    zoo.save(model, folder)
    assert not (folder / "quantization.json").exists()
    loaded = zoo.load(folder)
    assert getattr(loaded, "quantization", None) is None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_save_under_a_file_names_the_path(tmp_path):
    (tmp_path / "file").write_text("")
    model = zoo.build("gqa", preset="tiny")
    for path in (tmp_path / "file" / "model", tmp_path / "file" / "deeper" / "model"):
        with pytest.raises(ValueError, match=rf"checkpoint folder '{path}' cannot be made: '{tmp_path / 'file'}' is a "
                                             rf"file, not a folder"):
            zoo.save(model, path)


def test_a_quantized_model_without_its_quantize_config_is_refused(tmp_path):
    quantized = zoo.quantize(random_model("gqa", seed=4), zoo.QuantizeConfig("int8"))
    with pytest.raises(ValueError, match=r"quantized layers but no .quantization"):
        zoo.save(quantized.first_layers(1), tmp_path / "draft")
    assert not (tmp_path / "draft").exists()
