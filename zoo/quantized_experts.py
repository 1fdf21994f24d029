"""A stack of experts' weights in int8 or int4 (zoo/quantize.py's formats, one expert at a time), with the two
methods an ExpertLinear has: `expert` (one expert's rows, through kernels/quantized_matmul.py's multiplies) and
`gathered` (the chosen experts' weights dequantized, only theirs read). Rounded to nearest under either method:
AWQ's search runs on nn.Linear layers and their calibration activations, which an expert sees only for the tokens
routed to it."""
import torch
from torch import nn

from kernels.quantized_matmul import int4_dequantize, int4_matmul, int8_matmul
from zoo.ffn.experts import ExpertLinear


class QuantizedExpertLinear(nn.Module):
    def __init__(self, stack: ExpertLinear, scheme: str, group_size: int, quantize_one):
        """quantize_one: zoo.quantize's rounding of one [out, in] weight -> (q, scales[, zeros])."""
        super().__init__()
        dtype = stack.weight.dtype
        rounded = [quantize_one(weight.detach().float()) for weight in stack.weight]
        q, scales, *zeros = (torch.stack(parts) for parts in zip(*rounded))
        self.hold(scheme, group_size, stack.in_features, q, scales.to(dtype), zeros[0].to(dtype) if zeros else None)

    @classmethod
    def empty(cls, stack: ExpertLinear, scheme: str, group_size: int) -> "QuantizedExpertLinear":
        """A stack of `stack`'s shape, dtype and device whose stored tensors load_state_dict fills (zoo.load)."""
        layer = cls.__new__(cls)  # without __init__, which rounds a float weight
        super(cls, layer).__init__()
        e, n, k = stack.weight.shape

        def empty(*shape: int, dtype: torch.dtype = stack.weight.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=stack.weight.device)

        if scheme == "int8":
            q, scales, zeros = empty(e, n, k, dtype=torch.int8), empty(e, n), None
        else:
            groups = k // group_size
            q, scales, zeros = empty(e, n, k // 2, dtype=torch.uint8), empty(e, n, groups), empty(e, n, groups)
        layer.hold(scheme, group_size, k, q, scales, zeros)
        return layer

    def hold(self, scheme: str, group_size: int, in_features: int, q: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None) -> None:
        """Keep the stored tensors as (saved) buffers: q [E, out, in] int8 or [E, out, in / 2] uint8, scales (and
        int4's zeros) per expert as QuantizedLinear holds them for one."""
        self.scheme, self.group_size = scheme, group_size
        self.n_experts, self.out_features, self.in_features = q.shape[0], q.shape[1], in_features
        for name, tensor in (("q", q), ("scales", scales), ("zeros", zeros)):
            self.register_buffer(name, tensor)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "int8":
            return int8_matmul(x, self.q[e], self.scales[e])
        return int4_matmul(x, self.q[e], self.scales[e], self.zeros[e], self.group_size)

    def gathered(self, ids: torch.Tensor) -> torch.Tensor:
        """Experts `ids`' weights [n, out, in], dequantized from their stored bits."""
        q, scales = self.q.index_select(0, ids), self.scales.index_select(0, ids)
        if self.scheme == "int8":
            return q.to(scales.dtype) * scales[..., None]
        return int4_dequantize(q, scales, self.zeros.index_select(0, ids), self.group_size, scales.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Every expert's dequantized weight [E, out, in] (for the float64 reference)."""
        return self.gathered(torch.arange(self.n_experts, device=self.q.device))

    @property
    def stored_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.state_dict().values())

    @property
    def weight_elements(self) -> int:
        """The weights it stands for, whatever its bits."""
        return self.n_experts * self.in_features * self.out_features

    def extra_repr(self) -> str:
        group = f", group {self.group_size}" if self.scheme == "int4" else ""
        return f"{self.n_experts} x {self.in_features} -> {self.out_features}, {self.scheme}{group}"
