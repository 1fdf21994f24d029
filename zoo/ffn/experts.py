"""A layer's routed experts as stacked weights: [n_experts, out, in] per projection, so one expert is a view (the
grouped path multiplies its rows by it) and any set of experts is one index_select (the gathered path: fixed shapes
for a compiled or graph-captured step). Each expert is a SwiGLU, as in Mixtral, Qwen2-MoE and DeepSeek-V3."""
import torch
import torch.nn.functional as F
from torch import nn

from kernels.grouped_matmul import grouped_matmul

INIT_STD = 0.02  # the model's normal init (zoo.model.init_weights covers nn.Linear only)


class ExpertLinear(nn.Module):
    """n_experts bias-free linear maps in_features -> out_features; weight [n_experts, out, in] (nn.Linear's layout
    per expert). zoo.quantize turns it into a QuantizedExpertLinear with the same two methods."""

    def __init__(self, n_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))
        nn.init.normal_(self.weight, std=INIT_STD)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e applied to rows x [n, in] -> [n, out]: reads that expert's weight only."""
        return F.linear(x, self.weight[e])

    def gathered(self, ids: torch.Tensor) -> torch.Tensor:
        """The weights of experts `ids` [n] as [n, out, in]: only those experts are read."""
        return self.weight.index_select(0, ids)

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """Row m -> expert ids[m] applied to x[source[m]] (x[m] without source): [M, out], each routed expert's
        weight tiles read once per tile of its rows (kernels/grouped_matmul.py)."""
        return grouped_matmul(x, self.weight, ids, source)


class Experts(nn.Module):
    """n_experts SwiGLU experts, each down(SiLU(gate x) * up x)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = ExpertLinear(n_experts, d_model, hidden)
        self.up_proj = ExpertLinear(n_experts, d_model, hidden)
        self.down_proj = ExpertLinear(n_experts, hidden, d_model)

    @staticmethod
    def module_bytes(dtype: torch.dtype, n_experts: int, d_model: int, hidden: int) -> int:
        return 3 * n_experts * d_model * hidden * dtype.itemsize

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows x [n, d_model]."""
        return self.down_proj.expert(e, F.silu(self.gate_proj.expert(e, x)) * self.up_proj.expert(e, x))

    def gathered(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Expert ids[i] on row x[i], for every i at once (ids [n], x [n, d_model]) by batched matrix-vector products
        over the gathered weights: shapes fixed by n alone."""
        x = x[:, :, None]
        hidden = F.silu(torch.bmm(self.gate_proj.gathered(ids), x)) * torch.bmm(self.up_proj.gathered(ids), x)
        return torch.bmm(self.down_proj.gathered(ids), hidden)[:, :, 0]

    @property
    def tiles(self) -> bool:
        """Whether grouped() can run: float stacks (a quantized stack has no dense weight to tile)."""
        return all(isinstance(p, ExpertLinear) for p in (self.gate_proj, self.up_proj, self.down_proj))

    def grouped(self, ids: torch.Tensor, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Expert ids[m] on token x[source[m]], for every (token, expert) pair m by grouped matmuls (ids, source
        [M], x [tokens, d_model]): fixed shapes, each routed expert's weights read once per tile of its pairs."""
        hidden = F.silu(self.gate_proj.grouped(x, ids, source)) * self.up_proj.grouped(x, ids, source)
        return self.down_proj.grouped(hidden, ids)
