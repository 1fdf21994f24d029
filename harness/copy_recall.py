"""In-context recall on real text: a span of corpus bytes, then the same span again, and the bits per byte the model
spends on the second copy. Every byte there (after the copy's first) is written once already in the context, so a
model that looks back pays almost nothing, and one that cannot pays what it pays on fresh text: the copying gap
between attention and fixed-size states that Jelassi et al. 2024 ("Repeat After Me") measure, asked of a trained
language model without any task training (MQAR needs a model trained on its format; this needs none).
"""
import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def copy_bpb(model, spans: torch.Tensor, batch_size: int = 16) -> float:
    """spans [N, L] byte ids: the mean bits per byte of bytes 2..L of each span's second copy, after [span ; span]."""
    if spans.dim() != 2 or spans.shape[1] < 2:
        raise ValueError(f"spans must be [N, L] with L >= 2 (a copy has bytes after its first), got {list(spans.shape)}")
    length = spans.shape[1]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    try:
        for chunk in spans.split(batch_size):
            doubled = torch.cat([chunk, chunk], dim=1).to(device)
            logits = model(doubled[:, :-1])[:, length:].float()  # predictions of the copy's bytes 2..L
            total += F.cross_entropy(logits.flatten(0, 1), doubled[:, length + 1:].flatten(), reduction="sum").item()
    finally:
        model.train(was_training)
    return total / (len(spans) * (length - 1)) / math.log(2)
