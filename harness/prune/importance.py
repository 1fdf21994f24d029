"""How much each part of a model matters, measured on calibration text with forward hooks (no gradients):

- a layer: its block influence, 1 - the mean cosine similarity of the residual stream before and after the block,
  over every token (ShortGPT, Men et al. 2024): a block that barely turns the stream can go;
- a KV head of an attention layer: the summed importance of the query heads that read it, a query head's being the
  mean L2 norm of its attention output, the slice of o_proj's input it owns (Minitron, Muralidharan et al. 2024);
- a Gated DeltaNet head (and its state): the mean L2 norm of its gated, normed output, its slice of out_proj's
  input, as a query head's;
- a feed-forward hidden channel: the mean absolute value of its activation, down_proj's input (Minitron);
- an embedding channel (of the residual stream): the mean absolute value of its normalized activation, summed over
  every norm that reads the stream (each block's two and the final one), Minitron's embedding score.

Each score is a mean over every calibration token, so the windows' count and length only sharpen it.
"""
from dataclasses import asdict, dataclass

import torch

from zoo.calibration import run_with_hooks
from zoo.pruning import WIDTH_FFNS, head_cut_layers, state_cut_layers


@dataclass
class Importance:
    layers: list[float]  # block influence of each layer
    kv_heads: dict[int, list[float]]  # attention layer index -> each KV head's
    channels: dict[int, list[float]]  # FFN layer index -> each hidden channel's
    embedding: list[float] | None = None  # each residual channel's (None: read from a file written before it was)
    state_heads: dict[int, list[float]] | None = None  # Gated DeltaNet layer -> each head's (None: likewise)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Importance":
        state = data.get("state_heads")
        return cls(list(data["layers"]), {int(k): list(v) for k, v in data["kv_heads"].items()},
                   {int(k): list(v) for k, v in data["channels"].items()}, data.get("embedding"),
                   None if state is None else {int(k): list(v) for k, v in state.items()})


def cut_layers(model) -> tuple[list[int], list[int]]:
    """(attention layers whose KV groups can be cut, FFN layers whose channels can be cut)."""
    config = model.config
    return head_cut_layers(config), [i for i in range(config.n_layers) if config.ffn(i).kind in WIDTH_FFNS]


@torch.no_grad()
def measure_importance(model, windows: torch.Tensor, batch_size: int = 16) -> Importance:
    """windows [N, T] token ids: each part's importance over all N * T tokens."""
    heads, ffns = cut_layers(model)
    states = state_cut_layers(model.config)
    influence = torch.zeros(model.config.n_layers, dtype=torch.float64)
    head_norms = {i: torch.zeros(model.blocks[i].mixer.n_heads, dtype=torch.float64) for i in heads + states}
    activations = {i: torch.zeros(model.blocks[i].mlp.down_proj.weight.shape[1], dtype=torch.float64) for i in ffns}
    residual = torch.zeros(model.config.d_model, dtype=torch.float64)

    def block_hook(i):
        def hook(module, args, output):
            cosine = torch.nn.functional.cosine_similarity(args[0].double(), output.double(), dim=-1)
            influence[i] += (1 - cosine).sum()
        return hook

    def head_hook(i):
        def hook(module, args):
            x = args[0]  # [B, T, H * D]: the heads' outputs side by side
            head_norms[i] += x.double().unflatten(-1, (len(head_norms[i]), -1)).norm(dim=-1).sum(dim=(0, 1))
        return hook

    def channel_hook(i):
        def hook(module, args):
            activations[i] += args[0].double().abs().sum(dim=(0, 1))
        return hook

    def norm_hook(module, args, output):
        residual.add_(output.double().abs().sum(dim=(0, 1)))

    norms = [model.norm, *(n for block in model.blocks for n in (block.mixer_norm, block.mlp_norm) if n is not None)]
    handles = [block.register_forward_hook(block_hook(i)) for i, block in enumerate(model.blocks)]
    handles += [norm.register_forward_hook(norm_hook) for norm in norms]
    handles += [model.blocks[i].mixer.o_proj.register_forward_pre_hook(head_hook(i)) for i in heads]
    handles += [model.blocks[i].mixer.out_proj.register_forward_pre_hook(head_hook(i)) for i in states]
    handles += [model.blocks[i].mlp.down_proj.register_forward_pre_hook(channel_hook(i)) for i in ffns]
    run_with_hooks(model, windows, batch_size, handles)
    tokens = windows.numel()
    kv_heads = {}
    for i in heads:
        mixer = model.blocks[i].mixer
        kv_heads[i] = (head_norms[i] / tokens).view(mixer.n_kv_heads, -1).sum(dim=1).tolist()  # by KV head
    channels = {i: (a / tokens).tolist() for i, a in activations.items()}
    return Importance((influence / tokens).tolist(), kv_heads, channels, (residual / tokens).tolist(),
                      {i: (head_norms[i] / tokens).tolist() for i in states})
