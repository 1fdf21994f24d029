"""LLaDA sampling semantics on models whose logits are set by hand, the Fast-dLLM caches against no cache, and
every bad setting."""
import math
import types

import pytest
import torch
from torch import nn

import zoo
from harness import DiffusionSampler
from harness.diffusion import transfer_counts
from helpers import random_model  # tests/ is on sys.path under pytest

VOCAB, MASK = 12, 11  # hand-set models: ids 0..10 are tokens, 11 the mask


class HandSetLogits(nn.Module):
    """Logits fixed by hand: position p of every row reads table[p] (+ shift(call) on the argmax token, to make
    later calls predict other tokens). Records each forward's input tokens."""

    def __init__(self, table: torch.Tensor, shift_per_call: int = 0, max_seq_len: int = 64):
        super().__init__()
        self.table, self.shift_per_call = table, shift_per_call
        self.config = types.SimpleNamespace(causal=False, mask_token_id=MASK, vocab_size=table.shape[-1],
                                            max_seq_len=max_seq_len, name="hand-set")
        self.anchor = nn.Parameter(torch.zeros(()))  # the sampler reads the device from the parameters
        self.inputs: list[torch.Tensor] = []

    def forward(self, tokens, positions=None, caches=None, batch=None):
        if positions is None:
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        shift = len(self.inputs) * self.shift_per_call
        self.inputs.append(tokens.clone())
        logits = self.table[positions]
        # move each position's logits to another token id (the mask column stays where it is)
        return torch.cat([logits[..., :MASK].roll(shift, dims=-1), logits[..., MASK:]], dim=-1)


def peaked_table(peaks: list[float], width: int = 64) -> torch.Tensor:
    """[width, VOCAB]: position p's argmax is token p % MASK with logit peaks[p] (0 elsewhere): a higher peak is a
    more confident prediction."""
    table = torch.zeros(width, VOCAB)
    for p, peak in enumerate(peaks):
        table[p, p % MASK] = peak
    return table


def logit_for_probability(prob: float) -> float:
    """The peak logit whose softmax probability is `prob` when the other MASK - 1 non-mask logits are 0 (the
    sampler sets the mask token's logit to -inf)."""
    return math.log(prob * (MASK - 1) / (1 - prob))


def masked_per_forward(model: HandSetLogits, start: int, end: int) -> list[int]:
    return [int((x[0, start:end] == MASK).sum()) for x in model.inputs]


def unmasked_at(model: HandSetLogits, i: int, start: int, end: int) -> set[int]:
    """Answer positions the i-th forward unmasked (read from its input and the next one's)."""
    before = model.inputs[i][0, start:end] == MASK
    after = model.inputs[i + 1][0, start:end] == MASK
    return {start + j for j in (before & ~after).nonzero().flatten().tolist()}


def test_transfer_counts_is_llada_linear_schedule():
    counts = transfer_counts(torch.tensor([10, 7, 3, 0, 8]), 4)
    assert counts.tolist() == [[3, 3, 2, 2], [2, 2, 2, 1], [1, 1, 1, 0], [0, 0, 0, 0], [2, 2, 2, 2]]
    assert transfer_counts(torch.tensor([5]), 1).tolist() == [[5]]


def test_schedule_seen_in_the_forward_inputs():
    # prompt of 3, answer of 12 in 2 blocks of 6, 4 steps per block: 6 = 2 + 2 + 1 + 1
    model = HandSetLogits(peaked_table([5.0] * 64))
    out = DiffusionSampler(model, steps=8, block_length=6).generate([[1, 2, 3]], gen_length=12)
    masked = masked_per_forward(model, 3, 15) + [sum(t == MASK for t in out.token_ids[0])]
    assert masked == [12, 10, 8, 7, 6, 4, 2, 1, 0]
    assert out.forward_passes == 8 and out.unmasked == [[2], [2], [1], [1], [2], [2], [1], [1]]
    assert out.tokens_per_forward == 12 / 8
    assert out.token_ids == [[p % MASK for p in range(3, 15)]]  # each position's argmax


