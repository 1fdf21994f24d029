"""A model's parameters counted as total and active, active being what one token's forward uses (Mixtral 8x7B:
46.7B total, 12.9B active), and the experts each MoE layer's last forward routed tokens to."""
from dataclasses import dataclass

from zoo.cache import QUANTIZED
from zoo.ffn.moe import MoE


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every weight: a tied embedding and head once, a quantized layer as its in x out
    active: int  # total less, in each MoE layer, the n_experts - top_k experts a token is not routed to


def parameter_counts(model) -> ParameterCounts:
    """Total and active parameters: the non-expert weights, plus per MoE layer its router, all its experts (total) or
    top_k of them (active), and its shared experts. A model built on the meta device counts without memory."""
    total = (sum(p.numel() for p in model.parameters())
             + sum(m.weight_elements for m in model.modules() if isinstance(m, QUANTIZED)))
    return ParameterCounts(total, total - sum(m.inactive_weights for m in model.modules() if isinstance(m, MoE)))


def routed_experts(model) -> dict[int, list[int]]:
    """Layer index -> the experts its last forward routed any token to, for each MoE layer: the union over the batch,
    whose weights a step reads."""
    return {i: block.mlp.routed_tokens.nonzero().flatten().tolist()
            for i, block in enumerate(model.blocks) if isinstance(block.mlp, MoE)}
