"""GGUF export of a Llama-shaped zoo model (mha, gqa, mqa: full causal attention, RoPE, RMSNorm, SwiGLU) for
llama.cpp, written with the `gguf` package (the `peers` or `test` extra).

Two things differ from the zoo's layout. RoPE: the zoo rotates halves (dim i with i + head_dim/2, HF Llama's
convention) while llama.cpp's llama architecture rotates adjacent pairs (2i with 2i + 1), so the rows of the query and
key projections are reordered per head to put each pair side by side (llama.cpp's convert_hf_to_gguf.py does the same
for HF Llama checkpoints); attention scores are unchanged since queries and keys move alike. Tokenizer: llama.cpp
will not load a model without a vocabulary, so the file carries one with an entry per id: the byte tokenizer's bytes
as "<0xXX>" byte tokens, its BOS / EOS / mask ids as control tokens, and a placeholder for every other id. Callers
feed token ids, never text.
"""
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from zoo import checks
from zoo.config import FFNSpec, ModelConfig
from zoo.hf import mixer_settings
from zoo.tokenizer import ByteTokenizer

Q8_0_BLOCK = 32  # Q8_0 stores rows in blocks of 32 values with one fp16 scale each (ggml)


@dataclass(frozen=True)
class GgufType:
    """How an export dtype stores the weights: 2-D ones in `matrix`; 1-D ones (norm gains) stay F32 as in llama.cpp."""

    matrix: gguf.GGMLQuantizationType
    file_type: gguf.LlamaFileType


