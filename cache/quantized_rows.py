"""Cache rows kept in one byte an element with one scale per row: the KV cache's int8 and fp8 formats (one scale per
token and KV head, as vLLM's quantized KV caches keep them), in the shape and indexing of the float tensor they stand
for.

A row is the last dimension (one head's key or value, or an MLA latent row): it is stored as q = x / s rounded to the
format, with s = max|x| / (the format's largest value), and read back as q * s.
- "int8": q = round(x / s) in [-127, 127], s = max|x| / 127: 255 evenly spaced levels per row.
- "fp8": q = x / s in float8 e4m3 (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, largest 448), s = max|x|
  / 448: a relative step of 1/16 at every magnitude, so a row's small values keep more precision than int8 gives
  them and its large ones less. Hopper and Ada GPUs multiply e4m3 natively; elsewhere it is a storage format.
An MLA latent row is two vectors of different sizes side by side, the normalised latent and the rotary part of the
key (on the tiny trained mla model the rotary part's largest value is 5-19x the latent's): it keeps a scale for each
(`split` = the latent's width), or the latent would be rounded in steps sized for the rotary part.
Reading through an index dequantizes what it selects; assigning through one quantizes what it is given; every other
dimension indexes, views and transposes as in the float tensor.
"""
import torch

from kernels import cpu_memory
from kernels.row_scales import spread_scales

# format: (element dtype, largest magnitude a row's max is scaled to)
ROW_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


class QuantizedRows:
    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, split: int | None = None):
        """values: int8 or float8_e4m3fn [..., dim]; scales: [..., 1] in `dtype`, the dtype reads return, or with
        `split` [..., 2]: one for columns [0, split), one for [split, dim)."""
        self.values, self.scales, self.dtype, self.split = values, scales, dtype, split

    @classmethod
    def zeros(cls, *shape: int, dtype: torch.dtype, device, kv_format: str = "int8",
              split: int | None = None) -> "QuantizedRows":
        element, _ = ROW_FORMATS[kv_format]
        return cls(cpu_memory.zeros(*shape, dtype=element, device=device),
                   cpu_memory.zeros(*shape[:-1], 1 if split is None else 2, dtype=dtype, device=device), dtype, split)

    @property
    def kv_format(self) -> str:
        return next(name for name, (element, _) in ROW_FORMATS.items() if element == self.values.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def transpose(self, a: int, b: int) -> "QuantizedRows":
        """A view with two dimensions before the last swapped (the row itself never moves)."""
        last = self.values.dim() - 1
        if last in (a % self.values.dim(), b % self.values.dim()):
            raise ValueError("QuantizedRows keeps each row whole: transpose dimensions before the last one only")
        return QuantizedRows(self.values.transpose(a, b), self.scales.transpose(a, b), self.dtype, self.split)

    def __getitem__(self, index) -> torch.Tensor:
        values = self.values[index]
        return values.to(self.dtype) * spread_scales(self.scales[index], self.split, values.shape[-1])

    def __setitem__(self, index, rows: torch.Tensor) -> None:
        values, scales = quantize_rows(rows, self.kv_format, self.split)
        self.values[index] = values
        self.scales[index] = scales.to(self.dtype)


def quantize_rows(rows: torch.Tensor, kv_format: str = "int8",
                  split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., dim] -> values [..., dim] in the format's dtype and scales [..., 1] (float32; with split [..., 2],
    for columns [0, split) and [split, dim)): symmetric, each part's max |x| at the format's largest value."""
    element, largest = ROW_FORMATS[kv_format]
    rows = rows.float()
    parts = (rows,) if split is None else (rows[..., :split], rows[..., split:])
    scales = torch.stack([part.abs().amax(dim=-1) for part in parts], dim=-1) / largest
    spread = spread_scales(scales, split, rows.shape[-1])
    scaled = (rows / spread.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-largest, largest)
    # int8 rounds to the nearest level here; the cast to e4m3 rounds to its nearest value itself
    return (torch.round(scaled) if element == torch.int8 else scaled).to(element), scales