def test_blocks_fill_left_to_right_even_when_later_positions_are_more_confident():
    prompt, block, gen = 2, 4, 12
    peaks = [1.0] * 64
    for p in range(prompt + block, prompt + gen):  # later blocks look far more confident
        peaks[p] = 10.0 + p
    model = HandSetLogits(peaked_table(peaks))
    DiffusionSampler(model, steps=6, block_length=block).generate([[5, 6]], gen_length=gen)
    assert len(model.inputs) == 6
    for i, x in enumerate(model.inputs):
        current = i // 2  # 2 steps per block
        first, last = prompt + current * block, prompt + (current + 1) * block
        assert (x[0, prompt:first] != MASK).all(), f"forward {i}: an earlier block still has masks"
        assert (x[0, last:] == MASK).all(), f"forward {i}: a later block was unmasked early"


def test_low_confidence_unmasks_the_most_probable_positions_first():
    prompt = 1
    peaks = [0.0, 3.0, 9.0, 1.0, 7.0, 5.0, 2.0]  # answer positions 1..6
    model = HandSetLogits(peaked_table(peaks))
    DiffusionSampler(model, steps=3, block_length=6).generate([[4]], gen_length=6)
    assert [unmasked_at(model, i, prompt, 7) for i in range(2)] == [{2, 4}, {5, 1}]


def test_random_remasking_follows_the_schedule_and_the_seed():
    def run(seed):
        model = HandSetLogits(peaked_table([2.0] * 64))
        out = DiffusionSampler(model, steps=4, block_length=8, remasking="random").generate(
            [[0]], gen_length=8, generator=torch.Generator().manual_seed(seed))
        return out, [unmasked_at(model, i, 1, 9) for i in range(3)]

    (a, order_a), (b, order_b) = run(0), run(0)
    assert a.unmasked == [[2]] * 4 and order_a == order_b
    orders = {str(run(seed)[1]) for seed in range(1, 6)}
    assert len(orders) > 1, "random remasking should depend on the seed"


def test_unmasked_tokens_never_change_again():
    """Every call predicts other tokens (shift 1 per call): a sampler that rewrote an unmasked position would show it."""
    model = HandSetLogits(peaked_table([4.0] * 64), shift_per_call=1)
    out = DiffusionSampler(model, steps=8, block_length=4).generate([[1, 2]], gen_length=8)
    final = out.token_ids[0]
    for i, x in enumerate(model.inputs):
        for p in range(2, 10):
            if x[0, p] != MASK:
                assert int(x[0, p]) == final[p - 2], f"position {p} changed after forward {i}"
    # and what a position holds is what the forward that unmasked it predicted: token (p + call) % MASK
    for i in range(len(model.inputs) - 1):
        for p in unmasked_at(model, i, 2, 10):
            assert final[p - 2] == (p + i) % MASK


def test_threshold_unmasks_every_position_above_it_and_at_least_one():
    probs = [0.0, 0.95, 0.2, 0.9, 0.3, 0.1, 0.25]  # answer positions 1..6
    peaks = [0.0] + [logit_for_probability(p) for p in probs[1:]]
    model = HandSetLogits(peaked_table(peaks))
    out = DiffusionSampler(model, steps=1, block_length=6, threshold=0.8).generate([[4]], gen_length=6)
    # step 1: the two above 0.8; then none is: one per step, the most probable first
    assert out.unmasked == [[2], [1], [1], [1], [1]]
    assert [unmasked_at(model, i, 1, 7) for i in range(4)] == [{1, 3}, {4}, {6}, {2}]
    assert all(t != MASK for t in out.token_ids[0])


def test_gumbel_sampling_follows_softmax_of_logits_over_temperature():
    table = torch.zeros(4, VOCAB)
    table[1, :3] = torch.tensor([0.7, 0.2, 0.1]).log()
    table[1, 3:] = -1e9
    model = HandSetLogits(table)
    prompts = [[5]] * 4000
    for temperature in (1.0, 0.5):
        sampler = DiffusionSampler(model, steps=1, block_length=1, temperature=temperature)
        out = sampler.generate(prompts, gen_length=1, generator=torch.Generator().manual_seed(0))
        counts = torch.bincount(torch.tensor(out.token_ids).flatten(), minlength=3)[:3].double() / len(prompts)
        want = torch.tensor([0.7, 0.2, 0.1]).double() ** (1 / temperature)
        assert torch.allclose(counts, want / want.sum(), atol=0.03), (temperature, counts)


