"""The masked diffusion training objective (LLaDA): mask at a random rate, predict the masked tokens."""
import torch
import torch.nn.functional as F


def masked_diffusion_loss(model, tokens: torch.Tensor, eps: float = 1e-3, generator: torch.Generator | None = None,
                          loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """tokens: [B, T]; loss_mask: [B, T] bool, the positions that may be masked (default all; False = a prompt).

    Per example t ~ U(0, 1) and p = (1 - eps) t + eps; each eligible token becomes the mask token with probability p.
    Loss: cross-entropy on the masked tokens, each divided by its example's p (the ELBO weight), summed per example
    and divided by the example's eligible count, then averaged over the batch: sum / (B * T) without loss_mask,
    LLaDA's pretraining normalisation; per-example eligible counts with one, as LLaDA's SFT divides by answer length.
    """
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is None or model.config.causal:
        raise ValueError(f"model {model.config.name!r} is not a masked diffusion LM (it needs causal=False and a "
                         f"mask_token_id); build one with zoo.build('diffusion', ...)")
    if not 0.0 < eps <= 1.0:
        raise ValueError(f"eps must lie in (0, 1] (the smallest masking rate), got {eps}")
    b, t = tokens.shape
    eligible = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    device = tokens.device
    p = (1 - eps) * torch.rand(b, 1, generator=generator, device=device) + eps
    masked = (torch.rand(b, t, generator=generator, device=device) < p) & eligible
    hidden = model.hidden_states(torch.where(masked, mask_id, tokens))
    logits = model.head(hidden[masked])  # the vocabulary head only where a loss is taken (same values, less work)
    ce = F.cross_entropy(logits.float(), tokens[masked], reduction="none") / p.expand(b, t)[masked]
    per_example = torch.zeros(b, device=device).index_add(0, masked.nonzero()[:, 0], ce)
    return (per_example / eligible.sum(1).clamp_min(1)).mean()
