"""A decode step at a chosen batch and context without running the prefill: an engine whose caches are filled with
random values as if `batch` prompts of `context` tokens had been prefilled, and the step timed with the context
held fixed. A step's cost depends on how many cached values there are, not on what they are."""
import statistics
import time
from dataclasses import dataclass

import torch

from harness.engine import Engine
from harness.metrics import sync
from harness.engine.sampling import SamplingParams
from harness.engine.sequence import Sequence

HEADROOM = 16  # max_seq_len beyond the context: room for the decoded token (and a few more, as an engine would have)


@dataclass
class DecodeProbe:
    engine: Engine
    seqs: list[Sequence]
    context: int

    def step(self) -> float:
        """One decode step over every sequence from `context` cached tokens; seconds (device synchronised)."""
        for seq in self.seqs:
            seq.num_cached = self.context  # the step advances it: put it back so every step reads the same context
        sync(self.engine.device)
        start = time.perf_counter()
        self.engine.runner.decode(self.seqs)
        sync(self.engine.device)
        return time.perf_counter() - start

    def median_step(self, steps: int = 7, warmup: int = 1) -> float:
        """Median seconds of `steps` steps after `warmup` untimed ones (the first compiles a compiled engine)."""
        for _ in range(warmup):
            self.step()
        return statistics.median(self.step() for _ in range(steps))


def fill_random(layers: list, seed: int = 0) -> None:
    """Random normal values in every cache tensor; a layer object shared by several layers is filled once.

    One random slice along the first dim (a slot or a block) is copied into every other one: drawing GBs of
    normals takes seconds per cell, and the step's cost does not depend on the values."""
    generators = {}
    for layer in {id(layer): layer for layer in layers if layer is not None}.values():
        if hasattr(layer, "tensors"):  # state slots: one tensor per state name
            tensors = list(layer.tensors.values())
        elif hasattr(layer, "k"):  # KV layouts: keys, and values unless a latent row doubles as them
            tensors = [t for t in (layer.k, layer.v) if t is not None]
        else:
            raise TypeError(f"cannot fill a cache of type {type(layer).__name__}: expected .tensors or .k/.v")
        for t in tensors:
            if t.device not in generators:  # a generator draws on its own device's tensors only
                generators[t.device] = torch.Generator(t.device).manual_seed(seed)
            row = torch.randn(t.shape[1:], generator=generators[t.device], device=t.device)
            t.copy_(row.to(t.dtype).expand_as(t))
        if hasattr(layer, "positions"):  # a scored cache: rows held at distinct positions, so its evictions run
            layer.positions.copy_(torch.arange(layer.positions.numel()).view_as(layer.positions))
            layer.scores.uniform_(generator=generators[layer.scores.device])


def decode_probe(model, batch: int, context: int, kv_cache: str = "contiguous", block_size: int = 16,
                 compile: bool = False, seed: int = 0, cuda_graphs: "bool | str | None" = None) -> DecodeProbe:
    """`batch` sequences admitted with `context`-token prompts, caches filled at random, one output token each.
    cuda_graphs: the Engine's (None: captured on CUDA, where the first step captures the batch's graph)."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got batch={batch}, context={context}")
    engine = Engine(model, max_batch=batch, max_seq_len=context + HEADROOM, kv_cache=kv_cache, block_size=block_size,
                    compile=compile, cuda_graphs=cuda_graphs)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=HEADROOM, temperature=0.0))
    seqs = engine.admit_prefilled()
    if len(seqs) != batch:
        raise ValueError(f"the engine admitted {len(seqs)} of {batch} sequences of {context} tokens")
    with torch.no_grad():
        fill_random(engine.pool.layers, seed)
    return DecodeProbe(engine, seqs, context)
