"""Token trees through the engine: greedy output is the target's alone, token for token, for every causal
architecture in both layouts (a tree where every layer attends over all earlier keys, the first chain with its reason
recorded elsewhere); the accepted branch is the one the target agrees with, whichever it is; bad settings are refused
before any work. Lookahead decoding (the target's own Jacobi window and n-gram pool) keeps greedy output too, and
on text that repeats it accepts nearly its whole window every step."""
import pytest
import torch

from harness import Engine, SpeculativeConfig
from harness.engine.speculative import PROMPT_LOOKUP
from harness.engine.speculative.config import LOOKAHEAD
from harness.engine.speculative.tree import tree_blocker
from helpers import greedy, make_prompts, random_model
from test_conformance import ARCHS, LAYOUTS

NEW_TOKENS = 12


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tree_output_is_the_target_alone(arch, kv_cache):
    """Two drafts, two branches each: a random one and the target itself, so the accepted path is rarely the first
    branch's."""
    target = random_model(arch, seed=ARCHS.index(arch))
    drafts = (random_model("gqa", seed=50, n_layers=1), random_model(arch, seed=ARCHS.index(arch)))
    prompts = make_prompts([3, 17, 8], target.config.vocab_size, seed=3)
    want = Engine(target, max_batch=3, max_seq_len=64, kv_cache=kv_cache, block_size=4).generate(
        prompts, greedy(NEW_TOKENS))
    engine = Engine(target, max_batch=3, max_seq_len=64, kv_cache=kv_cache, block_size=4,
                    speculative=SpeculativeConfig(drafts, num_speculative_tokens=3, branches=2, chain_fallback=True))
    got = engine.generate(prompts, greedy(NEW_TOKENS))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = engine.speculative_stats
    assert stats.tree_fallback == tree_blocker(target)
    if not stats.tree_fallback:  # a tree of 4 chains, the target's own among them: whole chains accepted
        assert stats.proposed > 3 * stats.sequence_steps and stats.tokens_per_forward > 3


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ["gqa", "mla", "cla"])
def test_the_branch_the_target_agrees_with_is_accepted_whole(arch, kv_cache):
    """A random draft's chain first, the target's own second: every step accepts the second branch whole (k + 1
    tokens a forward), so its rows move down past the first branch's, and the output is still the target's."""
    target = random_model(arch, seed=1)
    drafts = (random_model("gqa", seed=5), random_model(arch, seed=1))
    prompts = make_prompts([5, 9], target.config.vocab_size, seed=2)
    want = Engine(target, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=4).generate(prompts, greedy(13))
    engine = Engine(target, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=4,
                    speculative=SpeculativeConfig(drafts, num_speculative_tokens=3))
    got = engine.generate(prompts, greedy(13))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = engine.speculative_stats
    assert stats.tokens_per_forward == 4.0 and stats.accepted == 3 * stats.sequence_steps


@pytest.mark.parametrize("settings, message", [
    (dict(draft=PROMPT_LOOKUP, branches=0), r"branches .* must be in \[1, 64\], got 0"),
    (dict(draft=()), "draft is an empty tuple"),
    (dict(draft=PROMPT_LOOKUP, num_speculative_tokens=100, branches=3), r"must be in \[1, 2\], got 3"),
])
def test_bad_tree_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**settings)


def test_a_tree_the_target_cannot_verify_is_refused_without_the_fallback():
    target = random_model("mamba2")
    with pytest.raises(ValueError, match=r"3 chains make a token tree, which this target cannot verify in one forward: "
                                         r"layer 0 \(mamba2\) carries a recurrent state.*chain_fallback=True"):
        Engine(target, max_batch=2, max_seq_len=64,
               speculative=SpeculativeConfig(PROMPT_LOOKUP, num_speculative_tokens=2, branches=3))


def test_a_draft_with_another_vocabulary_is_refused_whichever_it_is():
    target = random_model("gqa")
    other = random_model("gqa", vocab_size=300)
    with pytest.raises(ValueError, match=r"the draft's vocabulary \(300 ids\) differs from the target's \(512\)"):
        Engine(target, max_batch=2, max_seq_len=64, speculative=SpeculativeConfig((random_model("gqa"), other)))


