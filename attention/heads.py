"""Head widths every multi-head mixer shares: head_dim, when not given, is d_model split evenly over the heads."""


def default_head_dim(d_model: int, n_heads: int, head_dim: int | None) -> int:
    """head_dim, or d_model // n_heads when it is None (then n_heads must divide d_model)."""
    if head_dim is not None:
        return head_dim
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim explicitly")
    return d_model // n_heads
