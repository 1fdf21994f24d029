"""Registry overrides, ModelConfig fields and mixer parameters: a bad type or value is a ValueError naming the
setting, the value and what is allowed, raised before torch sees it."""
import math

import numpy as np
import pytest

import zoo
from zoo import MixerSpec, ModelConfig


@pytest.mark.parametrize("settings,message", [
    ({"head_dim": 0}, r"head_dim must be >= 1, got 0"),
    ({"mlp_hidden": -5}, r"mlp_hidden must be >= 1, got -5"),
    ({"mlp_hidden": 0}, r"mlp_hidden must be >= 1, got 0"),
    ({"d_model": 64.5}, r"d_model must be an integer >= 1, got 64.5 \(float\)"),
    ({"n_heads": 4.0}, r"n_heads must be an integer >= 1, got 4.0 \(float\)"),
    ({"n_kv_heads": "2"}, r"n_kv_heads must be an integer >= 1, got '2' \(str\)"),
    ({"n_layers": True}, r"n_layers must be an integer >= 1, got True \(bool\)"),
    ({"n_layers": 0}, r"n_layers must be >= 1, got 0"),
    ({"vocab_size": "512"}, r"vocab_size must be an integer >= 1, got '512' \(str\)"),
    ({"max_seq_len": -1}, r"max_seq_len must be >= 1, got -1"),
    ({"d_model": None}, r"d_model must be an integer >= 1, got None"),
])
def test_size_overrides_are_integers_of_at_least_one(settings, message):
    with pytest.raises(ValueError, match=message):
        zoo.build("gqa", preset="tiny", **settings)


@pytest.mark.parametrize("arch,settings,message", [
    ("mla", {"kv_lora_rank": 2.5}, r"kv_lora_rank must be an integer >= 1, got 2.5"),
    ("swa", {"window": 1.5}, r"window must be an integer >= 1, got 1.5"),
    ("swa", {"window": None}, r"window must be an integer >= 1, got None"),
    ("linear", {"feature_dim": 0}, r"feature_dim must be >= 1, got 0"),
    ("mamba", {"expand": 1.5}, r"expand must be an integer >= 1, got 1.5"),
    ("mamba2", {"n_groups": 0}, r"n_groups must be >= 1, got 0"),
    ("cla", {"share": 1.0}, r"share must be an integer >= 1, got 1.0 \(float\)"),
    ("cla", {"share": 3}, r"share factor 3 must divide n_layers=2; allowed: \[1, 2\]"),
    ("linear", {"feature_map": "relu"}, r"unknown feature_map 'relu'; allowed: elu, taylor"),
    ("diffusion", {"mixer": "mamba"}, r"unknown mixer 'mamba'; allowed: mha, gqa, mqa, mla"),
])
def test_architecture_settings_are_integers_of_at_least_one(arch, settings, message):
    with pytest.raises(ValueError, match=message):
        zoo.build(arch, preset="tiny", **settings)


@pytest.mark.parametrize("settings,message", [
    ({"norm_eps": 0.0}, r"norm_eps must be a finite number > 0, got 0.0"),
    ({"norm_eps": -1e-5}, r"norm_eps must be a finite number > 0"),
    ({"norm_eps": math.nan}, r"norm_eps must be a finite number > 0, got nan"),
    ({"norm_eps": "1e-5"}, r"norm_eps must be a finite number > 0, got '1e-5' \(str\)"),
    ({"rope_base": 0}, r"rope_base must be a finite number > 0, got 0"),
    ({"rope_base": math.inf}, r"rope_base must be a finite number > 0, got inf"),
    ({"tie_embeddings": 1}, r"tie_embeddings must be True or False, got 1 \(int\)"),
    ({"mlp": "relu"}, r"unknown mlp 'relu'; allowed: swiglu, gelu, none"),
    ({"norm": "batchnorm"}, r"unknown norm 'batchnorm'; allowed: rmsnorm, layernorm"),
])
def test_model_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        zoo.build("gqa", preset="tiny", **settings)


