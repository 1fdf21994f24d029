"""Tree verification in one target forward (ModelRunner.feed_tree): every node's logits are the full forward's over
the cached tokens and that node's own path, in each KV kind and retention and both layouts; after the accepted path's
rows move down (move_path) and the rest is rolled back, decoding continues as the full forward does."""
import pytest
import torch

from harness import Engine, SpeculativeConfig
from harness.engine.speculative import PROMPT_LOOKUP
from harness.engine.speculative.tree import TokenTree
from helpers import greedy, make_prompts, random_model

# every KV kind (kv, latent, shared) and every retention a tree is verified under (a window, sinks, chunks, dilation,
# and a window beside global attention), each in both layouts (a contiguous window is a ring buffer)
TREE_ARCHS = ["mha", "gqa", "mqa", "mla", "cla", "swa", "sink", "chunked", "dilated", "hybrid-chunked"]
ATOL = 1e-4


def started(model, kv_cache: str, kv_dtype: str = "auto"):
    """An engine with one request prefilled (its first token emitted), and that request."""
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=4, kv_dtype=kv_dtype,
                    speculative=SpeculativeConfig(PROMPT_LOOKUP, num_speculative_tokens=12))
    engine.add_request(make_prompts([9], model.config.vocab_size, seed=4)[0], greedy(30))
    engine.step()
    (seq,) = engine.scheduler.running
    return engine, seq


@torch.no_grad()
def full_last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]))[0, -1]


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_each_node_sees_the_cache_and_its_own_path(arch, kv_cache):
    model = random_model(arch)
    engine, seq = started(model, kv_cache)
    # two branches from the root, one forking again; a sibling pair holding the same token
    tree = TokenTree(tokens=[seq.all_ids[-1], 7, 7, 30, 41, 5, 99, 12],
                     parents=[-1, 0, 0, 1, 1, 2, 4, 6])
    start = seq.num_cached
    with torch.inference_mode():
        logits = engine.runner.feed_tree([seq], [tree])[0]
    for node in range(len(tree)):
        want = full_last_logits(model, seq.all_ids + [tree.tokens[n] for n in tree.path(node)])
        err = (logits[node] - want).abs().max().item()
        assert err <= ATOL, f"{arch}/{kv_cache} node {node}: logits differ from its path's by {err:.3g}"
    path = [1, 4, 6, 7]  # 7, 41, 99, 12: nodes that do not sit at their depth's row
    engine.runner.move_path([seq], [start], [path])
    engine.runner.rollback([seq], [start + 1 + len(path)])
    accepted = seq.all_ids + [tree.tokens[n] for n in path]
    with torch.inference_mode():
        got = engine.runner.feed([seq], [[3]])[0, -1]
    err = (got - full_last_logits(model, accepted + [3])).abs().max().item()
    assert err <= ATOL, f"{arch}/{kv_cache}: decoding after the moved path differs by {err:.3g}"


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_a_one_byte_cache_moves_its_rows_with_their_scales(kv_cache):
    """int8 rows and their per-row scales move together: each accepted node's stored row and scale land at its depth's
    position (the rows' values are the quantized ones, so this compares storage, not logits)."""
    model = random_model("gqa")
    engine, seq = started(model, kv_cache, kv_dtype="int8")
    tree = TokenTree(tokens=[seq.all_ids[-1], 7, 9, 30, 41], parents=[-1, 0, 0, 2, 3])
    start = seq.num_cached
    with torch.inference_mode():
        engine.runner.feed_tree([seq], [tree])
    layer = engine.pool.layers[0]

    def rows(positions):
        if kv_cache == "contiguous":
            index = (seq.slot, slice(None), torch.tensor(positions))
        else:
            manager = engine.block_managers[0]
            flat = torch.tensor([manager.slot(seq, p, start + len(tree)) for p in positions])
            index = (flat // manager.block_size, flat % manager.block_size)
        return [t[index].clone() for t in layer.stored() if t is not None]

    before = rows([start + 2, start + 3, start + 4])  # nodes 2, 3, 4: the path 9, 30, 41
    engine.runner.move_path([seq], [start], [[2, 3, 4]])
    after = rows([start + 1, start + 2, start + 3])
    assert len(before) == 4 and all(torch.equal(a, b) for a, b in zip(after, before))
