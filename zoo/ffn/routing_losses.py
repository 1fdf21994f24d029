"""What an MoE layer's router did in one training forward, the auxiliary losses that train it, and statistics of it.

- Load-balancing loss (Fedus et al. 2021, Switch Transformer, eq. 4): n_experts * sum_i f_i * P_i, where f_i is the
  fraction of the (token, slot) routing assignments that went to expert i (no gradient: a count) and P_i the mean
  router probability of expert i over the tokens (the gradient's path). 1.0 when both are uniform; larger when the
  probable experts are also the busy ones. Taken over the whole batch's tokens, as Switch does.
- Router z-loss (Zoph et al. 2022, ST-MoE, eq. 5): the mean over tokens of logsumexp(router logits)^2, which keeps
  the logits small (fp32 round-off in the softmax grows with them).

The router's distribution: softmax(logits) for the softmax router (Mixtral, Qwen2-MoE); for the sigmoid router
(DeepSeek-V3) its sigmoid scores normalised to sum 1 over the experts, the s'_i of DeepSeek-V3's sequence-wise
balance loss (whose f_i, scaled by n_experts / top_k, makes the same product). Both losses and the entropy read it;
the z-loss reads the logits as they are for either router. The choice is the ids the layer routed by (for the sigmoid
router, chosen with its correction bias).
"""
from dataclasses import dataclass

import torch

SMALLEST_PROBABILITY = 1e-30  # a probability that underflowed to 0 adds 0 * log(this) = 0 to the entropy


@dataclass
class Routing:
    """One MoE layer's routing in one training forward: fp32 logits [N, n_experts] (with their graph, so the losses
    reach the router's weight), the chosen expert ids [N, top_k], and the router kind ("softmax" or "sigmoid")."""

    logits: torch.Tensor
    ids: torch.Tensor
    scoring: str

    def __deepcopy__(self, memo) -> "Routing":
        """A copy of the values without their graph (a copied model, e.g. zoo.quantize's, cannot copy a graph)."""
        return Routing(self.logits.detach().clone(), self.ids.clone(), self.scoring)

    @property
    def n_experts(self) -> int:
        return self.logits.shape[-1]

    def probabilities(self) -> torch.Tensor:
        """[N, n_experts], each row summing to 1: softmax, or the sigmoid scores normalised."""
        if self.scoring == "softmax":
            return self.logits.softmax(-1)
        scores = self.logits.sigmoid()
        return scores / scores.sum(-1, keepdim=True)


def expert_fractions(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """f [n_experts]: the share of the (token, slot) assignments in ids [N, top_k] that went to each expert."""
    return ids.flatten().bincount(minlength=n_experts).float() / ids.numel()


def balance_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's load-balancing loss: n_experts * sum_i f_i * P_i (a scalar; 1.0 when balanced)."""
    mean_probability = routing.probabilities().mean(0)
    return routing.n_experts * (expert_fractions(routing.ids, routing.n_experts) * mean_probability).sum()


def z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (a scalar)."""
    return (routing.logits.logsumexp(-1) ** 2).mean()


@torch.no_grad()
def load_max_over_mean(routing: Routing) -> float:
    """Assignments to the busiest expert over the mean per expert: 1.0 perfectly balanced, n_experts / top_k at
    most (every token's top_k on the same experts)."""
    counts = routing.ids.flatten().bincount(minlength=routing.n_experts).float()
    return float(counts.max() / counts.mean())


@torch.no_grad()
def entropy_nats(routing: Routing) -> float:
    """The mean over tokens of the entropy of the router's distribution, in nats: 0 (one expert certain) to
    ln(n_experts) (uniform)."""
    p = routing.probabilities()
    return float(-(p * p.clamp_min(SMALLEST_PROBABILITY).log()).sum(-1).mean())
