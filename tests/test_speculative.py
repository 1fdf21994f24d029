"""Speculative decoding is exact: greedy speculative output equals the target alone, token for token (and logits
within tolerance), for every causal architecture as target and as draft, with prompt lookup, in both cache layouts,
and beside preemption, prefix caching and chunked prefill. The models are coupled (tests/helpers.py) so a draft
agrees on some tokens and not others: every cell rolls back to middle tokens, which the asserts check happened."""
import pytest
import torch

import zoo
from harness import PROMPT_LOOKUP, Engine, SamplingParams, SpeculativeConfig
from helpers import assert_same_output, coupled_model, greedy, make_prompts

ARCHS = [name for name in zoo.architectures() if zoo.is_causal(name)]
LAYOUTS = ("contiguous", "paged")
K = 4
MAX_SEQ_LEN = 64


def engine(model, kv_cache: str = "paged", **kwargs) -> Engine:
    kwargs.setdefault("max_batch", 4)
    kwargs.setdefault("max_seq_len", MAX_SEQ_LEN)
    if kv_cache == "paged":
        kwargs.setdefault("block_size", 8)
    return Engine(model, kv_cache=kv_cache, **kwargs)


def drafted(target, draft, kv_cache: str, prompts, params, k: int = K, **kwargs):
    spec = engine(target, kv_cache, speculative=SpeculativeConfig(draft, num_speculative_tokens=k), **kwargs)
    return spec.generate(prompts, params), spec.speculative_stats


def assert_exact(target, draft, kv_cache: str, context: str, **kwargs) -> None:
    prompts = make_prompts([3, 9, 17], target.config.vocab_size, seed=1)
    params = greedy(32)
    alone = engine(target, kv_cache, **kwargs).generate(prompts, params)
    outputs, stats = drafted(target, draft, kv_cache, prompts, params, **kwargs)
    for got, want in zip(outputs, alone):
        assert_same_output(got, want, context=context)
    # the rule kept some proposals and refused others: rollbacks to a middle token happened
    assert 0 < stats.accepted < stats.proposed, f"{context}: accepted {stats.accepted} of {stats.proposed}"
    assert stats.emitted == sum(len(o.token_ids) - 1 for o in outputs)  # all but each prefill's token


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_target_with_gqa_mamba_and_prompt_lookup_drafts(arch, kv_cache):
    target = coupled_model(arch, seed=10 + ARCHS.index(arch))
    for name, draft in (("gqa", coupled_model("gqa", 1)), ("mamba", coupled_model("mamba", 2)),
                        ("prompt lookup", PROMPT_LOOKUP)):
        assert_exact(target, draft, kv_cache, f"{arch} target, {name} draft, {kv_cache}")


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_draft_for_a_gqa_target(arch, kv_cache):
    assert_exact(coupled_model("gqa", 3), coupled_model(arch, seed=30 + ARCHS.index(arch)), kv_cache,
                 f"{arch} draft, gqa target, {kv_cache}")


def test_a_draft_equal_to_the_target_is_always_accepted():
    target = coupled_model("hybrid", 5, layers="mamba,swa,gqa")
    prompts = make_prompts([5, 12], target.config.vocab_size, seed=2)
    outputs, stats = drafted(target, target, "paged", prompts, greedy(21))
    assert stats.accepted == stats.proposed > 0
    # 20 tokens after the prefill's, k + 1 a step: every step but the last gains 5
    assert stats.tokens_per_forward == pytest.approx(40 / stats.sequence_steps) and stats.steps == 4
    assert [len(o.token_ids) for o in outputs] == [21, 21]


@pytest.mark.parametrize("arch", ["gqa", "mamba", "hybrid"])
def test_self_speculation_drafts_with_the_targets_first_layers(arch):
    target = coupled_model(arch, 17, n_layers=3)
    draft = target.first_layers(1)
    assert draft.blocks[0] is target.blocks[0] and draft.head is target.head
    assert_exact(target, draft, "paged", f"{arch} target, its first layer as draft")
    with pytest.raises(ValueError, match=r"n_layers must be an integer in \[1, 2\]"):
        target.first_layers(3)


