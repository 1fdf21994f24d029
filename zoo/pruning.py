"""Structured pruning: a smaller archzoo model cut from a bigger one's weights, by whole layers (depth), whole KV
groups of an attention layer (a KV head with the query heads that read it, so a GQA model keeps its ratio), whole
heads of a Gated DeltaNet layer (each with its own dk x dv state: the state shrinks with them), feed-forward hidden
channels, and embedding channels (d_model: the residual stream's width, in every layer at once;
Minitron's "embedding" axis). The result is a normal model: its config says what it is (each kept layer's own
n_heads, n_kv_heads, head_dim and FFN hidden), `zoo.save` writes it, the engine runs it.

Which parts to keep is the caller's choice (a PrunePlan); harness/prune scores them on calibration text (ShortGPT's
block influence for layers, Minitron's activation magnitudes for heads and channels) and picks the least important
to drop. Cutting is exact where the model allows: a kept KV group's query, key, value and output columns are the
original ones, a kept channel's gate, up and down weights too, and a kept Gated DeltaNet head's q, k, v, gate,
beta, decay, conv and output weights (its output norm is per head, so the kept heads compute what they did). With
qk_norm "all" the norm's gains are cut with
their heads, but the RMS it divides by is then over fewer heads: the kept heads' outputs move a little.
Cutting embedding channels keeps each norm's gains on the kept channels times sqrt(d_model / kept): an RMSNorm
then divides by the RMS over the kept channels only, and where the cut channels carry nothing that is the original
norm exactly (up to its eps). LayerNorm also subtracts a mean over the channels: there the cut is approximate.
"""
import copy
import dataclasses
from dataclasses import dataclass

import torch

from zoo.config import FFNSpec, ModelConfig
from zoo.model import DecoderLM

WIDTH_MIXERS = ("attention",)  # mixers whose KV groups can be cut
STATE_MIXERS = ("gdn",)  # mixers whose state heads can be cut
WIDTH_FFNS = ("swiglu", "gelu")  # feed-forwards whose hidden channels can be cut
# parameter names, within a block, of the linears that read the residual stream (input columns = embedding channels)
# and of those that write it (output rows); every other tensor of an attention + SwiGLU / GELU block has no d_model axis
READS_RESIDUAL = ("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight")
WRITES_RESIDUAL = ("mixer.o_proj.weight", "mixer.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")
NORMS = ("mixer_norm", "mlp_norm")


@dataclass(frozen=True)
class PrunePlan:
    """layers: the original indices of the layers kept, ascending. kv_heads: per kept layer (original index), the KV
    heads it keeps, ascending (a layer not named keeps all). channels: per kept layer, the FFN hidden channels it
    keeps, ascending (likewise). embedding: the residual-stream channels every layer keeps, ascending (None: all).
    state_heads: per kept Gated DeltaNet layer, the heads it keeps, ascending (likewise)."""

    layers: tuple[int, ...]
    kv_heads: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    channels: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    embedding: tuple[int, ...] | None = None
    state_heads: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def sharing_layers(config: ModelConfig) -> set[int]:
    """Layers that read another layer's keys and values (kv_source), and the layers they read."""
    readers = {i: spec.params["kv_source"] for i, spec in enumerate(config.layers)
               if spec.params.get("kv_source") is not None}
    return set(readers) | set(readers.values())


def head_cut_layers(config: ModelConfig) -> list[int]:
    """Attention layers whose KV groups can be cut, or that can be converted: those that compute their own keys
    and values, which no other layer reads."""
    shared = sharing_layers(config)
    return [i for i, spec in enumerate(config.layers) if spec.kind in WIDTH_MIXERS and i not in shared]


def state_cut_layers(config: ModelConfig) -> list[int]:
    """Layers whose state heads can be cut: the Gated DeltaNet ones."""
    return [i for i, spec in enumerate(config.layers) if spec.kind in STATE_MIXERS]


def layer_heads(model: DecoderLM, layer: int) -> tuple[int, int]:
    """(n_heads, n_kv_heads) of an attention layer."""
    mixer = model.blocks[layer].mixer
    return mixer.n_heads, mixer.n_kv_heads


def ffn_hidden(model: DecoderLM, layer: int) -> int:
    return model.blocks[layer].mlp.down_proj.weight.shape[1]


