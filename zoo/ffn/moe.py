"""Mixture of experts (MoE): a router picks top_k of n_experts SwiGLU experts per token, and the token's output is
their outputs weighted by the router, plus optional shared experts every token runs.

Routing, by `router`:
- "softmax" (Mixtral, Qwen2-MoE): p = softmax(logits); the top_k of p, weights p over them, renormalised to sum 1
  when norm_topk_prob (Mixtral always; Qwen2-MoE's norm_topk_prob flag).
- "sigmoid" (DeepSeek-V3): s = sigmoid(logits); the top_k of s + b, where b is the per-expert
  e_score_correction_bias (bias-corrected top-k: b steers load balance and is used for the choice only); weights s
  over them, renormalised when norm_topk_prob. DeepSeek-V3's group-limited choice and routed scaling factor are not
  modelled.
Shared experts (n_shared_experts, each expert_hidden wide, run as one SwiGLU of n_shared_experts * expert_hidden):
with the softmax router as Qwen2-MoE gates them, times sigmoid(w . x) of a learned w; with the sigmoid router as
DeepSeek-V3 adds them, ungated.

Two fast paths, the same sum:
- grouped (any eager step): the (token, expert) pairs sorted by expert (an argsort of the expert ids); each routed
  expert multiplies its rows once, reading its weights once (the `moe_align_block_size` idea without the tile
  padding); the expert counts are read on the host, so a graph-captured or compiled step cannot take it.
- gathered (a compiled step or a graph-captured one, batch.captured): each (token, expert) pair's weights are
  gathered from the stacked experts (index_select) and applied by batched matrix-vector products: shapes fixed by
  the token count, no host read, only routed experts read (a pair's expert once per pair, so at a batch where
  tokens * top_k passes n_experts it reads experts more than once). Run eagerly on the CPU, index_select copies each
  pair's weights before the bmm: benchmarks/moe_paths.py measured it 1.0-2.0x faster than all experts at one token
  but 12x slower at 16 (8 experts, top 2), where grouping was 1.5x faster; it is for fixed-shape steps only.
On CUDA both give way to a third, tiled: the pairs aligned by expert into 16-row tiles and run by a Triton grouped
matmul (kernels/grouped_matmul.py), each routed expert's weight tiles read once per tile of its pairs, with shapes
fixed by the token count, so eager, compiled and captured steps all take it (float experts; a quantized stack keeps
the two paths above).
`reference` is a dense float64 loop over all experts, written without any path's code.

In training mode `route` also keeps the last forward's router logits and choice in `last_routing` (a
zoo.ffn.routing_losses.Routing), which the trainers take after the forward for the auxiliary losses and the routing
statistics; in eval mode (validation, the engine, a compiled or captured step) it keeps nothing.
"""
import torch
from torch import nn

from kernels import use_triton
from zoo import checks
from zoo.ffn.experts import Experts
from zoo.ffn.router import Router
from zoo.ffn.routing_losses import Routing
from zoo.ffn.swiglu import SwiGLU

ROUTERS = ("softmax", "sigmoid")


def expert_width(hidden: int, expert_hidden: int | None) -> int:
    """Each expert's hidden width: expert_hidden, else the model's FFN width (Mixtral's experts are full FFNs)."""
    return checks.integer("expert_hidden", hidden if expert_hidden is None else expert_hidden, minimum=1)


def check_routing(n_experts: int, top_k: int, n_shared_experts: int, router: str) -> None:
    """Each setting's range, named, before anything is sized from it."""
    checks.integer("n_experts (routed experts per layer)", n_experts, minimum=1)
    if not checks.is_integer(top_k) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k (experts each token is routed to) must be an integer in [1, n_experts={n_experts}], "
                         f"got {checks.short(top_k)}")
    checks.integer("n_shared_experts (experts every token runs)", n_shared_experts, minimum=0)
    checks.choice("router", router, ROUTERS)


