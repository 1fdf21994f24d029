"""zoo/gguf_export.py: a GGUF file llama.cpp reads as its llama architecture, checked by reading it back with gguf's
reader (every tensor, its type and shape, the hparams, the Q/K RoPE reordering, Q8_0 within its rounding), refusal of
what llama.cpp's llama cannot represent, `zoo export`. llama.cpp's own greedy tokens on an export against the
engine's: tests/test_decode_vs_peers.py (where llama-cpp-python is installed)."""
import numpy as np
import pytest
import torch

import zoo
from attention.rope import RotaryEmbedding, apply_rope
from harness import cli
from helpers import random_model  # tests/ is on sys.path under pytest

gguf = pytest.importorskip("gguf")  # the test extra installs it
from zoo.gguf_export import export_gguf  # noqa: E402  (needs gguf)

F32, BF16, F16, Q8_0 = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.BF16,
                        gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0)


def read(path) -> tuple[dict, dict]:
    """(field name -> value, tensor name -> ReaderTensor) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def expected_names(n_layers: int, tied: bool) -> set[str]:
    per_layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    names = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not tied else set())
    return names | {f"blk.{i}.{p}.weight" for i in range(n_layers) for p in per_layer}


def zoo_weight(model, name: str) -> torch.Tensor:
    """The zoo weight a GGUF tensor holds (Q and K before reordering)."""
    if not name.startswith("blk."):
        return {"token_embd": model.embed, "output_norm": model.norm, "output": model.head}[name.split(".")[0]].weight
    _, i, part, _ = name.split(".")
    block = model.blocks[int(i)]
    return {"attn_norm": block.mixer_norm, "attn_q": block.mixer.q_proj, "attn_k": block.mixer.k_proj,
            "attn_v": block.mixer.v_proj, "attn_output": block.mixer.o_proj, "ffn_norm": block.mlp_norm,
            "ffn_gate": block.mlp.gate_proj, "ffn_up": block.mlp.up_proj, "ffn_down": block.mlp.down_proj}[part].weight


def halves_from_pairs(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the export's reordering: per head, rows (2j, 2j + 1) back to (j, j + head_dim/2)."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermuted(name: str, data: np.ndarray, model) -> np.ndarray:
    mixer = model.blocks[0].mixer
    if name.endswith("attn_q.weight"):
        return halves_from_pairs(data, mixer.n_heads)
    if name.endswith("attn_k.weight"):
        return halves_from_pairs(data, mixer.n_kv_heads)
    return data


@pytest.fixture(scope="module")
def model():
    return random_model("gqa")  # tiny: 2 layers, d_model 64, 4 query / 2 KV heads, untied head, spread weights


def test_f32_file_holds_every_weight_exactly_and_the_hparams(model, tmp_path):
    path = export_gguf(model, tmp_path / "m.gguf", "f32")
    fields, tensors = read(path)
    c, mixer = model.config, model.blocks[0].mixer
    assert set(tensors) == expected_names(c.n_layers, tied=False)
    for name, t in tensors.items():
        want = zoo_weight(model, name).detach().numpy()
        assert t.tensor_type == F32, name
        assert list(t.shape[::-1]) == list(want.shape), name  # GGUF lists dims innermost first
        np.testing.assert_array_equal(unpermuted(name, t.data, model), want, err_msg=name)
    assert fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    want = {"context_length": c.max_seq_len, "embedding_length": c.d_model, "block_count": c.n_layers,
            "feed_forward_length": c.mlp_hidden, "attention.head_count": mixer.n_heads,
            "attention.head_count_kv": mixer.n_kv_heads, "attention.key_length": mixer.head_dim,
            "attention.value_length": mixer.head_dim, "rope.dimension_count": mixer.head_dim,
            "rope.freq_base": c.rope_base, "vocab_size": c.vocab_size}
    assert {k: fields[f"llama.{k}"] for k in want} == want
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(c.norm_eps)


def test_vocabulary_has_one_entry_per_id_bytes_and_specials(model, tmp_path):
    fields, _ = read(export_gguf(model, tmp_path / "m.gguf", "f32"))
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.model"] == "llama"
    assert len(tokens) == len(types) == len(fields["tokenizer.ggml.scores"]) == model.config.vocab_size
    assert len(set(tokens)) == len(tokens)
    assert tokens[10] == "<0x0A>" and types[10] == gguf.TokenType.BYTE
    tok = zoo.ByteTokenizer()
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert types[tok.eos_id] == gguf.TokenType.CONTROL


def adjacent_pair_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's RoPE for its llama architecture (ggml's normal mode): dims (2j, 2j + 1) rotate together by
    position * base^(-2j / head_dim). x: [heads, T, head_dim]."""
    d = x.shape[-1]
    angles = positions[:, None].double() * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def test_reordered_q_and_k_under_llama_cpp_rope_give_the_zoo_attention_scores(model, tmp_path):
    _, tensors = read(export_gguf(model, tmp_path / "m.gguf", "f32"))
    mixer, base = model.blocks[0].mixer, model.config.rope_base
    x, positions = torch.randn(7, model.config.d_model), torch.arange(7)
    heads = lambda w, n: (x @ w.T).view(7, n, -1).transpose(0, 1)  # noqa: E731
    exported = lambda name: torch.from_numpy(np.array(tensors[name].data))  # noqa: E731
    cos, sin = RotaryEmbedding(mixer.head_dim, base)(positions[None], torch.float32)
    q = apply_rope(heads(mixer.q_proj.weight.detach(), mixer.n_heads)[None], cos, sin)[0]
    k = apply_rope(heads(mixer.k_proj.weight.detach(), mixer.n_kv_heads)[None], cos, sin)[0]
    theirs_q = adjacent_pair_rope(heads(exported("blk.0.attn_q.weight"), mixer.n_heads), positions, base)
    theirs_k = adjacent_pair_rope(heads(exported("blk.0.attn_k.weight"), mixer.n_kv_heads), positions, base)
    group = mixer.n_heads // mixer.n_kv_heads
    ours = q @ k.repeat_interleave(group, 0).transpose(1, 2)
    theirs = theirs_q @ theirs_k.repeat_interleave(group, 0).transpose(1, 2)
    torch.testing.assert_close(theirs.float(), ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, qtype, file_type", [("bf16", BF16, gguf.LlamaFileType.MOSTLY_BF16),
                                                     ("f16", F16, gguf.LlamaFileType.MOSTLY_F16)])
