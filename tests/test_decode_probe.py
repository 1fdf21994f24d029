"""harness.decode_probe: a decode step from a synthetic cache of a chosen context, without the prefill."""
import pytest
import torch

import zoo
from harness.decode_probe import HEADROOM, decode_probe, fill_random


def tiny(arch):
    torch.manual_seed(0)
    return zoo.build(arch, preset="tiny").eval()


@pytest.mark.parametrize("arch", ["gqa", "mla", "cla", "swa", "mamba", "linear"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_probe_fills_every_cache_and_times_a_step(arch, layout):
    probe = decode_probe(tiny(arch), batch=2, context=24, kv_cache=layout)
    engine = probe.engine
    assert len(probe.seqs) == 2 and engine.max_seq_len == 24 + HEADROOM
    for layer in {id(x): x for x in engine.pool.layers}.values():
        tensors = layer.tensors.values() if hasattr(layer, "tensors") else [t for t in (layer.k, layer.v) if t is not None]
        for t in tensors:
            assert t.float().std() > 0.5  # random normal, not the zeros the engine allocated
    seconds = probe.median_step(steps=3)
    assert seconds > 0
    assert all(s.num_cached == 25 for s in probe.seqs)  # each timed step started again from 24 cached tokens


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_every_step_reads_the_same_context(layout):
    """A KV model's step writes the same token at the same position each time: identical logits, which depend on
    the synthetic cache (another fill gives others)."""
    probe = decode_probe(tiny("gqa"), batch=2, context=30, kv_cache=layout, seed=1)

    def logits():
        for s in probe.seqs:
            s.num_cached = 30
        return probe.engine.runner.decode(probe.seqs)

    first = logits()
    assert torch.equal(first, logits())
    fill_random(probe.engine.pool.layers, seed=2)  # same tokens, other cached keys and values
    assert not torch.allclose(first, logits())


def test_bad_probe_arguments_are_named():
    with pytest.raises(ValueError, match="batch=0"):
        decode_probe(tiny("gqa"), batch=0, context=8)
    with pytest.raises(ValueError, match="unknown kv_cache 'ragged'"):
        decode_probe(tiny("gqa"), batch=1, context=8, kv_cache="ragged")
