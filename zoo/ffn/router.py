"""An MoE router: a linear map from a token to one logit per expert, computed in fp32 (DeepSeek-V3's gate casts to
fp32; a rounding flip would move a token to another expert).

It is not an nn.Linear on purpose: zoo.quantize replaces nn.Linear layers, and the router stays in full precision as
vLLM keeps Mixtral's and Qwen2-MoE's gates unquantized (a routing choice is discrete: a small weight error can change
it). With `bias`, it holds DeepSeek-V3's e_score_correction_bias (a buffer tuned for load balance, not trained by
gradient), added to the scores only to choose experts.
"""
import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # the model's normal init (zoo.model.init_weights covers nn.Linear only)


class Router(nn.Module):
    def __init__(self, d_model: int, n_outputs: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = d_model, n_outputs
        self.weight = nn.Parameter(torch.empty(n_outputs, d_model))
        nn.init.normal_(self.weight, std=INIT_STD)
        self.register_buffer("e_score_correction_bias", torch.zeros(n_outputs) if bias else None)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, n_outputs: int, bias: bool = False) -> int:
        return (d_model + bias) * n_outputs * dtype.itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d_model] -> fp32 logits [N, n_outputs]."""
        return F.linear(x.float(), self.weight.float())
