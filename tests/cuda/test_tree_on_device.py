"""Token trees on the device, in fp32: every node's logits are the full forward's over its own path (the tree mask
through SDPA, the moved rows through the device's index copies), and greedy tree and lookahead decoding give the
CPU engine's tokens, for a full-attention, a latent, a windowed and a fallback (state) target, both layouts."""
import pytest
import torch

from harness import Engine, SpeculativeConfig
from harness.engine.speculative.config import LOOKAHEAD
from harness.engine.speculative.tree import TokenTree
from helpers import greedy, make_prompts, random_model

ARCHS = ["gqa", "mla", "swa", "mamba2"]
LAYOUTS = ["contiguous", "paged"]
ATOL = 1e-3  # the device's kernels sum in other orders than the full forward


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS[:3])
def test_each_node_sees_its_own_path_on_the_device(device, arch, kv_cache):
    model = random_model(arch).to(device)
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=4,
                    speculative=SpeculativeConfig(LOOKAHEAD, num_speculative_tokens=12))
    engine.add_request(make_prompts([9], model.config.vocab_size, seed=4)[0], greedy(30))
    engine.step()
    (seq,) = engine.scheduler.running
    tree = TokenTree(tokens=[seq.all_ids[-1], 7, 7, 30, 41, 5, 99, 12], parents=[-1, 0, 0, 1, 1, 2, 4, 6])
    start = seq.num_cached
    logits = engine.runner.feed_tree([seq], [tree])[0]
    with torch.no_grad():
        for node in range(len(tree)):
            path = seq.all_ids + [tree.tokens[n] for n in tree.path(node)]
            want = model(torch.tensor([path], device=device))[0, -1]
            assert (logits[node] - want).abs().max().item() <= ATOL, f"{arch}/{kv_cache} node {node}"
    engine.runner.move_path([seq], [start], [[1, 4, 6, 7]])
    engine.runner.rollback([seq], [start + 5])
    with torch.inference_mode():
        got = engine.runner.feed([seq], [[3]])[0, -1]
    with torch.no_grad():
        want = model(torch.tensor([seq.all_ids + [7, 41, 99, 12, 3]], device=device))[0, -1]
    assert (got - want).abs().max().item() <= ATOL


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_and_lookahead_decoding_on_the_device_give_the_cpu_tokens(device, arch, kv_cache):
    model = random_model(arch, seed=1)
    drafts = (random_model("gqa", seed=50, n_layers=1), random_model(arch, seed=1))
    prompts = make_prompts([3, 17, 8], model.config.vocab_size, seed=3)
    settings = [dict(draft=drafts, num_speculative_tokens=3, branches=2),
                dict(draft=LOOKAHEAD, num_speculative_tokens=3, branches=3)]

    def run(where):
        out = []
        for spec in settings:
            target = model.to(where)
            config = SpeculativeConfig(**{**spec, "draft": tuple(d.to(where) for d in spec["draft"])
                                          if isinstance(spec["draft"], tuple) else spec["draft"]},
                                       chain_fallback=True)
            engine = Engine(target, max_batch=3, max_seq_len=64, kv_cache=kv_cache, block_size=4,
                            speculative=config)
            out.append([o.token_ids for o in engine.generate(prompts, greedy(12))])
        return out

    want = run(torch.device("cpu"))
    assert run(device) == want