class MoE(nn.Module):
    def __init__(self, d_model: int, hidden: int, n_experts: int = 8, top_k: int = 2, expert_hidden: int | None = None,
                 n_shared_experts: int = 0, router: str = "softmax", norm_topk_prob: bool = True):
        width = expert_width(hidden, expert_hidden)
        check_routing(n_experts, top_k, n_shared_experts, router)
        checks.boolean("norm_topk_prob", norm_topk_prob)
        super().__init__()
        self.n_experts, self.top_k, self.scoring, self.norm_topk_prob = n_experts, top_k, router, norm_topk_prob
        self.d_model, self.expert_hidden = d_model, width
        self.gate = Router(d_model, n_experts, bias=router == "sigmoid")
        self.experts = Experts(n_experts, d_model, width)
        self.shared_experts = SwiGLU(d_model, n_shared_experts * width) if n_shared_experts else None
        self.shared_expert_gate = Router(d_model, 1) if n_shared_experts and router == "softmax" else None
        # tokens routed to each expert by the last forward (padding rows too): what a step's weight reads follow
        self.register_buffer("routed_tokens", torch.zeros(n_experts, dtype=torch.int64), persistent=False)
        # decode steps since the last reset, and in how many of them each expert was read: summed on the device (no
        # host read per step, so a captured step records too), read once after a measurement
        self.register_buffer("decode_steps", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("decode_reads", torch.zeros(n_experts, dtype=torch.int64), persistent=False)
        # the last training forward's routing, until a trainer takes it (None in eval mode: inference keeps nothing)
        self.last_routing: Routing | None = None

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, hidden: int, n_experts: int = 8, top_k: int = 2,
                     expert_hidden: int | None = None, n_shared_experts: int = 0, router: str = "softmax",
                     norm_topk_prob: bool = True) -> int:
        width = expert_width(hidden, expert_hidden)
        check_routing(n_experts, top_k, n_shared_experts, router)
        shared = SwiGLU.module_bytes(dtype, d_model, n_shared_experts * width) if n_shared_experts else 0
        shared_gate = Router.module_bytes(dtype, d_model, 1) if n_shared_experts and router == "softmax" else 0
        return (Router.module_bytes(dtype, d_model, n_experts, bias=router == "sigmoid")
                + Experts.module_bytes(dtype, n_experts, d_model, width) + shared + shared_gate
                + (2 * n_experts + 1) * torch.int64.itemsize)  # routed_tokens, decode_reads, decode_steps

    @property
    def inactive_weights(self) -> int:
        """Expert weights a token does not use: the n_experts - top_k experts it is not routed to."""
        return (self.n_experts - self.top_k) * 3 * self.d_model * self.expert_hidden

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d_model] -> expert ids [N, top_k] and their fp32 weights [N, top_k]; in training mode the logits and
        ids are also kept in last_routing for the auxiliary losses."""
        logits = self.gate(x)
        if self.scoring == "softmax":
            weights, ids = logits.softmax(-1).topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            ids = (scores + self.gate.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.training:
            self.last_routing = Routing(logits, ids, self.scoring)
        return ids, weights

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(rows)
        self.count(ids, batch is not None and batch.is_decode)
        fixed_shapes = torch.compiler.is_compiling() or (batch is not None and batch.captured)
        if use_triton(rows) and self.experts.tiles:  # CUDA: the tiled grouped matmul, fixed shapes eager or captured
            y = self.tiled(rows, ids, weights)
        else:
            y = self.gathered(rows, ids, weights) if fixed_shapes else self.grouped(rows, ids, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(rows)
            y = y + (shared if self.shared_expert_gate is None
                     else shared * self.shared_expert_gate(rows).sigmoid().to(shared.dtype))
        return y.reshape(x.shape)

    @torch.no_grad()
    def count(self, ids: torch.Tensor, decode: bool) -> None:
        """routed_tokens := tokens per expert in this forward (fixed shapes: an index_add, not a bincount); a decode
        step also adds the experts it read to decode_reads."""
        self.routed_tokens.zero_().index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        if decode:
            self.decode_steps.add_(1)
            self.decode_reads.add_((self.routed_tokens > 0).long())

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert; each routed expert runs once on its rows; outputs added back to their tokens."""
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        sorted_rows = x[tokens]
        outputs, start = [], 0
        for e, count in enumerate(flat.bincount(minlength=self.n_experts).tolist()):  # read on the host
            if count:
                outputs.append(self.experts.expert(e, sorted_rows[start:start + count]))
                start += count
        routed = torch.cat(outputs) * weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, routed)

    def tiled(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair by the Triton grouped matmul; weighted sum over a token's top_k."""
        n, k = ids.shape
        source = torch.arange(n * k, device=x.device) // k  # each pair's token (repeat_interleave reads the host)
        out = self.experts.grouped(ids.flatten(), x, source).view(n, k, -1)
        return (out * weights[..., None].to(x.dtype)).sum(1)

    def gathered(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair through its gathered expert weights; weighted sum over a token's top_k."""
        n, k = ids.shape
        pairs = x[:, None, :].expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1])
        out = self.experts.gathered(ids.flatten(), pairs).view(n, k, -1)
        return (out * weights[..., None].to(x.dtype)).sum(1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float64, dense: every expert on every token, weighted by the router (zero off a token's top_k)."""
        rows = x.double().reshape(-1, x.shape[-1])
        logits = rows @ self.gate.weight.double().T
        if self.scoring == "softmax":
            scores = torch.exp(logits - logits.amax(-1, keepdim=True))
            scores = scores / scores.sum(-1, keepdim=True)
            choice = scores
        else:
            scores = 1 / (1 + torch.exp(-logits))
            choice = scores + self.gate.e_score_correction_bias.double()
        chosen = torch.sort(choice, dim=-1, descending=True).indices[:, :self.top_k]
        weights = torch.zeros_like(scores).scatter(1, chosen, scores.gather(1, chosen))
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(rows)
        for e in range(self.n_experts):
            gate = rows @ self.experts.gate_proj.weight[e].double().T
            up = rows @ self.experts.up_proj.weight[e].double().T
            down = self.experts.down_proj.weight[e].double()
            out += weights[:, e:e + 1] * ((gate / (1 + torch.exp(-gate)) * up) @ down.T)
        if self.shared_experts is not None:
            shared = self.shared_experts.reference(rows)
            if self.shared_expert_gate is not None:
                shared = shared / (1 + torch.exp(-(rows @ self.shared_expert_gate.weight.double().T)))
            out += shared
        return out.reshape(x.shape)