@pytest.mark.parametrize("layers,message", [
    ("", r"empty hybrid pattern \(layers=''\)"),
    ([], r"empty hybrid pattern \(layers=\[\]\)"),
    (5, r"hybrid pattern \(layers\) must be comma-separated layer names.*got 5 \(int\)"),
    ("swa,,gqa", r"unknown layer kind\(s\) \[''\]"),
])
def test_hybrid_pattern_must_name_layers(layers, message):
    with pytest.raises(ValueError, match=message):
        zoo.build("hybrid", preset="tiny", layers=layers)


def test_unhashable_names_are_value_errors():
    with pytest.raises(ValueError, match=r"unknown architecture \['gqa'\]"):
        zoo.build(["gqa"], preset="tiny")
    with pytest.raises(ValueError, match=r"unknown preset \['tiny'\]"):
        zoo.build("gqa", preset=["tiny"])


def test_good_settings_still_build_and_numpy_ints_become_ints():
    config = zoo.make_config("gqa", preset="tiny", d_model=np.int64(96), n_heads=np.int32(6), n_kv_heads=None,
                             mlp_hidden=None, rope_base=500000, tie_embeddings=False)
    assert type(config.d_model) is int and config.d_model == 96
    assert config.layers[0].params["n_heads"] == 6 and type(config.layers[0].params["n_heads"]) is int
    assert config.layers[0].params["n_kv_heads"] == 2  # None: the preset's gqa ratio
    assert config.mlp_hidden == 256  # None: 8/3 * d_model rounded up to a multiple of 64
    assert config.rope_base == 500000.0
    assert zoo.build("hybrid", preset="tiny", layers=["swa", "gqa"]).config.n_layers == 2


@pytest.mark.parametrize("fields,message", [
    ({"d_model": 16.0}, r"d_model must be an integer >= 1, got 16.0 \(float\)"),
    ({"vocab_size": 0}, r"vocab_size must be >= 1, got 0"),
    ({"mlp_hidden": 0}, r"mlp_hidden must be >= 1, got 0"),
    ({"norm_eps": -1.0}, r"norm_eps must be a finite number > 0"),
    ({"tie_embeddings": "yes"}, r"tie_embeddings must be True or False, got 'yes'"),
    ({"causal": 0}, r"causal must be True or False, got 0"),
    ({"mask_token_id": 2.5}, r"mask_token_id must lie in \[0, 10\).*got 2.5"),
    ({"layers": "attention"}, r"layers must be a list of MixerSpec"),
    ({"layers": [{"kind": "attention"}]}, r"layers must be a list of MixerSpec"),
])
def test_model_config_fields_are_checked(fields, message):
    kwargs = {"vocab_size": 10, "d_model": 16, "layers": [MixerSpec("attention", {"n_heads": 2})], **fields}
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_mixer_spec_is_checked():
    with pytest.raises(ValueError, match=r"kind must be a mixer name \(str\), got \['attention'\]"):
        MixerSpec(["attention"])
    with pytest.raises(ValueError, match=r"params must be a dict.*got \['n_heads'\]"):
        MixerSpec("attention", ["n_heads"])


@pytest.mark.parametrize("params,message", [
    ({"n_heads": 4.0}, r"mixer 'attention' \(layer 0\): n_heads must be an integer, got 4.0 \(float\)"),
    ({"n_heads": 4, "window": "3"}, r"window must be an integer or None, got '3' \(str\)"),
    ({"n_heads": 4, "rope_base": math.inf}, r"rope_base must be a finite number, got inf"),
    ({"n_heads": 4, "bias": 0}, r"bias must be True or False, got 0 \(int\)"),
    ({"n_heads": 4, "head_dim": 0}, r"head_dim must be >= 1, got 0"),
])
def test_mixer_params_have_their_declared_types(params, message):
    config = ModelConfig(vocab_size=10, d_model=16, layers=[MixerSpec("attention", params)])
    with pytest.raises(ValueError, match=message):
        zoo.build(config)