@pytest.fixture(scope="module")
def model():
    return random_model("diffusion", seed=0, max_seq_len=96)


def test_one_token_per_forward_when_steps_equal_gen_length(model):
    sampler = DiffusionSampler(model, steps=16, block_length=16)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    a, b = sampler.generate(prompts, 16), sampler.generate(prompts, 16)
    assert a.forward_passes == 16 and a.unmasked == [[1, 1]] * 16 and a.tokens_per_forward == 1.0
    assert a.token_ids == b.token_ids
    assert all(t != model.config.mask_token_id for row in a.token_ids for t in row)
    fewer = DiffusionSampler(model, steps=4, block_length=16).generate(prompts, 16)
    assert fewer.forward_passes == 4 and fewer.unmasked == [[4, 4]] * 4 and fewer.tokens_per_forward == 4.0


def test_stats(model):
    out = DiffusionSampler(model, steps=8, block_length=8).generate([[1, 2, 3]], 16)
    assert 0 < out.first_block_s <= out.wall_s
    assert out.tokens_per_second == pytest.approx(16 / out.wall_s)
    assert out.cache_bytes == 0


@pytest.mark.parametrize("cache", [None, "dual"])
def test_a_batch_of_prompts_of_different_lengths_equals_each_alone(model, cache):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1]]
    sampler = DiffusionSampler(model, steps=6, block_length=4, cache=cache)
    batched = sampler.generate(prompts, 12)
    for prompt, tokens in zip(prompts, batched.token_ids):
        assert sampler.generate([prompt], 12).token_ids == [tokens], prompt
    assert len({t for row in batched.token_ids for t in row}) > 3  # not a degenerate continuation


