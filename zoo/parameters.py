"""A model's parameters counted as total and active, active being what one token's forward uses (Mixtral 8x7B:
46.7B total, 12.9B active); the experts each MoE layer's last forward routed tokens to; and how many distinct experts
a decode step reads, measured (the union over the batch) and expected for a uniform router."""
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


def moe_layers(model) -> dict[int, MoE]:
    """Layer index -> its MoE feed-forward, for each layer that has one."""
    return {i: block.mlp for i, block in enumerate(model.blocks) if isinstance(block.mlp, MoE)}


def expected_experts_read(n_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a layer reads for `tokens` tokens when each picks top_k of n_experts uniformly at random:
    E (1 - (1 - k/E)^B). One token reads k; as B grows it approaches all E, which is where an MoE step stops
    reading less than a dense model of its total size."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def reset_decode_routing(model) -> None:
    """Forget the decode steps the MoE layers have counted (before a measurement's timed steps)."""
    for moe in moe_layers(model).values():
        moe.decode_steps.zero_()
        moe.decode_reads.zero_()


def decode_experts_read(model) -> dict[int, float]:
    """Per MoE layer, the mean number of distinct experts a decode step read since the last reset (the union over
    each step's batch, padding rows included); empty without MoE layers or decode steps."""
    return {i: float(moe.decode_reads.sum()) / int(moe.decode_steps)
            for i, moe in moe_layers(model).items() if int(moe.decode_steps)}
