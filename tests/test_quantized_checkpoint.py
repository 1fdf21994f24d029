"""Quantized models on disk and in memory: zoo.save / zoo.load round-trip int8 and int4 models, round to nearest and
AWQ (input scales, clipped groups), bit for bit with their QuantizeConfig, and the loaded model decodes the saved
one's tokens; an int4 layer holds torch's packed CPU layout only where its kernel reads it (bf16), so an fp32 model's
resident weight bytes are the stored bytes zoo.parameter_bytes reports; zoo.quantize refuses a model it cannot
quantize honestly (not a zoo model, already quantized) and calibration that is not a 2-D integer tensor."""
import sys

import pytest
import torch

import zoo
from harness import Engine
from helpers import assert_not_constant, greedy, make_prompts, random_model
from zoo.quantize import QuantizedLinear, replace_layers

CONFIGS = {
    "int8": zoo.QuantizeConfig("int8"),
    "int4-g32": zoo.QuantizeConfig("int4", group_size=32),
    "int8-awq": zoo.QuantizeConfig("int8", method="awq"),
    "int4-g32-awq": zoo.QuantizeConfig("int4", group_size=32, method="awq"),
}
quantize_module = sys.modules["zoo.quantize"]  # zoo.quantize is also the function's name


def outlier_model(arch: str, seed: int = 3) -> torch.nn.Module:
    """A tiny random model with an outlier input channel, the case AWQ keeps input scales for."""
    model = random_model(arch, seed=seed)
    with torch.no_grad():
        model.blocks[0].mixer_norm.weight[5] = 8.0
    return model


def calibration_tokens(model) -> torch.Tensor:
    return torch.tensor(make_prompts([32] * 2, model.config.vocab_size, seed=5))


def quantized_layers(model) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def assert_bit_equal(loaded, saved) -> None:
    """Same tensors under the same names, in the same dtypes, bit for bit, and the same layers."""
    want, got = saved.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert {n: repr(m) for n, m in quantized_layers(loaded).items()} == \
        {n: repr(m) for n, m in quantized_layers(saved).items()}


def assert_same_decode(loaded, saved) -> None:
    """The engine's greedy tokens and logits of both models, equal."""
    prompts = make_prompts([5, 11], saved.config.vocab_size, seed=1)
    want, got = (Engine(m, max_batch=2, max_seq_len=48).generate(prompts, greedy(12)) for m in (saved, loaded))
    assert_not_constant(want[0].token_ids, "the saved model's decode")
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize("arch", ["gqa", "mla", "mamba2"])
def test_a_saved_quantized_model_loads_bit_equal_and_decodes_the_same_tokens(tmp_path, arch, config):
    model = outlier_model(arch)
    quantized = zoo.quantize(model, config, calibration_tokens(model) if config.method == "awq" else None)
    if config.method == "awq":
        assert any(m.input_scale is not None for m in quantized_layers(quantized).values()), "AWQ kept no scales"
    loaded = zoo.load(zoo.save(quantized, tmp_path / "model"))
    assert loaded.quantization == config and not loaded.training
    assert (tmp_path / "model" / "quantization.json").is_file()
    assert_bit_equal(loaded, quantized)
    assert_same_decode(loaded, quantized)


def test_awq_clipped_groups_round_trip(tmp_path):
    """A layer whose groups AWQ clipped (and scaled) before rounding holds other levels than plain rounding gives;
    they come back as stored."""
    model = random_model("gqa", seed=4)
    quantized = zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=32))
    float_layer = model.blocks[0].mlp.down_proj
    groups = float_layer.weight.detach().unflatten(-1, (-1, 32))
    scale = torch.linspace(0.5, 2.0, float_layer.in_features)
    bounds = (groups * scale.unflatten(-1, (-1, 32))).abs().amax(dim=-1) * 0.7
    clipped = QuantizedLinear(float_layer, "int4", 32, scale, bounds)
    assert not torch.equal(clipped.q, QuantizedLinear(float_layer, "int4", 32, scale).q), "the clip changed nothing"
    replace_layers(quantized, {"blocks.0.mlp.down_proj": clipped})
    quantized.quantization = zoo.QuantizeConfig("int4", group_size=32, method="awq")
    loaded = zoo.load(zoo.save(quantized, tmp_path / "model"))
    assert_bit_equal(loaded, quantized)
    assert torch.equal(loaded.blocks[0].mlp.down_proj.input_scale, scale)
    assert_same_decode(loaded, quantized)


