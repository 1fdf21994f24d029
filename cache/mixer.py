"""The mixer contract, written down: what every sequence mixer offers the model and the engine, and what the cache
views the engine hands it offer the mixer. `zoo` checks each mixer it builds against `Mixer`.

A mixer is an nn.Module constructed as cls(d_model=..., layer_idx=..., **its settings), whose settings are annotated
int / float / bool / str constructor parameters (the registry validates them by those annotations). Taking a
`causal: bool` parameter says it can also attend both ways (a masked diffusion LM's layers). A mixer may name, in a
class attribute `query_key_projections`, its linear layers whose outputs meet in a query-key product (zoo.quantize's
AWQ does not clip their weights). A mixer (or feed-forward) may offer `decode_half(norm, x, ...)`: its block's whole
half, x + self(norm(x), ...), decided as one call where it can (a kernels/cpu_blocks.py Half; attention/attention.py's,
on the CPU), else None, and `decode_residual(norm, x, ...)`, which runs it; the block then runs the norm and the
mixer itself where there is none (zoo/model.py's Block), and an engine's decode plan runs every block's halves in one
call (zoo/decode_plan.py).
"""
from typing import Protocol, runtime_checkable

import torch

from cache.spec import CacheBatch, CacheSpec


@runtime_checkable
class KVCacheView(Protocol):
    """A per-token cache (cache/layouts.py: ContiguousKV, PagedKV): keys/values in, attention out. Which keys each
    query sees is the layer's retention policy, applied by the view."""

    def write(self, k: torch.Tensor, v: torch.Tensor | None, batch: CacheBatch) -> None: ...

    def attend(self, q: torch.Tensor, batch: CacheBatch, scale: float, value_dim: int | None = None,
               causal: bool = True) -> torch.Tensor: ...


@runtime_checkable
class StateView(Protocol):
    """A fixed-size recurrent state per sequence (cache/state_slots.py): read at the start of a step (zeros on a
    prefill), written back at its end."""

    def read(self, batch: CacheBatch) -> dict[str, torch.Tensor]: ...

    def write(self, states: dict[str, torch.Tensor], batch: CacheBatch) -> None: ...

    def write_steps(self, states: dict[str, torch.Tensor], batch: CacheBatch) -> None:
        """A step with batch.checkpoints and several new tokens: the state after each of them, [B, T, *shape] per
        tensor, instead of write (the engine may keep any prefix of the step's tokens)."""
        ...


@runtime_checkable
class Mixer(Protocol):
    layer_idx: int

    def cache_spec(self) -> CacheSpec:
        """What the layer stores per token or per sequence, and which positions it keeps: the engine allocates
        from this declaration and zoo.cache_bytes sums it."""
        ...

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: "KVCacheView | StateView | None" = None, batch: CacheBatch | None = None) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]. Without a cache: the full causal (or bidirectional) forward from
        nothing. With one: batch.step says what this call is (cache/spec.py STEP_KINDS) and the mixer reads and
        writes its view accordingly; a state mixer on a several-token step with batch.checkpoints writes its state
        after every new token (StateView.write_steps), so the engine can roll back to any of them."""
        ...

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The oracle: the uncached forward as a naive float64 computation written for clarity, not speed (a plain
        quadratic form or a step-by-step recurrence). Conformance holds forward() against it."""
        ...
