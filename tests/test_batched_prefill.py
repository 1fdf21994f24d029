"""Batched prefill: the prompts a step admits are prefilled in one right-padded forward per group of similar
lengths (padding under a quarter of the group's tokens); a chunk continuing from a cache runs alone. Correctness for
every architecture is the conformance suite's "batch of mixed lengths equals each alone"; here, the grouping and
that a padded row leaves nothing of its padding behind."""
import pytest
import torch

from harness import Engine
from harness.engine.model_runner import BATCH_TOKENS, PADDING_WASTE, prefill_batches
from harness.engine.sequence import Sequence
from helpers import greedy, make_prompts, random_model


def seq(request_id: int, cached: int = 0) -> Sequence:
    s = Sequence(request_id, [0] * 64, greedy(1), None)
    s.num_cached = cached
    return s


def test_fresh_prompts_group_by_length_and_continuing_chunks_run_alone():
    chunks = [(seq(0, cached=16), 8), (seq(1), 40), (seq(2), 3), (seq(3), 36), (seq(4), 11), (seq(5), 1),
              (seq(6, cached=4), 5), (seq(7), 10)]
    batches = prefill_batches(chunks)
    assert [[s.request_id for s, _ in b] for b in batches] == [[0], [6], [1, 3], [4, 7], [2], [5]]
    for batch in batches:
        tokens = [n for _, n in batch]
        assert max(tokens) * len(tokens) <= (1 + PADDING_WASTE) * sum(tokens)
    # long prompts: no more rows than fill BATCH_TOKENS
    long = prefill_batches([(seq(i), 300) for i in range(3)] + [(seq(3), 600), (seq(4), 100), (seq(5), 100)])
    assert [[s.request_id for s, _ in b] for b in long] == [[3], [0], [1], [2], [4, 5]]
    assert BATCH_TOKENS == 512


@pytest.mark.parametrize("arch", ["gqa", "swa", "mamba", "mamba2", "gdn", "linear", "mla"])
@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_one_forward_prefills_a_padded_batch_and_keeps_no_padding(arch, kv_cache, monkeypatch):
    model = random_model(arch, seed=3)
    engine = Engine(model, max_batch=3, max_seq_len=48, kv_cache=kv_cache, block_size=8)
    prompts = make_prompts([24, 15, 22], model.config.vocab_size, seed=4)  # 15 + 1 fits 2 blocks, 24 takes 3
    calls = []
    real = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda chunks: calls.append(len(chunks)) or real(chunks))
    for prompt in prompts:
        engine.add_request(prompt, greedy(6))
    engine.step()
    assert calls == [3]
    if kv_cache == "paged":  # no block was taken for a padded position
        for manager in engine.block_managers:
            assert [len(manager.tables[s.request_id]) for s in engine.scheduler.running] == [
                manager.blocks_for(len(p) + 1) for p in prompts] or not manager.retention.keeps_all
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    for out, prompt in zip(sorted(finished, key=lambda o: o.request_id), prompts):
        alone = Engine(model, max_batch=1, max_seq_len=48, kv_cache=kv_cache, block_size=8).generate([prompt], greedy(6))[0]
        assert out.token_ids == alone.token_ids
        assert (torch.stack(out.logits) - torch.stack(alone.logits)).abs().max() < 2e-4
