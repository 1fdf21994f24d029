"""What a byte-level model is trained and scored on, in one place for the trainer and `zoo compare --weights`.

An autoregressive model: next-byte cross-entropy over a window of context + 1 bytes (context predictions). Its
validation figure is bits per byte: the mean cross-entropy in nats / ln 2 (one token per byte).

A masked diffusion LM (`zoo.build("diffusion")`): LLaDA's objective (harness.diffusion.masked_diffusion_loss) on
the window's first context bytes. Its validation figure is the ELBO bound: that loss per token, averaged over
DIFFUSION_DRAWS fixed-seed masking draws, in bits per byte: an upper bound on its bits per byte, labelled so.
"""
import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F

from harness.diffusion import masked_diffusion_loss

LN2 = math.log(2)
DIFFUSION_DRAWS = 4  # masking draws the ELBO bound averages over, draw i seeded by i
BPB, ELBO_BOUND = "bits per byte", "ELBO bound on bits per byte"  # what a validation figure is


def metric(model) -> str:
    """Which figure validation_bpb gives for this model."""
    return BPB if model.config.causal else ELBO_BOUND


def autocast(device: str, enabled: bool):
    """bf16 autocast on the device's type when enabled; nothing otherwise."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def masking_generator(seed: int, step: int, device: str) -> torch.Generator:
    """A diffusion LM's masking draws at training step `step`: seeded from (seed, step) alone, like the batch, on a
    stream of its own (the third entropy word) so they do not repeat the batch's draws."""
    state = int(np.random.SeedSequence([seed, step, 1]).generate_state(1, np.uint64)[0])
    return torch.Generator(device).manual_seed(state)


def loss(model, windows: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The training loss in nats per token of windows [B, context + 1]: next-byte cross-entropy, or the masked
    diffusion loss on the first context bytes (which needs `generator` for its masking draws)."""
    if not model.config.causal:
        return masked_diffusion_loss(model, windows[:, :-1], generator=generator)
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


def distillation_loss(student, teacher, windows: torch.Tensor, temperature: float,
                      weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-byte cross-entropy, the loss to train on) for windows [B, context + 1]: (1 - weight) x cross-entropy
    + weight x T^2 x KL(teacher || student), both distributions softened by T (Hinton et al. 2015; the T^2 keeps the
    soft term's gradients on the hard term's scale as T grows). The teacher runs without gradients."""
    inputs, targets = windows[:, :-1], windows[:, 1:].flatten()
    logits = student(inputs).float().flatten(0, 1)
    with torch.no_grad():
        teacher_logits = teacher(inputs).float().flatten(0, 1)
    cross_entropy = F.cross_entropy(logits, targets)
    kl = F.kl_div(F.log_softmax(logits / temperature, dim=-1), F.log_softmax(teacher_logits / temperature, dim=-1),
                  log_target=True, reduction="batchmean")
    return cross_entropy, (1 - weight) * cross_entropy + weight * temperature**2 * kl


@torch.no_grad()
def validation_bpb(model, windows: torch.Tensor, batch_size: int) -> float:
    """The model's validation figure (see `metric`) on windows [N, context + 1], in bits per byte, in the model's
    own dtype (no autocast: the figure does not depend on how the model was trained); every window counts equally
    (each holds context predicted bytes)."""
    was_training = model.training
    model.eval()
    device = str(next(model.parameters()).device)
    draws = [None] if model.config.causal else [torch.Generator(device).manual_seed(i) for i in range(DIFFUSION_DRAWS)]
    total = 0.0
    for generator in draws:
        for chunk in windows.split(batch_size):
            total += float(loss(model, chunk.to(device), generator)) * len(chunk)
    model.train(was_training)
    return total / (len(draws) * len(windows)) / LN2