def test_half_precision_files_round_like_torch(model, tmp_path, dtype, qtype, file_type):
    fields, tensors = read(export_gguf(model, tmp_path / "m.gguf", dtype))
    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    assert fields["general.file_type"] == file_type
    for name, t in tensors.items():
        want = zoo_weight(model, name).detach()
        if want.dim() == 1:
            assert t.tensor_type == F32, name
            continue
        assert t.tensor_type == qtype, name
        got = unpermuted(name, gguf.quants.dequantize(t.data, qtype).reshape(want.shape), model)
        np.testing.assert_array_equal(got, want.to(torch_dtype).float().numpy(), err_msg=name)


def test_q8_0_dequantizes_within_its_rounding(model, tmp_path):
    fields, tensors = read(export_gguf(model, tmp_path / "m.gguf", "q8_0"))
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    for name, t in tensors.items():
        want = zoo_weight(model, name).detach().numpy()
        if want.ndim == 1:
            continue
        assert t.tensor_type == Q8_0, name
        got = unpermuted(name, gguf.quants.dequantize(t.data, Q8_0).reshape(want.shape), model)
        blocks, err = want.reshape(-1, 32), np.abs(got - want).reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127
        # half a step, plus the fp16 rounding of the scale (2^-11 relative) over up to 127 steps
        assert (err <= step * (0.5 + 127 * 2**-11) + 1e-7).all(), name


def test_a_tied_head_is_left_to_token_embd(tmp_path):
    torch.manual_seed(0)
    tied = zoo.build("mqa", preset="tiny")
    _, tensors = read(export_gguf(tied, tmp_path / "m.gguf", "f32"))
    assert set(tensors) == expected_names(tied.config.n_layers, tied=True)
    assert tensors["blk.0.attn_k.weight"].shape[1] == tied.blocks[0].mixer.head_dim  # one KV head


@pytest.mark.parametrize("arch, overrides, reason", [
    ("mamba", {}, "mixer 'mamba'"), ("mla", {}, "mixer 'mla'"), ("swa", {}, "window"), ("sink", {}, "sinks"),
    ("chunked", {}, "chunk"), ("cla", {}, "kv_source"), ("hybrid", {}, "window"), ("diffusion", {}, "not causal"),
    ("gqa", {"mlp": "gelu"}, "mlp 'gelu'"), ("gqa", {"norm": "layernorm"}, "norm 'layernorm'"),
])
def test_what_llama_cpp_cannot_represent_is_refused_before_writing(tmp_path, arch, overrides, reason):
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match=f"cannot be exported to GGUF.*{reason}"):
        export_gguf(zoo.build(arch, preset="tiny", **overrides), path, "f32")
    assert not path.exists()


def test_bad_dtype_and_quantized_models_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        export_gguf(model, tmp_path / "m.gguf", "q4_0")
    with pytest.raises(ValueError, match="q8_0"):
        export_gguf(zoo.quantize(model, weights="int8"), tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_cli_export_writes_a_readable_file(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    assert cli.main(["export", "--gguf", str(path), "--arch", "mqa", "--preset", "tiny", "--dtype", "q8_0"]) == 0
    fields, tensors = read(path)
    assert fields["llama.attention.head_count_kv"] == 1 and tensors["output_norm.weight"].tensor_type == F32
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--arch", "mamba"], "mixer 'mamba'"), (["--arch", "nope"], "unknown architecture"),
    (["--weights", "/no/such/file.safetensors"], "does not exist"), (["--gguf", "/no/such/dir/m.gguf"], "/no/such/dir"),
])
def test_cli_export_refuses_bad_input_before_building(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(zoo, "build", lambda *a, **k: pytest.fail("zoo.build ran before the bad option was reported"))
    args = ["export", "--gguf", str(tmp_path / "m.gguf"), "--preset", "tiny"]
    assert cli.main(args + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zoo export: error:") and message in err