@pytest.mark.parametrize("arch", ["gqa", "mamba", "hybrid"])
def test_mixed_batch_lengths_stops_and_seeded_sampling(arch):
    """Greedy and seeded sampled requests in one batch, with stop tokens and outputs of every length: the greedy
    ones equal their alone-runs; a sampled one is reproducible by its seed (its draws differ from the target
    alone's: the rule spends random numbers of its own)."""
    target, draft = coupled_model(arch, 7), coupled_model("gqa", 8)
    prompts = make_prompts([4, 11, 2, 19, 7], target.config.vocab_size, seed=3)
    params = [greedy(1), greedy(9, stop_token_ids=(5, 6)), SamplingParams(max_new_tokens=13, temperature=0.8, seed=4),
              greedy(27), SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=5)]
    spec = engine(target, max_batch=3, speculative=SpeculativeConfig(draft, num_speculative_tokens=3))
    first = spec.generate(prompts, params)
    again = spec.generate(prompts, params)
    for i, (a, b) in enumerate(zip(first, again)):
        assert a.token_ids == b.token_ids, f"request {i} is not reproducible by its seed"
    for i in (0, 1, 3):
        alone = engine(target, max_batch=1).generate([prompts[i]], params[i])[0]
        assert_same_output(first[i], alone, context=f"{arch} request {i}")
    assert [len(o.token_ids) for o in first][2::2] == [13, 6]
    assert first[1].finish_reason == "stop" or len(first[1].token_ids) == 9


@pytest.mark.parametrize("arch", ["gqa", "swa", "hybrid"])
def test_preemption_prefix_caching_and_chunked_prefill(arch):
    """A pool small enough to preempt (optimistic admission), prefix caching and a token budget, all at once: every
    output equals its alone-run, and the draft follows its request through preemption and recompute. (A window
    wider than the prompts: blocks a window dropped unwritten are never shared.)"""
    target = coupled_model(arch, 11, **({} if arch == "gqa" else {"window": 48}))
    draft = coupled_model("mamba", 12)
    system = make_prompts([16], target.config.vocab_size, seed=4)[0]
    prompts = [system + suffix for suffix in make_prompts([3, 8, 1, 12, 5, 9], target.config.vocab_size, seed=5)]
    params = greedy(24)
    settings = dict(max_batch=6, admission="optimistic", prefix_caching=True, max_num_batched_tokens=24)
    peak = max(m.peak_blocks(len(p) + 24 - 1 + K) for p in prompts
               for m in engine(target, speculative=SpeculativeConfig(draft, num_speculative_tokens=K)).block_managers)
    spec = engine(target, num_blocks=peak + 2, speculative=SpeculativeConfig(draft, num_speculative_tokens=K),
                  **settings)
    outputs = spec.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert_same_output(out, engine(target, max_batch=1).generate([prompt], params)[0], context=arch)
    assert spec.preemptions > 0 and spec.prefix_cache_hit_rate > 0
    assert 0 < spec.speculative_stats.accepted < spec.speculative_stats.proposed


