"""An eager CPU decode step's blocks in one call: the halves every block decided (kernels/cpu_blocks.py's Half), the
model's final RMSNorm and its head, laid out once and run by one C++ op (archzoo::decode_blocks) step after step, as
long as nothing they were decided from has changed.

Deciding a half is Python: ~50 checks and reads of modules, parameters and caches, two half decisions a block. Run
between weight streams that have evicted the interpreter's data from the CPU's caches, the decisions and the two op
calls of every block measured ~0.9-1.2 ms of a 4.6-6 ms `small` gqa step (fp32, batch 1, 2-core EPYC;
benchmarks/step_split.py), the largest part of the step beyond its floor. A plan decides once per batch size and dtype,
like the engine's CUDA graphs, which are captured once per batch-size bucket.

Unlike a captured graph, a plan checks before every step that what it was decided from still holds (its guard, a few
C-level passes over flat lists): the caches it was built over; the engine-step facts (a one-token decode step, no
checkpoints, padding or tree, no gradient recorded, no global module hook, Triton not forced, the C++ glue built); no
forward hook on any module of the blocks, the final norm or the head; each such module's children, parameters and
buffers the same objects, and no attribute added to it (a module replaced, as zoo.quantize does, a parameter set, a
method replaced on an instance); every attribute of every cache the same object; the data pointer of every parameter and
buffer, so a parameter's data swapped (`module.to(dtype)`, `p.data = ...`) is seen; and each module class's forward and
decode_half. Any change and the plan is decided again. Values written in place (a weight copied into, a checkpoint
loaded) need nothing: the plan reads them where they lie. Not seen: a plain attribute a module already had set to a new
value (its eps, its scale): set those before an engine's first step, or build a new engine.
"""
import operator
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch.nn.modules import module as module_hooks

from attention.norm import RMSNorm
from kernels import cpu_blocks, cpu_decode
from kernels.cpu_fused import fused_path
from kernels.linear import Linear, dense_gemv_path, rows_of
from kernels.dispatch import triton_forced

CLASS_METHODS = ("forward", "decode_half")


def step_fits(x: torch.Tensor, batch) -> bool:
    """Whether an engine step may run through a plan: an eager one-token decode step on the CPU with nothing
    recorded, no global module hook and the C++ glue built (the facts no plan's guard holds)."""
    return (batch is not None and batch.step == "decode" and not batch.checkpoints and not batch.padded
            and batch.tree is None and x.dim() == 3 and x.shape[1] == 1 and x.is_cpu
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks)
            and not triton_forced() and cpu_decode.glue_available())


@dataclass(eq=False)
class Guard:
    """What a plan was decided from (see the module doc), checked whole before each step it runs, in C-level passes
    over flat lists: ~30 µs for a `small` model's 105 modules (comparing every attribute of every module by identity
    measured 165 µs)."""
    caches: tuple
    hooks: list  # every module's forward and forward-pre hook dicts
    hooked: bool  # whether any held a hook (then no plan: a plan runs none of the modules' forwards)
    sized: list  # dicts that must keep their sizes: every module's __dict__ (an attribute added: a method replaced on
    sizes: list[int]  # the instance), its children, parameters and buffers; every cache's __dict__ and the dicts in it
    owners: list  # (dict, key) pairs whose values must be the same objects: the children, parameters and buffers,
    keys: list  # and every cache attribute
    values: list
    tensors: list[torch.Tensor]  # every parameter and buffer, at the same data pointer
    pointers: list[int]
    methods: list  # (class, name) pairs, each the same function
    functions: list

    @classmethod
    def of(cls, model: torch.nn.Module, roots: list[torch.nn.Module], caches: list) -> "Guard":
        """The guard of a plan over `roots` (modules of `model`) and `caches`; the model's own children too (a root
        replaced there)."""
        modules = list({id(m): m for root in roots for m in root.modules()}.values())
        objects = {id(c): c for c in caches if c is not None}.values()
        hooks = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        owned = [model._modules] + [d for m in modules for d in (m._modules, m._parameters, m._buffers)]
        owned += [vars(c) for c in objects] + [d for c in objects for d in vars(c).values() if isinstance(d, dict)]
        sized = [vars(m) for m in modules] + owned
        pairs = [(d, key) for d in owned for key in d]
        tensors = list({id(t): t for m in modules for t in chain(m._parameters.values(), m._buffers.values())
                        if t is not None}.values())
        classes = list({type(obj): None for obj in (*modules, *objects)})
        methods = [(c, name) for c in classes for name in CLASS_METHODS]
        return cls(tuple(caches), hooks, any(hooks), sized, list(map(len, sized)), [d for d, _ in pairs],
                   [k for _, k in pairs], [d[k] for d, k in pairs], tensors, [t.data_ptr() for t in tensors], methods,
                   [getattr(c, n, None) for c, n in methods])

    def holds(self, caches: list) -> bool:
        return (len(caches) == len(self.caches) and all(map(operator.is_, caches, self.caches))
                and any(self.hooks) == self.hooked and list(map(len, self.sized)) == self.sizes
                and all(map(operator.is_, map(dict.get, self.owners, self.keys), self.values))
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.pointers
                and all(getattr(c, n, None) is f for (c, n), f in zip(self.methods, self.functions)))


