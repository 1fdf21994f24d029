"""Architecture conversion (zoo/convert.py): mean-pooled KV heads are exact where the pooled heads were equal, a
window changes nothing within it, a Gated DeltaNet layer starts from the attention's projections, and every
converted model is a normal one (the float64 reference here, the engine's contract in test_conformance.py). An MLA
latent at full rank reproduces the attention's keys and values but for its norm, and its rope channels turn at the
head's own frequencies."""
import pytest
import torch

import zoo
from zoo.convert import convert
from zoo.convert_mla import rope_channels
from zoo.reference import reference_forward
from helpers import random_model  # tests/ is on sys.path under pytest


def tokens(model, length: int = 24) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_pooling_kv_heads_that_were_equal_changes_nothing():
    model = random_model("mha")  # 4 heads, 4 KV heads
    for block in model.blocks:
        for proj in (block.mixer.k_proj, block.mixer.v_proj):
            rows = proj.weight.view(2, 2, block.mixer.head_dim, -1)
            rows[:, 1] = rows[:, 0]  # KV heads 0 = 1 and 2 = 3
    converted = convert(model, "gqa", kv_heads=2)
    assert [spec.params["n_kv_heads"] for spec in converted.config.layers] == [2, 2]
    x = tokens(model)
    assert (converted(x) - model(x)).abs().max().item() <= 1e-5 * model(x).abs().max().item()


def test_each_pooled_head_is_the_mean_of_its_group():
    model = random_model("mha")
    converted = convert(model, "gqa", kv_heads=1, layers=[1])
    dim = model.blocks[1].mixer.head_dim
    want = model.blocks[1].mixer.v_proj.weight.view(4, dim, -1).mean(dim=0)
    assert torch.allclose(converted.blocks[1].mixer.v_proj.weight, want)
    assert torch.equal(converted.blocks[0].mixer.k_proj.weight, model.blocks[0].mixer.k_proj.weight)  # not chosen


@torch.no_grad()
def test_a_window_changes_nothing_within_it_and_something_beyond():
    model = random_model("gqa")
    windowed = convert(model, "swa", window=10)
    short, long = tokens(model, 10), tokens(model, 30)
    assert torch.allclose(windowed(short), model(short), atol=1e-6)
    assert not torch.allclose(windowed(long)[:, -1], model(long)[:, -1], atol=1e-3)


