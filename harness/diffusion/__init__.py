"""Masked diffusion LM (LLaDA): the sampler, Fast-dLLM's approximate caches, the transfer schedule, the objective."""
from harness.diffusion.objective import masked_diffusion_loss
from harness.diffusion.sampler import DiffusionOutput, DiffusionSampler
from harness.diffusion.schedule import transfer_counts

__all__ = ["DiffusionOutput", "DiffusionSampler", "masked_diffusion_loss", "transfer_counts"]