GGUF_TYPES = {
    "f32": GgufType(gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": GgufType(gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": GgufType(gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": GgufType(gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# attention settings llama.cpp's llama architecture cannot represent, at the values it can
PLAIN_ATTENTION = {"window": None, "sinks": 0, "chunk": None, "dilation": 1, "kv_source": None, "bias": False,
                   "causal": True, "qk_norm": None}


def check_exportable(config: ModelConfig) -> None:
    """Refuse, naming the reason, any model that is not Llama-shaped: every layer full causal attention with one head
    layout and the model's RoPE base, no biases, SwiGLU MLPs, RMSNorm."""
    problems = []
    if config.mlp != "swiglu":
        problems.append(f"mlp {config.mlp!r} (llama.cpp's llama needs 'swiglu')")
    if config.ffns is not None and any(spec != FFNSpec("swiglu") for spec in config.ffns):
        problems.append(f"per-layer FFNs {sorted({spec.kind for spec in config.ffns})} (llama.cpp's llama needs the "
                        f"model's SwiGLU in every layer)")
    if config.norm != "rmsnorm":
        problems.append(f"norm {config.norm!r} (needs 'rmsnorm')")
    if not config.causal:
        problems.append("a masked diffusion LM (not causal)")
    layouts, odd_layers = set(), {}  # odd_layers: what is wrong -> the layers it is wrong in
    for i, spec in enumerate(config.layers):
        if spec.kind != "attention":
            odd_layers.setdefault(f"mixer {spec.kind!r} (needs softmax 'attention')", []).append(i)
            continue
        settings = mixer_settings(spec, config)[1]
        odd = [k for k, plain in PLAIN_ATTENTION.items() if settings[k] != plain]
        if settings["rope_base"] != config.rope_base:
            odd.append("its own rope_base")
        if odd:
            odd_layers.setdefault(f"attention with {', '.join(odd)}", []).append(i)
        layouts.add((settings["n_heads"], settings["n_kv_heads"], settings["head_dim"]))
    problems += [f"{what} in layers {layers}" for what, layers in odd_layers.items()]
    if len(layouts) > 1:
        problems.append(f"layers differ in (n_heads, n_kv_heads, head_dim): {sorted(layouts)}")
    if problems:
        raise ValueError(f"{config.name!r} cannot be exported to GGUF: llama.cpp's llama architecture represents only "
                         f"mha / gqa / mqa models with full causal attention; this one has " + "; ".join(problems))


def attention_shape(config: ModelConfig) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim), the same in every layer of an exportable model."""
    settings = mixer_settings(config.layers[0], config)[1]
    return settings["n_heads"], settings["n_kv_heads"], settings["head_dim"]


def adjacent_pair_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns a rotate-half projection into llama.cpp's: within each head, rows j and j + head_dim/2
    (one RoPE pair) become rows 2j and 2j + 1."""
    half = head_dim // 2
    within = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return torch.cat([h * head_dim + within for h in range(n_heads)])


def gguf_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp tensor name, float32 weight) for every weight, Q and K rows in llama.cpp's RoPE order; a tied head
    is left out (llama.cpp then reads token_embd as the output)."""
    config = model.config
    n_heads, n_kv_heads, head_dim = attention_shape(config)
    state = {name: w.detach().float().cpu() for name, w in model.state_dict().items()}
    tensors = [("token_embd.weight", state["embed.weight"]), ("output_norm.weight", state["norm.weight"])]
    if not config.tie_embeddings:
        tensors.append(("output.weight", state["head.weight"]))
    q_rows, k_rows = adjacent_pair_rows(n_heads, head_dim), adjacent_pair_rows(n_kv_heads, head_dim)
    for i in range(config.n_layers):
        ours, blk = f"blocks.{i}.", f"blk.{i}."
        tensors += [
            (blk + "attn_norm.weight", state[ours + "mixer_norm.weight"]),
            (blk + "attn_q.weight", state[ours + "mixer.q_proj.weight"][q_rows]),
            (blk + "attn_k.weight", state[ours + "mixer.k_proj.weight"][k_rows]),
            (blk + "attn_v.weight", state[ours + "mixer.v_proj.weight"]),
            (blk + "attn_output.weight", state[ours + "mixer.o_proj.weight"]),
            (blk + "ffn_norm.weight", state[ours + "mlp_norm.weight"]),
            (blk + "ffn_gate.weight", state[ours + "mlp.gate_proj.weight"]),
            (blk + "ffn_up.weight", state[ours + "mlp.up_proj.weight"]),
            (blk + "ffn_down.weight", state[ours + "mlp.down_proj.weight"]),
        ]
    return tensors


def tensor_type(tensor: torch.Tensor, kind: GgufType) -> gguf.GGMLQuantizationType:
    """1-D tensors in F32; Q8_0 rows that do not split into 32-blocks in F16 (llama.cpp's converter does the same)."""
    if tensor.dim() == 1:
        return gguf.GGMLQuantizationType.F32
    if kind.matrix == gguf.GGMLQuantizationType.Q8_0 and tensor.shape[-1] % Q8_0_BLOCK:
        return gguf.GGMLQuantizationType.F16
    return kind.matrix


def write_hparams(writer: gguf.GGUFWriter, config: ModelConfig, kind: GgufType) -> None:
    n_heads, n_kv_heads, head_dim = attention_shape(config)
    writer.add_name(config.name)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.mlp_hidden)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(kind.file_type)


def write_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A SentencePiece-type ("llama") vocabulary with one entry per id, so llama.cpp loads the file; ids in, ids out."""
    tok = ByteTokenizer()
    specials = {tok.bos_id: "<bos>", tok.eos_id: "<eos>", tok.mask_id: "<mask>"}
    tokens, types = [], []
    for i in range(vocab_size):
        if i < 256:
            tokens.append(f"<0x{i:02X}>")
            types.append(gguf.TokenType.BYTE)
        elif i in specials:
            tokens.append(specials[i])
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(f"<id{i}>")
            types.append(gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(types)
    if tok.eos_id < vocab_size:  # else llama.cpp's SentencePiece defaults (bos 1, eos 2) stand
        writer.add_bos_token_id(tok.bos_id)
        writer.add_eos_token_id(tok.eos_id)
    writer.add_add_bos_token(False)


def export_gguf(model, path, dtype: str = "f32") -> Path:
    """Write `model` to `path` as a llama.cpp GGUF file, 2-D weights in `dtype` (f32, f16, bf16 or q8_0)."""
    kind = GGUF_TYPES[checks.choice("dtype", dtype, GGUF_TYPES)]
    if getattr(model, "quantization", None) is not None:
        raise ValueError("export the float model: a zoo-quantized model's int8/int4 layers have no GGUF mapping here "
                         "(use dtype='q8_0' for llama.cpp's own 8-bit format)")
    check_exportable(model.config)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    write_hparams(writer, model.config, kind)
    write_vocab(writer, model.config.vocab_size)
    for name, tensor in gguf_tensors(model):
        qtype = tensor_type(tensor, kind)
        writer.add_tensor(name, gguf.quants.quantize(tensor.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
