"""Analytic cache size of a model, from its layers' cache declarations (for attention: 2 · layers · kv_heads ·
head_dim · tokens · bytes per element, as in Pope et al. 2022, "Efficiently Scaling Transformer Inference")."""
import torch

from cache import KV_FORMATS, specs_read
from zoo import checks
from zoo.quantize import QuantizedLinear
from zoo.quantized_experts import QuantizedExpertLinear

QUANTIZED = (QuantizedLinear, QuantizedExpertLinear)


def cache_bytes(model, seq_len: int, batch: int = 1, dtype: torch.dtype | None = None, kv_format: str = "auto") -> int:
    """Bytes of KV cache/state `batch` sequences of `seq_len` tokens hold; dtype defaults to the model's. kv_format
    "int8": per-token caches in int8 with a scale per token and KV head (cache.KV_FORMATS); states as declared."""
    if seq_len < 0 or batch < 0:
        raise ValueError(f"seq_len and batch must be >= 0, got seq_len={seq_len}, batch={batch}")
    checks.choice("kv_format", kv_format, KV_FORMATS)
    dtype = dtype or next(model.parameters()).dtype
    return batch * sum(spec.bytes(seq_len, dtype, kv_format) for spec in model.cache_specs())


def cache_read_bytes(model, seq_len: int, batch: int = 1, dtype: torch.dtype | None = None,
                     kv_format: str = "auto") -> int:
    """Cache bytes one decode step's attention reads: like cache_bytes, but a layer that shares another's cache
    (cross-layer attention) reads it again, so it counts what it reads, not what it owns; a dilated window reads
    the keys its query sees, not every position it holds."""
    dtype = dtype or next(model.parameters()).dtype
    return batch * sum(spec.read_bytes(seq_len, dtype, kv_format) for spec in specs_read(model.cache_specs()))


def parameter_bytes(model) -> int:
    """Bytes of the model's weights: distinct parameters (a tied embedding/head counts once) and a quantized layer's
    (or expert stack's) stored weight, scales and zeros (its saved buffers: not a layout a kernel derives from them)."""
    quantized = sum(layer.stored_bytes for layer in model.modules() if isinstance(layer, QUANTIZED))
    return sum(p.nbytes for p in model.parameters()) + quantized


def decode_weight_bytes(model) -> int:
    """Weight bytes one decode step must read: every parameter but an untied embedding table (one row is looked up)."""
    untied_embedding = 0 if model.config.tie_embeddings else model.embed.weight.nbytes
    return parameter_bytes(model) - untied_embedding


def decode_weight_elements(model) -> int:
    """Weights one decode step applies (each one multiply-add per token): decode_weight_bytes' weights counted as
    values, a quantized layer's as its in x out, whatever its bits."""
    untied_embedding = 0 if model.config.tie_embeddings else model.embed.weight.numel()
    quantized = sum(m.weight_elements for m in model.modules() if isinstance(m, QUANTIZED))
    return sum(p.numel() for p in model.parameters()) - untied_embedding + quantized