def test_every_proposal_refused_still_gains_a_token_per_step():
    """A draft that never agrees (prompt lookup on a context without repeats proposes nothing; a contrary draft
    proposes wrong tokens): one target token per step, as without speculation."""
    target = coupled_model("gqa", 13)
    prompts = [list(range(20))]
    outputs, stats = drafted(target, PROMPT_LOOKUP, "paged", prompts, greedy(1))
    assert stats.proposed == 0 and len(outputs[0].token_ids) == 1


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    from harness.engine.speculative.proposers import PromptLookup
    lookup = PromptLookup(longest=3, shortest=1)
    assert lookup.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # the latest of two 3-gram matches
    assert lookup.lookup([4, 2, 3, 9, 1, 8, 3], 2) == [9, 1]  # no 3- or 2-gram match: the 1-gram [3]
    assert lookup.lookup([1, 2, 3, 4], 2) == []  # nothing repeats
    assert lookup.lookup([5, 5], 4) == [5]  # a match near the end proposes what there is
    assert lookup.lookup([1, 2, 1], 0) == []


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_rollback_returns_each_cache_to_the_kept_prefix(kv_cache):
    """After a verification of k + 1 tokens kept only its first ones, the caches are what feeding just those would
    have left: the next token's logits match a run that never saw the rejected ones."""
    model = coupled_model("hybrid", 14, layers="mamba,swa,gdn,linear,gqa")
    probe = engine(model, kv_cache, max_batch=2)
    prompts = make_prompts([10, 13], model.config.vocab_size, seed=6)
    seqs = [probe.make_sequence(p, greedy(8)) for p in prompts]
    for seq in seqs:
        probe.queue(seq)
    probe.scheduler.schedule(None)
    for seq in seqs:
        probe.runner.prefill([(seq, len(seq.prompt_ids) - 1)])
        seq.output_ids.append(seq.prompt_ids.pop())  # the last prompt token becomes the newest, uncached
    probe.pool.forget_steps()
    noise = make_prompts([5, 5], model.config.vocab_size, seed=7)
    probe.runner.feed(seqs, [[s.output_ids[-1]] + n[:4] for s, n in zip(seqs, noise)], checkpoints=True)
    for seq, noise_tokens, kept in zip(seqs, noise, (1, 3)):  # keep the newest token (+ 2 of the noise for one)
        seq.output_ids += noise_tokens[: kept - 1] + [noise_tokens[kept - 1] if kept > 1 else 0]
    probe.runner.rollback(seqs, [len(s.all_ids) - 1 for s in seqs])
    logits = probe.runner.decode(seqs)
    with torch.no_grad():
        for seq, row in zip(seqs, logits):
            want = model(torch.tensor([seq.all_ids]))[0, -1]
            assert (row - want).abs().max() < 1e-4


def test_bad_speculative_settings_are_errors_before_work():
    target = coupled_model("gqa", 15)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(PROMPT_LOOKUP, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="draft"):
        SpeculativeConfig("ngram")
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(PROMPT_LOOKUP, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="zoo model"):
        SpeculativeConfig(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="vocabulary"):
        engine(target, speculative=SpeculativeConfig(coupled_model("gqa", 1, vocab_size=80)))
    diffusion = zoo.build("diffusion", preset="tiny", vocab_size=63)  # 63 data ids + the mask id: the same 64
    with pytest.raises(ValueError, match="masked diffusion"):
        engine(target, speculative=SpeculativeConfig(diffusion))
    with pytest.raises(ValueError, match="compile"):
        engine(target, compile=True, speculative=SpeculativeConfig(PROMPT_LOOKUP))
    with pytest.raises(ValueError, match="ring buffer holds 16 rows"):
        engine(coupled_model("swa", 16), "contiguous", speculative=SpeculativeConfig(PROMPT_LOOKUP, num_speculative_tokens=16))
    with pytest.raises(ValueError, match="SpeculativeConfig"):
        engine(target, speculative=PROMPT_LOOKUP)
    spec = engine(target, speculative=SpeculativeConfig(PROMPT_LOOKUP))
    with pytest.raises(ValueError, match="beam_search"):
        spec.beam_search([1, 2, 3])


def test_zoo_generate_speculates_with_a_draft_folder_or_prompt_lookup(tmp_path, capsys):
    from harness.cli import main
    zoo.save(coupled_model("mamba", 2, vocab_size=512), tmp_path / "draft")
    base = ["generate", "--arch", "gqa", "--preset", "tiny", "--prompt", "abcabcabc", "--max-new-tokens", "12"]
    assert main(base) == 0
    alone = capsys.readouterr().out
    for draft in ("prompt_lookup", str(tmp_path / "draft")):
        assert main(base + ["--draft", draft, "--num-speculative-tokens", "3"]) == 0
        out = capsys.readouterr()
        assert out.out == alone and "tokens per target forward" in out.err  # greedy: the same text
    assert main(base + ["--draft", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(base + ["--draft", "prompt_lookup", "--num-speculative-tokens", "0"]) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err
