"""LLaDA's linear transfer schedule: how many masked tokens each step of a block unmasks."""
import torch


def transfer_counts(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """masked: [B] masked tokens in each row's block -> [B, steps] tokens to unmask per step.

    Each step gets floor(m / steps); the remainder goes one each to the first steps, so every row's counts sum to m.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    masked = masked.long()
    base, remainder = masked // steps, masked % steps
    return base[:, None] + (torch.arange(steps, device=masked.device) < remainder[:, None]).long()
