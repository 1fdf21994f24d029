"""The MoE auxiliary losses of a training step, and the routing statistics a run reports, for `zoo train` and
`zoo recall` alike.

After a step's forward (in training mode) each MoE layer holds its routing (zoo/ffn/moe.py's `last_routing`);
`MoETraining.step_loss` takes it from every layer, so no later step reads a stale one, and returns
balance_weight * mean over layers of the load-balancing loss (Fedus et al. 2021, Switch Transformer) +
z_weight * mean over layers of the router z-loss (Zoph et al. 2022, ST-MoE), both defined in
zoo/ffn/routing_losses.py. The trainers add it to the task loss for the backward pass only: the bits per byte and
the recall they report stay the task's.

A model without MoE layers trains on its task loss alone whatever the weights: they are recorded as not applying
(null in the results). Every report (an evaluation point) carries, for a model with MoE layers, the routing of the
training steps since the previous one: per layer and averaged over layers, the mean over steps of load max/mean
(assignments to the busiest expert over the mean per expert; 1.0 is balanced), of the routing entropy in nats
(mean over tokens; ln(n_experts) is uniform) and of the two losses unweighted.
"""
from dataclasses import dataclass

import torch

import zoo
from zoo import checks
from zoo.ffn.routing_losses import Routing, balance_loss, entropy_nats, load_max_over_mean, z_loss

BALANCE_WEIGHT = 0.01  # Switch Transformer's alpha
Z_WEIGHT = 0.001  # ST-MoE's c_z
STATISTICS = ("load_max_over_mean", "entropy_nats", "balance_loss", "z_loss")  # what a report gives per layer


def check_weights(balance_weight, z_weight) -> None:
    """Each weight a finite number >= 0 (0 turns its loss off), named by its option."""
    checks.real("moe_balance_weight", balance_weight, minimum=0)
    checks.real("moe_z_weight", z_weight, minimum=0)


def has_moe_layers(config: zoo.ModelConfig) -> bool:
    """Whether any layer's feed-forward is an MoE (the weights apply), from the config alone."""
    return any(config.ffn(i).kind == "moe" for i in range(config.n_layers))


def take_routing(model) -> dict[int, Routing]:
    """Layer index -> the routing its MoE kept in the forward just run, taken from it (the layer keeps none)."""
    taken = {}
    for i, moe in zoo.moe_layers(model).items():
        if moe.last_routing is None:
            raise RuntimeError(f"the MoE of layer {i} kept no routing: the step's forward must run in training mode")
        taken[i], moe.last_routing = moe.last_routing, None
    return taken


@dataclass
class MoETraining:
    """A run's MoE side: the weights it applies (applies False: the model has no MoE layers) and the statistics of
    its steps since the last report (per layer, each statistic's sum over those steps)."""

    balance_weight: float
    z_weight: float
    applies: bool

    def __post_init__(self):
        self.sums: dict[int, dict[str, float]] = {}
        self.steps = 0

    @classmethod
    def for_model(cls, model, balance_weight: float, z_weight: float) -> "MoETraining":
        check_weights(balance_weight, z_weight)
        return cls(float(balance_weight), float(z_weight), bool(zoo.moe_layers(model)))

    def step_loss(self, model) -> torch.Tensor | float:
        """The weighted auxiliary loss of the forward just run (0.0 without MoE layers); its statistics recorded."""
        if not self.applies:
            return 0.0
        routings = take_routing(model)
        balance = {i: balance_loss(r) for i, r in routings.items()}
        z = {i: z_loss(r) for i, r in routings.items()}
        for i, routing in routings.items():
            values = (load_max_over_mean(routing), entropy_nats(routing), float(balance[i].detach()),
                      float(z[i].detach()))
            layer = self.sums.setdefault(i, dict.fromkeys(STATISTICS, 0.0))
            for name, value in zip(STATISTICS, values):
                layer[name] += value
        self.steps += 1
        total = 0.0
        if self.balance_weight:  # a weight of 0 leaves the loss (and its gradient) out entirely
            total = total + self.balance_weight * sum(balance.values()) / len(balance)
        if self.z_weight:
            total = total + self.z_weight * sum(z.values()) / len(z)
        return total

    def report(self) -> dict:
        """The weights applied (None: not applying) and, for an MoE model with steps since the last report, their
        routing statistics ("moe_routing"); the steps are then forgotten."""
        weights = {"moe_balance_weight": self.balance_weight if self.applies else None,
                   "moe_z_weight": self.z_weight if self.applies else None}
        if not self.steps:
            return weights
        layers = {str(i): {name: total / self.steps for name, total in sums.items()} for i, sums in self.sums.items()}
        averaged = {name: sum(layer[name] for layer in layers.values()) / len(layers) for name in STATISTICS}
        self.sums, self.steps = {}, 0
        return {**weights, "moe_routing": {**averaged, "layers": layers}}


def routing_line(report: dict) -> str:
    """The console's few words on a report's routing ('' without one)."""
    routing = report.get("moe_routing")
    if routing is None:
        return ""
    return f", load max/mean {routing['load_max_over_mean']:.2f}, routing entropy {routing['entropy_nats']:.2f} nats"
