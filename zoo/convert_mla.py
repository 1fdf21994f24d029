"""An attention layer turned into multi-head latent attention (DeepSeek-V2's MLA), started from its weights:

- RoPE is kept on a uniform subset of each head's frequency pairs, those MLA's own rope head of `rope_dim` channels
  rotates at (every (head_dim / rope_dim)-th pair, MHA2MLA's uniform partial RoPE, Ji et al. 2025); the other
  channels become the unrotated "nope" part of queries and keys. The shared rope key is the mean of the KV heads'
  (one rope key for all heads, as in MLA). The nope part of the queries starts at zero: a trained model's heads
  attend nearly as well through their rotated half alone as through all of it, while the same channels unrotated
  would compare keys without their positions (on the `small` gqa teacher of BENCHMARKS.md, 3.31 against 3.26 bits
  per byte for the rotated half alone; 3.87 with the nope product kept at full rank, the norm set aside). The nope
  keys are kept in the latent, so training grows the queries that read them.
- The nope keys and the values of every KV head are factored jointly through one latent of `kv_rank` channels by a
  truncated SVD of their stacked projections, whitened by the layer's inputs on calibration text, so the rank kept
  is the one that best reproduces the keys and values on that text (SVD-LLM's truncation-aware whitening, Wang et
  al. 2024): kv_a_proj's latent rows are the down factor, kv_b_proj each query head's KV-head rows of the up factor.
- The latent's RMSNorm, which attention lacks, gets one gain for every channel: the latent's RMS over the
  calibration text (about the constant that best undoes the norm's per-token scaling), so a token at that RMS
  passes through exactly.

At full rank what remains different is the nope half of the queries, the pooled rope key and the norm's per-token
scale: distillation recovers the rest.
"""
import torch

from zoo.calibration import run_with_hooks

WHITENING_RIDGE = 1e-6  # of the Gram matrix's mean diagonal: keeps its Cholesky factor well conditioned


def check_mla_sizes(mixer, layer: int, kv_rank, rope_dim, d_model: int) -> None:
    """Refuse what MLA cannot start from, naming the value and what is allowed."""
    dim = mixer.head_dim
    extras = [what for what, present in (("biases", mixer.q_proj.bias is not None),
                                         (f"qk_norm {mixer.qk_norm!r}", mixer.qk_norm is not None),
                                         (mixer.retention.describe(), not mixer.retention.keeps_all)) if present]
    if extras:
        raise ValueError(f"layer {layer} has {', '.join(extras)}: MLA has none of these, so only plain full "
                         "attention converts to it")
    if not isinstance(rope_dim, int) or rope_dim < 2 or rope_dim % 2 or rope_dim >= dim or dim % rope_dim:
        raise ValueError(f"rope_dim must be an even divisor of layer {layer}'s head_dim {dim} below it (MLA rotates "
                         f"every (head_dim / rope_dim)-th frequency pair of the head's), got {rope_dim!r}")
    most = min(mixer.n_kv_heads * (2 * dim - rope_dim), d_model)
    if not isinstance(kv_rank, int) or not 1 <= kv_rank <= most:
        raise ValueError(f"kv_rank must be between 1 and {most} (layer {layer}'s stacked nope keys and values, or "
                         f"d_model, whichever is less), got {kv_rank!r}")


def default_rank(mixer, rope_dim: int) -> int:
    """The latent that, with the rope key, halves the layer's cache: n_kv_heads * head_dim - rope_dim channels."""
    return max(1, mixer.n_kv_heads * mixer.head_dim - rope_dim)


@torch.no_grad()
def input_grams(model, layers: list[int], calibration: torch.Tensor, batch_size: int = 16) -> dict[int, torch.Tensor]:
    """Each chosen layer's mixer inputs' mean outer product x x^T (float64, [d, d]) over the calibration windows."""
    d = model.config.d_model
    grams = {i: torch.zeros(d, d, dtype=torch.float64) for i in layers}

    def hook(i):
        def record(module, args):
            x = args[0].double().flatten(0, 1)
            grams[i] += x.T @ x
        return record

    handles = [model.blocks[i].mixer.register_forward_pre_hook(hook(i)) for i in layers]
    run_with_hooks(model, calibration, batch_size, handles)
    return {i: g / calibration.numel() for i, g in grams.items()}


def rope_channels(head_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the head channels MLA's rope part takes, in its rotate-half order; the rest, in order). MLA's rope pair m
    turns at frequency base^(-2m / rope_dim), which is the head's pair s * m, s = head_dim / rope_dim."""
    step, half = head_dim // rope_dim, head_dim // 2
    pairs = torch.arange(0, half, step)
    rope = torch.cat([pairs, pairs + half])
    kept = torch.ones(head_dim, dtype=torch.bool)
    kept[rope] = False
    return rope, kept.nonzero().flatten()


def whitened_factors(weight: torch.Tensor, gram: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [rows, rank], down [rank, d]) with up @ down the rank-`rank` map closest to weight [rows, d] on inputs
    whose mean outer product is gram: the SVD of weight @ S, S S^T = gram, truncated; down whitens (unit mean-square
    latent channels on those inputs)."""
    w = weight.double()
    ridge = WHITENING_RIDGE * gram.diagonal().mean() * torch.eye(len(gram), dtype=torch.float64)
    chol = torch.linalg.cholesky(gram + ridge)
    u, s, vh = torch.linalg.svd(w @ chol, full_matrices=False)
    down = torch.linalg.solve_triangular(chol.T, vh[:rank].T, upper=True).T  # vh_r S^-1
    return u[:, :rank] * s[:rank], down


def attention_as_mla(attention, mla, prefix: str, gram: torch.Tensor) -> dict:
    """The MLA layer's weights (state-dict entries under prefix) from the attention's and its inputs' Gram matrix."""
    heads, groups, dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    rope, nope = rope_channels(dim, mla.rope_dim)
    dtype = attention.q_proj.weight.dtype
    q = attention.q_proj.weight.view(heads, dim, -1)
    k = attention.k_proj.weight.view(groups, dim, -1)
    v = attention.v_proj.weight.view(groups, dim, -1)
    stacked = torch.cat([k[:, nope], v], dim=1)  # [groups, nope + dim, d]: what the latent must reproduce
    up, down = whitened_factors(stacked.flatten(0, 1), gram, mla.kv_lora_rank)
    latent_rms = (down @ gram @ down.T).diagonal().mean().sqrt()  # over every token and channel
    per_group = up.view(groups, -1, mla.kv_lora_rank)
    return {
        prefix + "q_proj.weight": torch.cat([torch.zeros_like(q[:, nope]), q[:, rope]], dim=1).flatten(0, 1),
        prefix + "kv_a_proj_with_mqa.weight": torch.cat([down.to(dtype), k[:, rope].mean(dim=0)]),
        prefix + "kv_a_layernorm.weight": torch.full((mla.kv_lora_rank,), latent_rms.item(), dtype=dtype),
        prefix + "kv_b_proj.weight": per_group.repeat_interleave(heads // groups, dim=0).flatten(0, 1).to(dtype),
        prefix + "o_proj.weight": attention.o_proj.weight.clone(),
    }