def check_plan(model: DecoderLM, plan: PrunePlan) -> None:
    """Everything a plan names exists and can be cut, before any weight is copied."""
    config = model.config
    n = config.n_layers
    layers = list(plan.layers)
    if not layers or layers != sorted(set(layers)) or not all(isinstance(i, int) and 0 <= i < n for i in layers):
        raise ValueError(f"layers kept must be distinct ascending indices in [0, {n}), at least one, got {layers}")
    for what, table in (("kv_heads", plan.kv_heads), ("channels", plan.channels), ("state_heads", plan.state_heads)):
        outside = sorted(set(table) - set(layers))
        if outside:
            raise ValueError(f"{what} names layers {outside} that the plan does not keep (kept: {layers})")
    sources = {i: config.layers[i].params.get("kv_source") for i in range(n)}
    for i in layers:
        source = sources[i]
        if source is not None and source not in layers:
            raise ValueError(f"layer {i} reads the keys and values of layer {source} (kv_source), which the plan "
                             f"drops: keep both or neither")
    for i, kept in plan.kv_heads.items():
        kind = config.layers[i].kind
        if kind not in WIDTH_MIXERS:
            raise ValueError(f"layer {i} is a {kind!r} mixer: only {', '.join(WIDTH_MIXERS)} layers can lose heads")
        if i in sharing_layers(config):
            raise ValueError(f"layer {i} shares its keys and values (kv_source): its heads cannot be cut alone")
        _, kv_heads = layer_heads(model, i)
        check_indices(f"kv_heads of layer {i}", kept, kv_heads)
    for i, kept in plan.state_heads.items():
        kind = config.layers[i].kind
        if kind not in STATE_MIXERS:
            raise ValueError(f"layer {i} is a {kind!r} mixer: only {', '.join(STATE_MIXERS)} layers can lose state "
                             "heads")
        check_indices(f"state_heads of layer {i}", kept, model.blocks[i].mixer.n_heads)
    for i, kept in plan.channels.items():
        kind = config.ffn(i).kind
        if kind not in WIDTH_FFNS:
            raise ValueError(f"layer {i}'s feed-forward is {kind!r}: only {', '.join(WIDTH_FFNS)} can lose channels")
        check_indices(f"channels of layer {i}", kept, ffn_hidden(model, i))
    if plan.embedding is not None:
        check_embedding_cut(config, layers, plan.embedding)


def check_embedding_cut(config: ModelConfig, layers: list[int], kept) -> None:
    """Embedding channels can go where every kept layer is an attention mixer with a SwiGLU / GELU (or no)
    feed-forward: the blocks whose residual-stream weights READS_RESIDUAL and WRITES_RESIDUAL name."""
    for i in layers:
        mixer, ffn = config.layers[i].kind, config.ffn(i).kind
        if mixer not in WIDTH_MIXERS or ffn not in (*WIDTH_FFNS, "none"):
            raise ValueError(f"layer {i} ({mixer!r} mixer, {ffn!r} feed-forward): embedding channels can be cut "
                             f"only where every kept layer is an {' / '.join(WIDTH_MIXERS)} mixer with a "
                             f"{' / '.join(WIDTH_FFNS)} feed-forward or none")
    check_indices("embedding channels", kept, config.d_model)


def check_indices(what: str, kept, size: int) -> None:
    kept = list(kept)
    if not kept or kept != sorted(set(kept)) or not all(isinstance(j, int) and 0 <= j < size for j in kept):
        raise ValueError(f"{what} must be distinct ascending indices in [0, {size}), at least one, got {kept}")


def pruned_config(model: DecoderLM, plan: PrunePlan) -> ModelConfig:
    """The config of what plan keeps: kept layers renumbered (a kv_source too), each cut layer's own head counts
    and head_dim, each kept FFN's own hidden."""
    check_plan(model, plan)
    config = model.config
    renumber = {old: new for new, old in enumerate(plan.layers)}
    layers, ffns = [], []
    for old in plan.layers:
        spec = copy.deepcopy(config.layers[old])
        if spec.params.get("kv_source") is not None:
            spec.params["kv_source"] = renumber[spec.params["kv_source"]]
        if old in plan.kv_heads:
            n_heads, n_kv_heads = layer_heads(model, old)
            kept = len(plan.kv_heads[old])
            spec.params.update(n_heads=n_heads // n_kv_heads * kept, n_kv_heads=kept,
                               head_dim=model.blocks[old].mixer.head_dim)
        elif old in plan.state_heads:  # head_dim defaults to d_model // n_heads: kept as it was
            spec.params.update(n_heads=len(plan.state_heads[old]), head_dim=model.blocks[old].mixer.head_dim)
        elif plan.embedding is not None:  # head_dim defaults to d_model // n_heads, which the cut changes
            spec.params["head_dim"] = model.blocks[old].mixer.head_dim
        layers.append(spec)
        ffn = config.ffn(old)
        hidden = len(plan.channels[old]) if old in plan.channels else (
            ffn_hidden(model, old) if ffn.kind in WIDTH_FFNS else None)
        ffns.append(FFNSpec(ffn.kind, {**ffn.params, "hidden": hidden}) if hidden is not None else ffn)
    d_model = config.d_model if plan.embedding is None else len(plan.embedding)
    return dataclasses.replace(config, layers=layers, ffns=ffns, d_model=d_model, name=f"{config.name}-pruned")


def prune(model: DecoderLM, plan: PrunePlan) -> DecoderLM:
    """A new model holding only what plan keeps, its weights copied from model's (which is left unchanged)."""
    config = pruned_config(model, plan)
    pruned = DecoderLM(config).to(next(model.parameters()).dtype)
    pruned.load_state_dict(pruned_state(model, plan, {old: new for new, old in enumerate(plan.layers)}))
    return pruned.eval()


