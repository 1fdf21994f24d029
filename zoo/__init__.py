"""archzoo's front door: build any registered decoder architecture, size its cache, save and load it, load HF weights."""
from zoo.cache import cache_bytes, cache_read_bytes, decode_weight_bytes, parameter_bytes
from zoo.config import FFNSpec, MixerSpec, ModelConfig
from zoo.hf import from_hf
from zoo.model import DecoderLM
from zoo.parameters import (ParameterCounts, decode_experts_read, expected_experts_read, moe_layers, parameter_counts,
                             reset_decode_routing, routed_experts)
from zoo.presets import PRESETS
from zoo.build import build
from zoo.checkpoint import load, save
from zoo.quantize import QuantizeConfig, quantize, quantize_layers
from zoo.entry_details import details
from zoo.eviction import EvictionConfig, evict
from zoo.pruning import PrunePlan, prune
from zoo.convert import convert
from zoo.registry import architectures, compare_defaults, describe, is_causal, make_config
from zoo.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer", "DecoderLM", "EvictionConfig", "FFNSpec", "MixerSpec", "ModelConfig", "PRESETS", "ParameterCounts", "QuantizeConfig",
    "architectures", "build", "cache_bytes", "cache_read_bytes", "compare_defaults", "decode_weight_bytes", "describe",
    "details", "evict", "from_hf", "is_causal", "load", "make_config", "parameter_bytes", "parameter_counts", "quantize",
    "quantize_layers", "routed_experts", "save", "decode_experts_read", "expected_experts_read", "moe_layers",
    "reset_decode_routing",
]
