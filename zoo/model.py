"""The decoder LM: embedding -> pre-norm blocks (mixer + feed-forward) -> norm -> head."""
import dataclasses

import torch
from torch import nn

from cache import HandoffKV
from zoo.config import ModelConfig
from zoo.feedforward import ffn_bytes, make_ffn
from zoo.layers import make_norm, norm_bytes
from zoo.mixers import make_mixer, mixer_bytes
from zoo.resources import check_bytes
from kernels import Linear


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.mixer = make_mixer(config.layers[layer_idx], config, layer_idx)
        self.mlp = make_ffn(config.ffn(layer_idx), config, layer_idx)  # `mlp`: the name checkpoints hold its weights at
        self.mlp_norm = make_norm(config.norm, config.d_model, config.norm_eps) if self.mlp is not None else None

    def forward(self, x, positions=None, cache=None, batch=None):
        # a mixer or feed-forward may offer its whole half of the block (norm, itself, residual) as one call on an
        # eager CPU decode step (kernels/cpu_blocks.py); None where it cannot. A graph being compiled never asks (the
        # answer is None there, and tracing the checks would only add guards to every step)
        eager = not torch.compiler.is_compiling()
        children = self._modules  # as nn.Module.__getattr__ finds them, without its ~1 µs an attribute
        mixer, mixer_norm = children["mixer"], children["mixer_norm"]
        mlp, mlp_norm = children.get("mlp"), children.get("mlp_norm")  # none kept there: a block without a feed-forward
        mixer_half = getattr(mixer, "decode_residual", None) if eager else None
        y = mixer_half(mixer_norm, x, positions, cache, batch) if mixer_half else None
        x = x + mixer(mixer_norm(x), positions, cache, batch) if y is None else y
        if mlp is not None:
            ffn_half = getattr(mlp, "decode_residual", None) if eager else None
            y = ffn_half(mlp_norm, x) if ffn_half else None
            x = x + mlp(mlp_norm(x), batch) if y is None else y
        return x

    def decode_halves(self, x: torch.Tensor, cache, batch) -> list | None:
        """This block's halves of an eager CPU decode step, decided (its mixer's and feed-forward's decode_half:
        kernels/cpu_blocks.py's Half), for a plan that runs them (zoo/decode_plan.py); None where either has none."""
        children = self._modules
        mixer, mlp = children["mixer"], children.get("mlp")
        decide = getattr(mixer, "decode_half", None)
        halves = [decide(children["mixer_norm"], x, cache, batch) if decide else None]
        if mlp is not None:
            decide = getattr(mlp, "decode_half", None)
            halves.append(decide(children["mlp_norm"], x) if decide else None)
        return None if None in halves else halves


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig):
        """Priced before anything is allocated: a model larger than the memory free (or ZOO_MEMORY_LIMIT) on the device
        it is built on is refused (zoo/resources.py); a build on the meta device allocates nothing and is not."""
        check_model_bytes(config, torch.get_default_device())
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(init_weights)
        check_shared_caches(self.cache_specs())

    def first_layers(self, n_layers: int) -> "DecoderLM":
        """This model cut after its first n_layers blocks, sharing its weights (embedding, those blocks, final norm,
        head): a draft for self-speculative decoding (early exit, as LayerSkip, Elhoushi et al. 2024) that costs no
        weights of its own. It keeps its own caches: the layers it shares compute their keys twice."""
        if not isinstance(n_layers, int) or not 1 <= n_layers < self.config.n_layers:
            raise ValueError(f"n_layers must be an integer in [1, {self.config.n_layers - 1}] (fewer than the "
                             f"model's {self.config.n_layers}), got {n_layers!r}")
        ffns = None if self.config.ffns is None else self.config.ffns[:n_layers]
        config = dataclasses.replace(self.config, layers=self.config.layers[:n_layers], ffns=ffns,
                                     name=f"{self.config.name}[:{n_layers}]")
        with torch.device("meta"):  # every module is replaced by this model's own below
            draft = DecoderLM(config)
        draft.embed, draft.blocks, draft.norm, draft.head = self.embed, self.blocks[:n_layers], self.norm, self.head
        return draft.train(self.training)

    def cache_specs(self):
        """Each layer's cache declaration, in layer order."""
        return [block.mixer.cache_spec() for block in self.blocks]

    def handoff_caches(self) -> list:
        """For an uncached forward: a producer and the layers that share its keys get one hand-off; others None."""
        caches = [None] * len(self.blocks)
        for i, spec in enumerate(self.cache_specs()):
            if spec.kind == "shared":
                caches[i] = caches[spec.source] = caches[spec.source] or HandoffKV()
        return caches

    def forward(self, tokens: torch.Tensor, positions=None, caches=None, batch=None, last_only: bool = False):
        """tokens: [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with last_only).

        Without caches this is the full causal forward; the engine passes one cache per layer and a CacheBatch.
        """
        caches = self.caches_or_handoff(tokens, caches)
        x = self.embed(tokens)
        # an engine's eager CPU decode step may run every block, the final norm and the head in one call, decided
        # once (zoo/decode_plan.py)
        plans = None if batch is None or torch.compiler.is_compiling() else batch.decode_plans
        plan = plans.plan(self, x, caches, batch) if plans is not None else None
        if plan is not None:  # one token a row: last_only changes nothing
            x = plan.run(x, positions, batch)
            if plan.ends_at == "head":
                return x
            return self.head(x if plan.ends_at == "norm" else self.norm(x))
        x = self.final_hidden(x, positions, caches, batch)
        if last_only:  # each row's last real token (a padded batch's rows end at their lengths)
            x = x.gather(1, batch.last_tokens()[:, None, None].expand(-1, 1, x.shape[-1])) if batch and batch.padded \
                else x[:, -1:]
        return self.head(x)

    def hidden_states(self, tokens: torch.Tensor, positions=None, caches=None, batch=None) -> torch.Tensor:
        """The final-norm hidden states [B, T, d_model]: the forward without the head (a trainer that needs
        logits at a few positions applies the head only there)."""
        return self.final_hidden(self.embed(tokens), positions, self.caches_or_handoff(tokens, caches), batch)

    def caches_or_handoff(self, tokens: torch.Tensor, caches: list | None) -> list:
        """The engine's caches, or for an uncached forward (its tokens checked first) the hand-offs of shared keys."""
        if caches is not None:
            return caches
        check_tokens(tokens, self.config)
        return self.handoff_caches()

    def final_hidden(self, x: torch.Tensor, positions, caches: list, batch) -> torch.Tensor:
        """The embedded tokens x through every block and the final norm."""
        for i, block in enumerate(self.blocks):
            x = block(x, positions, caches[i], batch)
        return self.norm(x)