@dataclass(eq=False)
class DecodePlan:
    """Every block's halves of one batch size's decode step, laid out for decode_blocks (None: some block has no
    fused half, and the blocks run as they decide), and the guard they were decided under. `ends_at`: what the plan
    returns, the last block's x ("blocks": the model's final norm is a LayerNorm, or an RMSNorm the kernels do not
    take), the final RMSNorm's ("norm": the head is not on the C GEMV at this shape) or the head's logits ("head")."""
    guard: Guard
    lists: tuple | None  # flatten_halves' (weights, states, floats, ints); None: no plan
    row_caches: list  # one cache per row rule: decode_rows is called once a step for each
    ends_at: str = "blocks"
    buffers: list = field(default_factory=list)  # cpu_blocks.step_buffers': the halves' outputs, reused every step

    def run(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        found = [cache.decode_rows(batch) for cache in self.row_caches]
        return cpu_blocks.decode_blocks_op(x, *self.lists, positions, batch.slots, [r for r, _ in found],
                                           [n for _, n in found], self.buffers)


def decide(model, x: torch.Tensor, caches: list, batch) -> DecodePlan:
    """The plan of model's blocks for this step's shape: each block's halves (Block.decode_halves), then the final
    norm where it is an RMSNorm the fused kernels take, then the head where its Linear would take the C GEMV (as
    kernels/linear.py decides: the same sums); or none."""
    guard = Guard.of(model, [model.blocks, model.norm, model.head], caches)
    if guard.hooked:  # a hook on any module of the blocks, the norm or the head is run where the modules run
        return DecodePlan(guard, None, [])
    halves = []
    for block, cache in zip(model.blocks, caches):
        pair = block.decode_halves(x, cache, batch)
        if pair is None:
            return DecodePlan(guard, None, [])
        halves += pair
    norm, head, ends_at = model.norm, model.head, "blocks"
    # each its class's own forward (not one replaced on the instance, which a plan would not run)
    if (type(norm) is RMSNorm and "forward" not in vars(norm) and fused_path(x, rows_of(x), norm.weight)
            and norm.weight.shape == x.shape[-1:]):
        halves.append(cpu_blocks.Half("norm", (norm.weight,), floats=(float(norm.eps),)))
        ends_at = "norm"
        if type(head) is Linear and "forward" not in vars(head) and dense_gemv_path(x, head.weight, head.bias):
            halves.append(cpu_blocks.Half("head", (head.weight, head.bias)))
            ends_at = "head"
    weights, states, floats, ints, row_caches = cpu_blocks.flatten_halves(halves)
    return DecodePlan(guard, (weights, states, floats, ints), row_caches, ends_at, cpu_blocks.step_buffers(x, halves))


class DecodePlans:
    """One engine's decode plans, by batch size and dtype (its runner keeps them beside its caches, so they live and
    die with them); a model reaches them through the step's CacheBatch."""

    def __init__(self):
        self.plans: dict[tuple, DecodePlan] = {}

    def plan(self, model, x: torch.Tensor, caches: list, batch) -> DecodePlan | None:
        """This step's plan, decided again where its guard no longer holds; None where the step cannot run one."""
        if not step_fits(x, batch):
            return None
        key = (x.shape[0], x.dtype)
        plan = self.plans.get(key)
        if plan is None or not plan.guard.holds(caches):
            plan = self.plans[key] = decide(model, x, caches, batch)
        return plan if plan.lists is not None else None
