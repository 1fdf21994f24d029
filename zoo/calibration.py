"""Calibration passes: a model run over token windows in eval mode, no gradients, with forward hooks that record
what they need (importance scores, layer-input statistics); the hooks come off and the mode is restored after,
whatever happens."""
import torch


@torch.no_grad()
def run_with_hooks(model, windows: torch.Tensor, batch_size: int, handles: list) -> None:
    """windows [N, T] token ids through model, batch_size at a time; then each hook handle removed."""
    was_training = model.training
    model.eval()
    try:
        for batch in windows.split(batch_size):
            model(batch.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
