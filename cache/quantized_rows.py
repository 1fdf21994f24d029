"""Cache rows kept in int8 with one scale per row: the KV cache's int8 format (one scale per token and KV head, as
vLLM's int8 KV cache keeps them), in the shape and indexing of the float tensor it stands for.

A row is the last dimension (one head's key or value, or an MLA latent row): it is stored as q = round(x / s) with
s = max|x| / 127, and read back as q * s. Reading through an index dequantizes what it selects; assigning through one
quantizes what it is given; every other dimension indexes, views and transposes as in the float tensor.
"""
import torch

QMAX = 127


class Int8Rows:
    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        """values: int8 [..., dim]; scales: [..., 1] in `dtype`, the dtype reads return."""
        self.values, self.scales, self.dtype = values, scales, dtype

    @classmethod
    def zeros(cls, *shape: int, dtype: torch.dtype, device) -> "Int8Rows":
        return cls(torch.zeros(*shape, dtype=torch.int8, device=device),
                   torch.zeros(*shape[:-1], 1, dtype=dtype, device=device), dtype)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def transpose(self, a: int, b: int) -> "Int8Rows":
        """A view with two dimensions before the last swapped (the row itself never moves)."""
        last = self.values.dim() - 1
        if last in (a % self.values.dim(), b % self.values.dim()):
            raise ValueError("Int8Rows keeps each row whole: transpose dimensions before the last one only")
        return Int8Rows(self.values.transpose(a, b), self.scales.transpose(a, b), self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return self.values[index].to(self.dtype) * self.scales[index]

    def __setitem__(self, index, rows: torch.Tensor) -> None:
        values, scales = quantize_rows(rows)
        self.values[index] = values
        self.scales[index] = scales.to(self.dtype)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., dim] -> int8 values [..., dim] and scales [..., 1] (float32): symmetric, max |x| at 127."""
    rows = rows.float()
    scales = rows.abs().amax(dim=-1, keepdim=True) / QMAX
    values = torch.round(rows / scales.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-QMAX, QMAX)
    return values.to(torch.int8), scales
