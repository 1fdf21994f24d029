"""Model sizes: tiny for tests, small for CPU comparisons, base (~125M) for benchmarks, large (~2.4B) for GPUs."""
from dataclasses import asdict, dataclass

from zoo import checks


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    gqa_kv_heads: int  # KV heads the "gqa" architecture uses at this size
    mlp_hidden: int
    max_seq_len: int
    tie_embeddings: bool
    window: int  # keys a sliding-window layer sees at this size


PRESETS = {
    "tiny": Preset(vocab_size=512, d_model=64, n_layers=2, n_heads=4, gqa_kv_heads=2, mlp_hidden=192, max_seq_len=512, tie_embeddings=True, window=16),
    "small": Preset(vocab_size=512, d_model=512, n_layers=8, n_heads=8, gqa_kv_heads=2, mlp_hidden=1408, max_seq_len=32768, tie_embeddings=True, window=512),
    "base": Preset(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, gqa_kv_heads=4, mlp_hidden=2048, max_seq_len=32768, tie_embeddings=False, window=1024),
    # GPU-sized: its bf16 decode weights (4.4-6.2 GB across the compare defaults, gqa 4.6) take over 1 ms to stream
    # at an H100's ~3.0 TB/s copy rate and at an H200's ~4.3, so a decode step's floor is set by HBM, not by launches.
    # head_dim 128, 4 query heads per gqa KV head; max_seq_len leaves room past a 32768-token context. Never built
    # by the CPU tests (they size it on the meta device).
    "large": Preset(vocab_size=32000, d_model=2560, n_layers=32, n_heads=20, gqa_kv_heads=5, mlp_hidden=6912, max_seq_len=65536, tie_embeddings=False, window=4096),
}


def preset_settings(name: str) -> dict:
    return asdict(PRESETS[checks.choice("preset", name, PRESETS)])