def test_a_gdn_layer_starts_from_the_attention_s_projections():
    model = random_model("gqa", n_layers=3)  # 4 query heads on 2 KV heads
    converted = convert(model, "gdn", layers=[1])
    assert [spec.kind for spec in converted.config.layers] == ["attention", "gdn", "attention"]
    attention, gdn = model.blocks[1].mixer, converted.blocks[1].mixer
    width, dim = attention.n_heads * attention.head_dim, attention.head_dim
    q, k, v = gdn.in_proj.weight[:width], gdn.in_proj.weight[width:2 * width], gdn.in_proj.weight[2 * width:3 * width]
    assert torch.equal(q, attention.q_proj.weight) and torch.equal(gdn.out_proj.weight, attention.o_proj.weight)
    for head in range(4):  # query head h reads KV head h // 2
        source = slice((head // 2) * dim, (head // 2 + 1) * dim)
        assert torch.equal(k[head * dim:(head + 1) * dim], attention.k_proj.weight[source])
        assert torch.equal(v[head * dim:(head + 1) * dim], attention.v_proj.weight[source])
    x = torch.randn(1, 5, gdn.conv_dim)
    padded = torch.nn.functional.pad(x.transpose(1, 2), (gdn.d_conv - 1, 0))
    assert torch.equal(gdn.conv1d(padded).transpose(1, 2), x)  # the conv passes each token through
    for name, tensor in model.state_dict().items():
        if not name.startswith("blocks.1.mixer."):
            assert torch.equal(converted.state_dict()[name], tensor), name


def calibration(model, count: int = 8, length: int = 32) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (count, length), generator=torch.Generator().manual_seed(1))


def test_an_mla_latent_at_full_rank_is_the_keys_and_values_of_each_query_head_s_kv_head():
    model = random_model("gqa")  # d_model 64; 4 query heads on 2 KV heads of 16 channels
    attention = model.blocks[0].mixer
    mla = convert(model, "mla", kv_rank=48, rope_dim=8, calibration=calibration(model)).blocks[0].mixer
    _, nope = rope_channels(16, 8)
    up = mla.kv_b_proj.weight.view(4, 8 + 16, 48)
    latent = mla.kv_a_proj_with_mqa.weight[:48]
    for head in range(4):
        kv = head // 2
        keys = attention.k_proj.weight.view(2, 16, -1)[kv, nope]
        values = attention.v_proj.weight.view(2, 16, -1)[kv]
        assert torch.allclose(up[head] @ latent, torch.cat([keys, values]), atol=1e-5)
    gains = mla.kv_a_layernorm.weight
    assert torch.equal(gains, gains[:1].expand(48))  # one gain: the norm scales every latent channel alike
    assert 0.5 < gains[0].item() < 2  # the latent is whitened: unit mean square on the calibration inputs


def test_mla_rope_channels_turn_at_the_head_s_own_frequencies():
    model = random_model("gqa")
    attention = model.blocks[1].mixer
    mla = convert(model, "mla", rope_dim=4, calibration=calibration(model)).blocks[1].mixer
    rope, nope = rope_channels(16, 4)
    assert rope.tolist() == [0, 4, 8, 12] and len(nope) == 12
    assert torch.equal(mla.rope.inv_freq, attention.rope.inv_freq[rope[:2]])  # pair m of MLA's is the head's 4m
    q = mla.q_proj.weight.view(4, 16, -1)
    assert torch.equal(q[:, 12:], attention.q_proj.weight.view(4, 16, -1)[:, rope])
    assert not q[:, :12].any()  # the nope queries start at zero: the unrotated product would be position-blind
    shared = mla.kv_a_proj_with_mqa.weight[-4:]
    assert torch.allclose(shared, attention.k_proj.weight.view(2, 16, -1)[:, rope].mean(dim=0))


@torch.no_grad()
def test_an_mla_conversion_is_exact_but_for_its_latent_norm_and_loses_with_rank():
    model = random_model("mqa")  # one KV head: the shared rope key is that head's
    _, nope = rope_channels(16, 8)
    for block in model.blocks:  # queries read only the rotated channels, as the conversion's start does
        block.mixer.q_proj.weight.view(4, 16, -1)[:, nope] = 0
    x = tokens(model, 30)
    want = model(x)
    errors = {}
    for rank in (4, 24):
        converted = convert(model, "mla", kv_rank=rank, calibration=calibration(model))
        for block in converted.blocks:
            block.mixer.kv_a_layernorm = torch.nn.Identity()  # up @ down is the keys' and values' map itself
        errors[rank] = ((converted(x) - want).norm() / want.norm()).item()
    assert errors[24] <= 1e-5 < errors[4]


@pytest.mark.parametrize("to, options", [("gqa", {"kv_heads": 1}), ("swa", {"window": 6}), ("gdn", {"layers": [0]}),
                                         ("mla", {"kv_rank": 8})])
def test_a_converted_model_holds_the_float64_reference(to, options):  # the engine's: test_conformance.py's SURGERY
    model = random_model("gqa")
    converted = convert(model, to, **options, **({"calibration": calibration(model)} if to == "mla" else {}))
    x = tokens(converted, 30)
    with torch.no_grad():
        logits, want = converted(x), reference_forward(converted, x)
    assert ((logits.double() - want).abs().max() / want.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("arch, to, options, message", [
    ("gqa", "rwkv", {}, "unknown conversion target 'rwkv'; allowed: gqa, swa, gdn, mla"),
    ("gqa", "mla", {"rope_dim": 6}, "rope_dim must be an even divisor of layer 0's head_dim 16 below it"),
    ("gqa", "mla", {"rope_dim": 16}, "rope_dim must be an even divisor"),
    ("gqa", "mla", {"kv_rank": 49}, r"kv_rank must be between 1 and 48 .*, got 49"),
    ("gqa", "mla", {"kv_rank": 8, "calibration": "text"}, "an MLA conversion needs calibration token windows"),
    ("swa", "mla", {}, "layer 0 has window 16: MLA has none of these, so only plain full attention converts"),
    ("gqa", "gqa", {"kv_heads": 3}, "kv_heads must divide layer 0's 2 KV heads"),
    ("gqa", "swa", {"window": 0}, "window must be an integer >= 1"),
    ("gqa", "gdn", {"layers": [2]}, r"layers \[2\] cannot be converted: attention layers .* are \[0, 1\]"),
    ("mamba2", "gdn", {}, r"cannot be converted: attention layers that compute their own keys and values are \[\]"),
    ("cla", "gdn", {"layers": [1]}, r"layers \[1\] cannot be converted"),
])
def test_what_cannot_be_converted_is_named(arch, to, options, message):
    model = random_model(arch)
    if to == "mla":
        options = {"calibration": calibration(model), **options}
    with pytest.raises(ValueError, match=message):
        convert(model, to, **options)


def test_a_converted_model_saves_and_loads_as_itself(tmp_path):
    converted = zoo.convert(random_model("gqa"), "gdn", layers=[1])
    loaded = zoo.load(zoo.save(converted, tmp_path / "converted"))
    x = tokens(converted)
    with torch.no_grad():
        assert loaded.config.layers == converted.config.layers and torch.equal(loaded(x), converted(x))


def test_cli_converts_and_saves(tmp_path, capsys):
    from harness import cli
    weights = zoo.save(random_model("gqa", n_layers=3), tmp_path / "weights")
    assert cli.main(["convert", "--weights", str(weights), "--to", "gdn", "--layers", "0,2",
                     "--out", str(tmp_path / "out")]) == 0
    assert [s.kind for s in zoo.load(tmp_path / "out").config.layers] == ["gdn", "attention", "gdn"]
    assert "gqa -> gqa-to-gdn" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--layers must be comma-separated integers"):
        cli.main(["convert", "--weights", str(weights), "--to", "gdn", "--layers", "a", "--out", str(tmp_path / "x")])
    assert cli.main(["convert", "--weights", str(weights), "--to", "gqa", "--kv-heads", "3",
                     "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "y").exists()


def test_cli_converts_to_mla_on_calibration_text(tmp_path, capsys):
    from harness import cli
    weights = zoo.save(random_model("gqa"), tmp_path / "weights")
    corpus = tmp_path / "text.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    assert cli.main(["convert", "--weights", str(weights), "--to", "mla", "--kv-rank", "8", "--corpus", str(corpus),
                     "--windows", "4", "--context", "32", "--out", str(tmp_path / "out")]) == 0
    assert [(s.kind, s.params["kv_lora_rank"]) for s in zoo.load(tmp_path / "out").config.layers] == [("mla", 8)] * 2
    # 2 layers x 1,024 tokens x 4 B x (2 x 2 KV heads x 16 channels -> 8 latent + 8 rope channels)
    assert "cache 524,288 -> 131,072 bytes" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--context between 1 and the model's"):
        cli.main(["convert", "--weights", str(weights), "--to", "mla", "--context", "0", "--out", str(tmp_path / "x")])