def model_bytes(config: ModelConfig, dtype: torch.dtype | None = None) -> int:
    """Bytes of every parameter and buffer DecoderLM(config) holds (a tied head counted once), from the config
    alone; dtype: the floating dtype its parameters take (default: torch's default dtype, which a build uses)."""
    dtype = dtype or torch.get_default_dtype()
    tables = (1 if config.tie_embeddings else 2) * config.vocab_size * config.d_model  # the embedding; a head untied
    return (tables * dtype.itemsize + norm_bytes(config.norm, config.d_model, dtype)
            + sum(block_bytes(config, i, dtype) for i in range(config.n_layers)))


def block_bytes(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> int:
    """Bytes of Block(config, layer_idx): its mixer, its feed-forward, and a norm before each."""
    ffn = ffn_bytes(config.ffn(layer_idx), config, layer_idx, dtype)
    norms = 1 if config.ffn(layer_idx).kind == "none" else 2
    return (norms * norm_bytes(config.norm, config.d_model, dtype)
            + mixer_bytes(config.layers[layer_idx], config, layer_idx, dtype) + ffn)


def check_model_bytes(config: ModelConfig, device: torch.device) -> None:
    """Refuse a model whose parameters and buffers would not fit in the memory free on `device` (meta: no memory)."""
    if device.type == "meta":
        return
    what = (f"the model's parameters and buffers (vocab_size={config.vocab_size:,}, d_model={config.d_model:,}, "
            f"mlp_hidden={config.mlp_hidden:,}, n_layers={config.n_layers:,}, {torch.get_default_dtype()})")
    lower = "vocab_size, d_model, mlp_hidden, the layer count, the mixers' widths or the FFNs' (experts)"
    check_bytes(what, model_bytes(config), device, lower)


def check_shared_caches(specs) -> None:
    """A layer may share only a full KV cache (one that keeps every position) of an earlier layer with its own head
    layout."""
    for i, spec in enumerate(specs):
        if spec.kind != "shared":
            continue
        source = specs[spec.source]
        if source.kind != "kv" or not source.retention.keeps_all:
            raise ValueError(f"layer {i} shares the cache of layer {spec.source}, which is not a full KV cache ({source})")
        if (source.kv_heads, source.head_dim) != (spec.kv_heads, spec.head_dim):
            raise ValueError(f"layer {i} reads {spec.kv_heads} KV heads of dim {spec.head_dim} from layer {spec.source}, "
                             f"which caches {source.kv_heads} of dim {source.head_dim}")


def check_tokens(tokens: torch.Tensor, config: ModelConfig) -> None:
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}")
    if tokens.shape[1] > config.max_seq_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len={config.max_seq_len}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= config.vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {config.vocab_size}), got min {int(tokens.min())}, max {int(tokens.max())}"
        )


def init_weights(module: nn.Module) -> None:
    """Normal(0.02) weights and zero biases, except parameters a mixer initialised itself and marked
    `_no_reinit` (mamba-ssm's marker: Mamba's dt projection)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        if not getattr(module.weight, "_no_reinit", False):
            nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