def pruned_state(model: DecoderLM, plan: PrunePlan, renumber: dict[int, int]) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    out = {name: tensor for name, tensor in state.items() if not name.startswith("blocks.")}
    for old, new in renumber.items():
        prefix = f"blocks.{old}."
        block = {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}
        if old in plan.kv_heads:
            block = cut_heads(block, model.blocks[old].mixer, plan.kv_heads[old])
        if old in plan.state_heads:
            block = cut_state_heads(block, model.blocks[old].mixer, plan.state_heads[old])
        if old in plan.channels:
            block = cut_channels(block, plan.channels[old])
        if plan.embedding is not None:
            block = cut_embedding(block, plan.embedding, model.config.d_model, norms=NORMS)
        out.update({f"blocks.{new}.{name}": tensor for name, tensor in block.items()})
    if plan.embedding is not None:
        out.update(cut_embedding({name: out[name] for name in ("embed.weight", "head.weight", "norm.weight",
                                                               "norm.bias") if name in out},
                                 plan.embedding, model.config.d_model, norms=("norm",)))
    return out


def cut_embedding(tensors: dict, channels: tuple[int, ...], d_model: int, norms: tuple[str, ...]) -> dict:
    """These tensors on the kept residual channels: embedding and head columns, READS_RESIDUAL columns,
    WRITES_RESIDUAL rows, norm gains (times sqrt(d_model / kept), so the norm's RMS over fewer channels keeps its
    scale) and norm biases."""
    index = torch.tensor(channels)
    rescale = (d_model / len(channels)) ** 0.5
    cut = dict(tensors)
    for name, tensor in tensors.items():
        if name in ("embed.weight", "head.weight") or name in READS_RESIDUAL:
            cut[name] = tensor[:, index].clone()
        elif name in WRITES_RESIDUAL or name in {f"{n}.bias" for n in norms}:
            cut[name] = tensor[index].clone()
        elif name in {f"{n}.weight" for n in norms}:
            cut[name] = tensor[index] * rescale
    return cut


def cut_heads(block: dict, mixer, kv_heads: tuple[int, ...]) -> dict:
    """An attention layer's weights with only these KV heads and their query heads."""
    group, dim = mixer.n_heads // mixer.n_kv_heads, mixer.head_dim
    kv_rows = torch.tensor([h * dim + d for h in kv_heads for d in range(dim)])
    q_rows = torch.tensor([(h * group + g) * dim + d for h in kv_heads for g in range(group) for d in range(dim)])
    cut = dict(block)
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        for part in ("weight", "bias"):
            key = f"mixer.{name}.{part}"
            if key in cut:
                cut[key] = cut[key][rows].clone()
    cut["mixer.o_proj.weight"] = cut["mixer.o_proj.weight"][:, q_rows].clone()  # its bias is over d_model: kept
    if mixer.qk_norm == "all":
        cut["mixer.q_norm.weight"] = cut["mixer.q_norm.weight"][q_rows].clone()
        cut["mixer.k_norm.weight"] = cut["mixer.k_norm.weight"][kv_rows].clone()
    return cut


def cut_state_heads(block: dict, mixer, heads: tuple[int, ...]) -> dict:
    """A Gated DeltaNet layer's weights with only these heads: in_proj's q, k, v, gate, b and a rows, the conv's q,
    k and v channels, the decay parameters and out_proj's columns."""
    n, dk, dv = mixer.n_heads, mixer.head_dim, mixer.value_dim
    key = [h * dk + d for h in heads for d in range(dk)]
    value = [h * dv + d for h in heads for d in range(dv)]
    conv = torch.tensor(key + [n * dk + j for j in key] + [2 * n * dk + j for j in value])  # q, k, v
    gate = [mixer.conv_dim + j for j in value]
    per_head = [mixer.conv_dim + n * dv + h for h in heads] + [mixer.conv_dim + n * dv + n + h for h in heads]
    cut = dict(block)
    cut["mixer.in_proj.weight"] = cut["mixer.in_proj.weight"][torch.cat([conv, torch.tensor(gate + per_head)])].clone()
    cut["mixer.conv1d.weight"] = cut["mixer.conv1d.weight"][conv].clone()
    for name in ("mixer.A_log", "mixer.dt_bias"):
        cut[name] = cut[name][list(heads)].clone()
    cut["mixer.out_proj.weight"] = cut["mixer.out_proj.weight"][:, value].clone()
    return cut


def cut_channels(block: dict, channels: tuple[int, ...]) -> dict:
    """A feed-forward's weights with only these hidden channels."""
    index = torch.tensor(channels)
    cut = dict(block)
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        if name in cut:
            cut[name] = cut[name][index].clone()
    cut["mlp.down_proj.weight"] = cut["mlp.down_proj.weight"][:, index].clone()
    return cut
