"""The registry's front door: names, presets, parameter counts, analytic cache bytes, the byte tokenizer."""
import pytest
import torch

import zoo
from zoo import ByteTokenizer, MixerSpec, ModelConfig


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_architectures_include_the_attention_family():
    names = zoo.architectures()
    assert {"mha", "gqa", "mqa"} <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", zoo.architectures())
def test_describe_gives_one_line(name):
    text = zoo.describe(name)
    assert isinstance(text, str) and text.strip() and "\n" not in text


def test_describe_unknown_name():
    with pytest.raises(ValueError, match="nope"):
        zoo.describe("nope")


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_small_preset_has_20_to_30m_parameters(name):
    count = n_params(zoo.build(name, preset="small"))
    assert 20e6 <= count <= 30e6, f"{name} small: {count / 1e6:.1f}M parameters"


def test_base_gqa_is_the_125m_llama_shape():
    with torch.device("meta"):  # shapes only: skips allocating and initialising 125M weights
        model = zoo.build("gqa", preset="base")
    config = model.config
    assert 115e6 <= n_params(model) <= 135e6
    assert config.d_model == 768 and config.n_layers == 12 and config.vocab_size == 32000
    for block in model.blocks:
        assert block.mixer.n_heads == 12 and block.mixer.n_kv_heads == 4 and block.mixer.head_dim == 64
    assert not config.tie_embeddings  # the head is a separate matrix at this size
    assert model.head.weight is not model.embed.weight


def test_kv_heads_per_architecture():
    heads = {name: zoo.build(name, preset="tiny").blocks[0].mixer for name in ("mha", "gqa", "mqa")}
    assert (heads["mha"].n_heads, heads["mha"].n_kv_heads) == (4, 4)
    assert (heads["gqa"].n_heads, heads["gqa"].n_kv_heads) == (4, 2)
    assert (heads["mqa"].n_heads, heads["mqa"].n_kv_heads) == (4, 1)
    assert zoo.build("gqa", preset="tiny", n_kv_heads=1).blocks[0].mixer.n_kv_heads == 1


def test_overrides_reach_the_model():
    model = zoo.build("gqa", preset="tiny", n_layers=3, d_model=96, n_heads=6, n_kv_heads=3, vocab_size=300)
    assert model.config.n_layers == len(model.blocks) == 3
    assert model.embed.weight.shape == (300, 96)
    assert model.blocks[2].mixer.head_dim == 16 and model.blocks[2].mixer.n_kv_heads == 3


