"""The scales of a one-byte cache row (cache/quantized_rows.py) as a factor the row multiplies by, for the decode
references and the SDPA fallbacks that dequantize what they read."""
import torch


def spread_scales(scales: torch.Tensor, split: int | None, width: int) -> torch.Tensor:
    """Row scales as a factor for rows `width` wide: [..., 1] as they are (they broadcast); [..., 2], a scale for
    columns [0, split) and one for [split, width), spread to [..., width]."""
    if scales.shape[-1] == 1:
        return scales
    batch = scales.shape[:-1]
    return torch.cat([scales[..., :1].expand(*batch, split), scales[..., 1:].expand(*batch, width - split)], dim=-1)