@pytest.mark.parametrize("mixer", ["gqa", "mla"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_refreshed_every_step_equal_no_cache(mixer, cache, temperature):
    model = random_model("diffusion", seed=1, mixer=mixer, max_seq_len=64)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]

    def run(**kwargs):
        sampler = DiffusionSampler(model, steps=12, block_length=4, temperature=temperature, **kwargs)
        out = sampler.generate(prompts, 12, generator=torch.Generator().manual_seed(1))
        return torch.tensor(out.token_ids)

    assert torch.equal(run(cache=cache, refresh_every=1), run())


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_one_step_per_block_makes_a_cache_exact(model, cache):
    """Each block's only step is its refresh (a full forward): cached and uncached runs see the same logits."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached = DiffusionSampler(model, steps=4, block_length=4, cache=cache).generate(prompts, 16)
    plain = DiffusionSampler(model, steps=4, block_length=4).generate(prompts, 16)
    assert torch.equal(torch.tensor(cached.token_ids), torch.tensor(plain.token_ids))


@pytest.mark.parametrize("mixer", ["gqa", "mla"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_caches_are_exact_for_one_layer(mixer, cache):
    """With one layer a position's K/V depend on its own token alone. The prefix cache's stale entries are earlier
    blocks, which no longer change; the dual cache's are those and the later blocks, still all masks: so both
    caches hold exact K/V and must give no-cache's tokens, through the cached path (no refresh within a block)."""
    model = random_model("diffusion", seed=2, mixer=mixer, n_layers=1, max_seq_len=64)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    plain = DiffusionSampler(model, steps=12, block_length=4).generate(prompts, 12)
    widths = []  # tokens each forward runs: a full refresh at each block's first step, then the cached route's
    model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    cached = DiffusionSampler(model, steps=12, block_length=4, cache=cache).generate(prompts, 12)
    assert cached.token_ids == plain.token_ids and cached.agreement(plain) == 1.0
    full = 6 + 12
    if cache == "prefix":  # the block and the suffix after it
        assert widths == [full, 12, 12, 12, full, 8, 8, 8, full, 4, 4, 4]
    else:  # the block alone
        assert widths == [full, 4, 4, 4] * 3
    assert len({t for row in plain.token_ids for t in row}) > 3  # not a degenerate continuation


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_approximate_caches_report_their_agreement_with_no_cache(model, cache):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    plain = DiffusionSampler(model, steps=16, block_length=8).generate(prompts, 16)
    cached = DiffusionSampler(model, steps=16, block_length=8, cache=cache).generate(prompts, 16)
    agreement = cached.agreement(plain)
    assert agreement == (torch.tensor(cached.token_ids) == torch.tensor(plain.token_ids)).double().mean().item()
    print(f"{cache} cache agreement with no cache (random weights): {agreement:.3f}")
    assert 0.0 <= agreement <= 1.0
    assert all(t != model.config.mask_token_id for row in cached.token_ids for t in row)
    assert cached.forward_passes == plain.forward_passes == 16
    # analytic bytes: every held position's K/V in every layer, each row its own length
    assert cached.cache_bytes == zoo.cache_bytes(model, 19) + zoo.cache_bytes(model, 21)


def test_cache_bytes_equal_the_allocated_cache(model):
    from harness.diffusion.cache import BlockForward

    forward = BlockForward(model, "dual", None, [20, 20, 20])
    assert forward.cache_bytes == forward.pool.nbytes == zoo.cache_bytes(model, 20, batch=3)


def test_bad_settings_fail_before_any_forward():
    model = HandSetLogits(peaked_table([1.0] * 64), max_seq_len=20)
    bad_constructors = [
        (dict(steps=0), "steps must be >= 1, got 0"),
        (dict(block_length=0), "block_length must be >= 1, got 0"),
        (dict(remasking="entropy"), "unknown remasking 'entropy'; allowed: low_confidence, random"),
        (dict(temperature=-0.5), r"temperature must be >= 0.*-0.5"),
        (dict(cache="full"), "unknown cache 'full'; allowed: None, prefix, dual"),
        (dict(threshold=0.0), r"threshold must lie in \(0, 1\].*0.0"),
        (dict(threshold=1.5), r"threshold must lie in \(0, 1\].*1.5"),
        (dict(refresh_every=1), "refresh_every.*needs a cache"),
        (dict(cache="prefix", refresh_every=0), "refresh_every must be >= 1"),
    ]
    for kwargs, message in bad_constructors:
        with pytest.raises(ValueError, match=message):
            DiffusionSampler(model, **{"steps": 4, "block_length": 4, **kwargs})
    sampler = DiffusionSampler(model, steps=6, block_length=4)
    bad_calls = [
        (([[1]], 6), "gen_length=6 must be a positive multiple of block_length=4"),
        (([[1]], 0), "gen_length=0 must be a positive multiple"),
        (([[1]], 16), r"steps=6 must be divisible by the number of blocks \(gen_length / block_length = 4\); allowed: multiples of 4"),
        (([[1, 12]], 4), r"prompt 0 has token id\(s\) \[12\]: ids must lie in \[0, 12\)"),
        (([[1], [2, MASK]], 4), r"prompt 1 has token id\(s\) \[11\].*differ from the mask token 11"),
        (([[-1]], 4), r"\[-1\]"),
        (([[1] * 17], 4), "prompt 0 of 17 tokens \\+ gen_length=4 exceeds max_seq_len=20"),
        (([], 4), "no prompts"),
        ((torch.tensor([1, 2]), 4), r"\[batch, prompt_len\]"),
    ]
    for args, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            sampler.generate(*args)
    assert model.inputs == []  # no forward ran


def test_refuses_a_model_that_is_not_a_diffusion_lm():
    with pytest.raises(ValueError, match="not a masked diffusion LM"):
        DiffusionSampler(zoo.build("gqa", preset="tiny"), steps=4, block_length=4)
    model = HandSetLogits(peaked_table([1.0]))
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match="not a masked diffusion LM"):
        DiffusionSampler(model, steps=4, block_length=4)