def test_a_bf16_int4_model_with_a_quantized_head_round_trips_with_its_cpu_layout(tmp_path):
    model = random_model("gqa", seed=2).to(torch.bfloat16)
    quantized = zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=64, head=True))
    loaded = zoo.load(zoo.save(quantized, tmp_path / "model"))
    assert isinstance(loaded.head, QuantizedLinear) and loaded.head.scales.dtype == torch.bfloat16
    assert_bit_equal(loaded, quantized)
    saved_layers = quantized_layers(quantized)
    for name, layer in quantized_layers(loaded).items():
        assert layer.cpu_packed is not None, name
        assert torch.equal(layer.cpu_packed, saved_layers[name].cpu_packed), name
        assert torch.equal(layer.cpu_scales_zeros, saved_layers[name].cpu_scales_zeros), name
    assert_same_decode(loaded, quantized)


def resident_weight_bytes(model) -> int:
    """What the model's weights hold in memory: its parameters and every buffer of its quantized layers."""
    buffers = sum(b.nbytes for layer in quantized_layers(model).values() for b in layer.buffers())
    return sum(p.nbytes for p in model.parameters()) + buffers


def test_an_fp32_int4_model_holds_only_its_stored_bytes():
    """No int4 layer of an fp32 model keeps torch's bf16-only packed layout, so what it holds is what it stores;
    cast to bf16 it makes the layout (and drops it again cast back)."""
    quantized = zoo.quantize(zoo.build("gqa", preset="tiny"), zoo.QuantizeConfig("int4", group_size=32))
    assert resident_weight_bytes(quantized) == zoo.parameter_bytes(quantized)
    assert all(layer.cpu_packed is None for layer in quantized_layers(quantized).values())
    quantized.to(torch.bfloat16)  # in place, as nn.Module.to casts
    assert all(layer.cpu_packed is not None for layer in quantized_layers(quantized).values())
    quantized.float()
    assert all(layer.cpu_packed is None for layer in quantized_layers(quantized).values())
    assert resident_weight_bytes(quantized) == zoo.parameter_bytes(quantized)


def test_bf16_int4_layers_run_torchs_packed_kernel_on_their_layout(monkeypatch):
    model = random_model("gqa", seed=5).to(torch.bfloat16)
    quantized = zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=32))
    layouts = [layer.cpu_packed for layer in quantized_layers(quantized).values()]
    seen = []
    packed_kernel = torch._weight_int4pack_mm_for_cpu

    def recording(x, packed, *args):
        seen.append(packed)
        return packed_kernel(x, packed, *args)

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", recording)
    with torch.no_grad():
        quantized(torch.tensor(make_prompts([9], model.config.vocab_size)))
    assert len(seen) == len(layouts) and all(any(p is layout for layout in layouts) for p in seen)


def refuse_copies(monkeypatch) -> None:
    """quantize's first piece of work is copying the model: a refusal must come before it."""
    def refused(*_):
        raise AssertionError("zoo.quantize copied the model before refusing it")

    monkeypatch.setattr(quantize_module.copy, "deepcopy", refused)


def test_an_already_quantized_model_is_refused(tmp_path, monkeypatch):
    once = zoo.quantize(random_model("gqa", seed=6), zoo.QuantizeConfig("int8"))
    loaded = zoo.load(zoo.save(once, tmp_path / "model"))
    refuse_copies(monkeypatch)
    for model in (once, loaded):
        with pytest.raises(ValueError, match=r"already quantized \(int8\): quantize the float model"):
            zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=32))


def test_quantize_takes_only_a_zoo_model(monkeypatch):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    refuse_copies(monkeypatch)
    for module, name in ((torch.nn.Linear(64, 64), "Linear"), (torch.nn.Sequential(), "Sequential"),
                         (hf, "LlamaForCausalLM")):
        with pytest.raises(ValueError, match=rf"zoo.quantize takes a zoo model \(zoo.DecoderLM.*got {name}$"):
            zoo.quantize(module, zoo.QuantizeConfig("int8"))


@pytest.mark.parametrize("calibration,got", [
    ([[1, 2], [3, 4]], "got list"),
    (torch.tensor([1, 2, 3]), r"got shape \(3,\), dtype torch.int64"),
    (torch.zeros(2, 4), r"got shape \(2, 4\), dtype torch.float32"),
    (torch.ones(2, 4, dtype=torch.bool), r"got shape \(2, 4\), dtype torch.bool"),
    (torch.zeros(0, 4, dtype=torch.long), r"got shape \(0, 4\), dtype torch.int64"),
])
def test_awq_calibration_must_be_a_2d_integer_tensor(monkeypatch, calibration, got):
    model = random_model("gqa", seed=7)
    refuse_copies(monkeypatch)
    with pytest.raises(ValueError, match=r"calibration must be a non-empty 2-D integer tensor of token ids \[B, T\], "
                                         + got):
        zoo.quantize(model, zoo.QuantizeConfig("int8", method="awq"), calibration)