@pytest.mark.parametrize("name,kv_heads", [("mha", 4), ("gqa", 2), ("mqa", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_follow_the_formula(name, kv_heads, dtype):
    model = zoo.build(name, preset="tiny").to(dtype)
    head_dim, layers = 64 // 4, 2  # tiny: d_model 64, 4 heads, 2 layers
    element = 4 if dtype == torch.float32 else 2
    for t in (0, 1, 17, 512):
        for batch in (1, 3):
            want = 2 * kv_heads * head_dim * t * layers * batch * element  # K and V per token, layer and KV head
            assert zoo.cache_bytes(model, seq_len=t, batch=batch) == want
    # an explicit dtype overrides the model's
    assert zoo.cache_bytes(model, seq_len=10, dtype=torch.float16) == 2 * kv_heads * head_dim * 10 * layers * 2


def test_cache_bytes_of_base_models():
    # 12 layers, head_dim 64, fp32: MHA 12 KV heads, GQA 4, MQA 1
    for name, kv in (("mha", 12), ("gqa", 4), ("mqa", 1)):
        with torch.device("meta"):
            model = zoo.build(name, preset="base")
        assert zoo.cache_bytes(model, seq_len=1000, batch=2) == 2 * kv * 64 * 1000 * 12 * 2 * 4


def test_cache_bytes_rejects_negative_sizes():
    model = zoo.build("gqa", preset="tiny")
    with pytest.raises(ValueError, match="-1"):
        zoo.cache_bytes(model, seq_len=-1)


def test_build_from_model_config():
    config = ModelConfig(
        vocab_size=100, d_model=32,
        layers=[MixerSpec("attention", {"n_heads": 4, "n_kv_heads": 2}), MixerSpec("attention", {"n_heads": 4, "n_kv_heads": 1})],
        mlp="gelu", max_seq_len=64,
    )
    model = zoo.build(config)
    assert isinstance(model, zoo.DecoderLM) and model.config is config
    assert [b.mixer.n_kv_heads for b in model.blocks] == [2, 1]
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 100)
    assert zoo.cache_bytes(model, seq_len=5) == (2 * 2 * 8 + 2 * 1 * 8) * 5 * 4
    with pytest.raises(ValueError, match="overrides"):
        zoo.build(config, n_layers=3)


def test_model_config_validation():
    with pytest.raises(ValueError, match="layers is empty"):
        ModelConfig(vocab_size=10, d_model=8, layers=[])
    with pytest.raises(ValueError, match="'relu'"):
        ModelConfig(vocab_size=10, d_model=8, layers=[MixerSpec("attention", {"n_heads": 2})], mlp="relu")
    with pytest.raises(ValueError, match="'conv'"):
        zoo.build(ModelConfig(vocab_size=10, d_model=8, layers=[MixerSpec("conv", {})]))


def test_full_forward_is_causal():
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    tokens = torch.randint(0, 512, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 512
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-6)


@pytest.mark.parametrize("text", ["", "hello, world", "naïve café — 東京 🚀\n\ttabs"])
def test_byte_tokenizer_round_trips_utf8(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    with_bos = tok.encode(text, bos=True)
    assert with_bos[0] == tok.bos_id and tok.decode(with_bos + [tok.eos_id]) == text


def test_byte_tokenizer_fits_the_presets():
    tok = ByteTokenizer()
    assert len({tok.bos_id, tok.eos_id, tok.mask_id}) == 3
    assert all(i >= 256 for i in (tok.bos_id, tok.eos_id, tok.mask_id))
    for name, preset in zoo.PRESETS.items():
        assert preset.vocab_size >= tok.min_vocab_size, name


def test_decode_weight_bytes_leave_out_only_an_untied_embedding():
    tied = zoo.build("gqa", preset="tiny")
    untied = zoo.build("gqa", preset="tiny", tie_embeddings=False)
    assert zoo.decode_weight_bytes(tied) == zoo.parameter_bytes(tied)  # the head reads the shared table
    table = untied.config.vocab_size * untied.config.d_model * 4
    assert zoo.decode_weight_bytes(untied) == zoo.parameter_bytes(untied) - table


def test_describe_names_the_model_wide_settings_an_entry_reads():
    """Found by changing each at the tiny preset: attention heads matter to gqa, not to mamba; mqa fixes its KV
    heads; a windowed entry reads the preset's window; every entry with the model-wide mlp reads its width."""
    reads = {name: zoo.entry_details.global_reads(name) for name in ("gqa", "mqa", "mamba", "swa", "moe")}
    assert {"n_heads", "n_kv_heads", "gqa_kv_heads", "mlp", "mlp_hidden"} <= set(reads["gqa"])
    assert reads["mqa"]["n_kv_heads"].startswith("fixed by the entry") and "n_kv_heads=1" in reads["mqa"]["n_kv_heads"]
    assert "n_heads" not in reads["mamba"] and "window" not in reads["mamba"] and "mlp" in reads["mamba"]
    assert "window" in reads["swa"] and "window" not in reads["gqa"]
    assert "mlp" not in reads["moe"] and "mlp_hidden" in reads["moe"]  # every FFN an MoE, each expert mlp_hidden wide
    assert zoo.details("gqa")["model-wide settings it reads (the preset's unless given; probed at the tiny preset)"] \
        == reads["gqa"]