def test_tree_verification_is_one_target_forward_a_step():
    target = random_model("gqa")
    engine = Engine(target, max_batch=1, max_seq_len=64,
                    speculative=SpeculativeConfig((random_model("gqa", seed=3), random_model("gqa", seed=4)),
                                                  num_speculative_tokens=2, branches=2))
    calls = []
    forward = target.forward
    target.forward = lambda *a, **k: calls.append(a[0].shape) or forward(*a, **k)
    engine.generate([[1, 2, 3]], greedy(6))
    prefill, *steps = calls
    assert prefill == torch.Size([1, 3]) and len(steps) == engine.speculative_stats.steps
    assert steps[0] == torch.Size([1, 9])  # a root and 2 drafts x 2 branches x 2 tokens, one forward


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ["gqa", "mla", "mamba2"])
@pytest.mark.parametrize("budget", [5, 12])
def test_a_budget_tree_from_the_draft_s_probabilities_keeps_greedy_output(arch, kv_cache, budget):
    """The target's own weights as the draft. Its likeliest first token is the target's greedy one and outscores
    every deeper node, so any budget keeps it (at least 2 tokens a forward); a budget of every candidate (3 depths
    of 2 x 2) keeps the whole greedy path (4 a forward). A state-mixer target falls back to the draft's chain."""
    target = random_model(arch, seed=2)
    prompts = make_prompts([4, 11], target.config.vocab_size, seed=5)
    want = Engine(target, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=4).generate(prompts, greedy(13))
    draft = random_model("gqa" if arch == "mamba2" else arch, seed=2)
    engine = Engine(target, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=4,
                    speculative=SpeculativeConfig(draft, num_speculative_tokens=3, branches=2, tree_budget=budget,
                                                  chain_fallback=True))
    got = engine.generate(prompts, greedy(13))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = engine.speculative_stats
    if arch == "mamba2":
        assert "recurrent state" in stats.tree_fallback
        return
    assert stats.proposed <= budget * stats.sequence_steps
    assert stats.tokens_per_forward == 4.0 if budget == 12 else stats.tokens_per_forward >= 2.0


@pytest.mark.parametrize("settings, message", [
    (dict(tree_budget=0), r"tree_budget \(proposed tokens a step\) must be in \[1, 256\], got 0"),
    (dict(draft=PROMPT_LOOKUP, tree_budget=4), "grows a tree from one draft model's probabilities, not from "
                                               "'prompt_lookup'"),
    (dict(num_speculative_tokens=8, branches=6, tree_budget=4), "are 288 draft tokens a step, more than 256"),
])
def test_bad_budget_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**{"draft": random_model("gqa"), **settings})


def test_a_budget_tree_needs_a_draft_that_scores_trees():
    with pytest.raises(ValueError, match=r"tree_budget: the draft scores each depth's tree in one forward, which it "
                                         r"cannot: layer 0 \(mamba\) carries a recurrent state"):
        Engine(random_model("gqa"), max_batch=1, max_seq_len=64,
               speculative=SpeculativeConfig(random_model("mamba"), tree_budget=4))


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_lookahead_output_is_the_target_alone(arch, kv_cache):
    """Lookahead decoding: the Jacobi window and three pool continuations, a tree where the target verifies one."""
    target = random_model(arch, seed=ARCHS.index(arch))
    prompts = make_prompts([3, 17, 8], target.config.vocab_size, seed=3)
    want = Engine(target, max_batch=3, max_seq_len=64, kv_cache=kv_cache, block_size=4).generate(
        prompts, greedy(NEW_TOKENS))
    engine = Engine(target, max_batch=3, max_seq_len=64, kv_cache=kv_cache, block_size=4,
                    speculative=SpeculativeConfig(LOOKAHEAD, num_speculative_tokens=3, branches=4,
                                                  chain_fallback=True))
    got = engine.generate(prompts, greedy(NEW_TOKENS))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.speculative_stats.tree_fallback == tree_blocker(target)


def cycling_model(arch: str, period: int = 7):
    """A model whose greedy text cycles through `period` tokens: its blocks write nothing (zero output projections),
    each token embeds as its own unit vector, and the head scores most the token after it in the cycle."""
    model = random_model(arch, vocab_size=32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                param.zero_()
        model.embed.weight.copy_(torch.eye(32, model.config.d_model))
        model.head.weight.zero_()
        for token in range(32):
            successor = (token + 1) % period if token < period else 0
            model.head.weight[successor, token] += 10.0
    return model


@pytest.mark.parametrize("branches", [1, 3])
def test_lookahead_converges_on_text_that_repeats(branches):
    """On a cycle of 7 tokens the pool holds every token's true continuation within the first pass, after which
    each step accepts its k = 4: over 60 tokens, more than 3 a forward (1 without speculation, at most 5)."""
    target = cycling_model("gqa")
    want = Engine(target, max_batch=1, max_seq_len=96).generate([[3]], greedy(60))
    engine = Engine(target, max_batch=1, max_seq_len=96,
                    speculative=SpeculativeConfig(LOOKAHEAD, num_speculative_tokens=4, branches=branches))
    got = engine.generate([[3]], greedy(60))
    assert got[0].token_ids == want[0].token_ids == [(4 + i) % 7 for i in range(60)]
    assert engine.speculative_stats.tokens_per_forward > 3.0
