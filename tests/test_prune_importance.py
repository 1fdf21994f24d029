"""Importance scores (harness/prune/importance.py) against hand computations, and plans that land on their target
(harness/prune/plan.py)."""
import math

import pytest
import torch

import zoo
from harness.prune.importance import measure_importance
from harness.prune.plan import TOLERANCE, check_by, parameter_count, plan_for_target, resolve_target
from helpers import random_model  # tests/ is on sys.path under pytest


def windows(model, count: int = 3, length: int = 20) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (count, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_block_influence_is_one_minus_the_cosine_of_each_block_s_input_and_output():
    model = random_model("gqa", n_layers=3)
    x = windows(model)
    got = measure_importance(model, x, batch_size=2).layers
    h = model.embed(x)
    positions = torch.arange(x.shape[1]).expand(x.shape)
    for i, block in enumerate(model.blocks):
        after = block(h, positions)
        cosines = [torch.dot(a, b) / (a.norm() * b.norm()) for a, b in zip(h.reshape(-1, h.shape[-1]).double(),
                                                                            after.reshape(-1, h.shape[-1]).double())]
        assert got[i] == pytest.approx(1 - sum(cosines).item() / len(cosines), rel=1e-6)
        h = after


@torch.no_grad()
def test_a_silenced_kv_head_and_channel_score_zero_and_the_rest_do_not():
    model = random_model("gqa")
    mixer, mlp = model.blocks[1].mixer, model.blocks[0].mlp
    mixer.v_proj.weight[mixer.head_dim:2 * mixer.head_dim] = 0  # KV head 1's values: its query heads output 0
    mlp.up_proj.weight[7] = 0  # channel 7's activation: silu(gate) * 0
    scores = measure_importance(model, windows(model))
    assert scores.kv_heads[1][1] == 0 and scores.kv_heads[1][0] > 0 and min(scores.kv_heads[0]) > 0
    assert scores.channels[0][7] == 0 and sum(c > 0 for c in scores.channels[0]) == len(scores.channels[0]) - 1


@torch.no_grad()
def test_a_gated_deltanet_head_that_writes_nothing_scores_zero():
    model = random_model("hybrid", layers="gqa,gdn")
    mixer = model.blocks[1].mixer
    values = 2 * mixer.n_heads * mixer.head_dim + 2 * mixer.value_dim  # in_proj's rows of head 2's values
    mixer.in_proj.weight[values:values + mixer.value_dim] = 0  # its state stays zero, so does its output
    scores = measure_importance(model, windows(model))
    assert list(scores.state_heads) == [1] and list(scores.kv_heads) == [0]
    assert scores.state_heads[1][2] == 0 and sum(s > 0 for s in scores.state_heads[1]) == mixer.n_heads - 1


@torch.no_grad()
def test_an_embedding_channel_nothing_writes_scores_zero_and_the_score_is_the_norms_mean_magnitude():
    model = random_model("gqa")
    model.embed.weight[:, 5] = 0
    for block in model.blocks:
        block.mixer.o_proj.weight[5] = 0
        block.mlp.down_proj.weight[5] = 0
    x = windows(model)
    scores = measure_importance(model, x).embedding
    assert scores[5] == 0 and sum(s > 0 for s in scores) == model.config.d_model - 1
    h, want = model.embed(x), torch.zeros(model.config.d_model, dtype=torch.float64)
    positions = torch.arange(x.shape[1]).expand(x.shape)
    for block in model.blocks:  # every norm reading the stream: each block's two, then the final one
        want += block.mixer_norm(h).double().abs().mean(dim=(0, 1))
        mid = h + block.mixer(block.mixer_norm(h), positions)
        want += block.mlp_norm(mid).double().abs().mean(dim=(0, 1))
        h = block(h, positions)
    want += model.norm(h).double().abs().mean(dim=(0, 1))
    assert torch.allclose(torch.tensor(scores, dtype=torch.float64), want, rtol=1e-5)


@pytest.mark.parametrize("arch, by", [("gqa", "mlp"), ("mha", "heads+mlp"), ("gqa", "depth+mlp"),
                                      ("cla", "depth+mlp"), ("mha", "mlp"), ("gqa", "embedding"),
                                      ("swa", "embedding+mlp"), ("gdn", "heads+mlp")])
@pytest.mark.parametrize("share", [0.8, 0.5])
def test_a_plan_lands_within_two_percent_of_its_target(arch, by, share):
    model = random_model(arch, n_layers=4)
    importance = measure_importance(model, windows(model))
    target = resolve_target(model, share)
    plan = plan_for_target(model, importance, target, by)
    assert abs(parameter_count(model, plan) - target) <= TOLERANCE * target
    assert parameter_count(model, plan) == zoo.parameter_counts(zoo.prune(model, plan)).total


def test_heads_cut_the_least_important_gated_deltanet_heads_too():
    model = random_model("hybrid", layers="gqa,gdn", n_layers=4)
    importance = measure_importance(model, windows(model))
    plan = plan_for_target(model, importance, resolve_target(model, 0.5), "heads+mlp")
    assert sorted(plan.state_heads) == [1, 3] and sorted(plan.kv_heads) == [0, 2]
    for i, kept in plan.state_heads.items():
        scores = importance.state_heads[i]
        assert 1 <= len(kept) < len(scores)
        assert min(scores[j] for j in kept) >= max(scores[j] for j in range(len(scores)) if j not in kept)


def test_depth_drops_the_least_influential_layers_and_heads_keep_the_most_important():
    model = random_model("mha", n_layers=4)
    importance = measure_importance(model, windows(model))
    plan = plan_for_target(model, importance, resolve_target(model, 0.5), "depth+mlp")
    dropped = sorted(set(range(4)) - set(plan.layers))
    assert dropped and max(importance.layers[i] for i in dropped) <= min(importance.layers[i] for i in plan.layers)
    plan = plan_for_target(model, importance, resolve_target(model, 0.5), "heads+mlp")
    for i, kept in plan.kv_heads.items():
        scores = importance.kv_heads[i]
        assert len(kept) == math.ceil(len(scores) * 0.5 * zoo.parameter_counts(model).total
                                      / parameter_count(model, zoo.PrunePlan(tuple(range(4)))))
        assert min(scores[j] for j in kept) >= max([scores[j] for j in range(len(scores)) if j not in kept] or [0])


@pytest.mark.parametrize("target, message", [
    (0, "target must be a parameter count"), (-3, "target must be"), (float("nan"), "target must be"),
    (10**9, "is not below the model's"),
])
def test_a_target_the_model_cannot_take_is_refused(target, message):
    with pytest.raises(ValueError, match=message):
        resolve_target(random_model("gqa"), target)


def test_what_no_plan_can_reach_is_refused_before_calibration():
    model = random_model("gqa")
    with pytest.raises(ValueError, match="below the .* that cutting by mlp can reach"):
        check_by(model, "mlp", 1000)
    with pytest.raises(ValueError, match="unknown pruning axes by='width'; allowed: mlp, heads\\+mlp, depth\\+mlp"):
        check_by(model, "width", 10**5)
    with pytest.raises(ValueError, match="no feed-forward channels to cut"):
        check_by(random_model("gqa", mlp="none"), "mlp", 10**4)
    check_by(random_model("gqa", mlp="none"), "embedding", 10**4)  # the embedding axis needs no channels
    with pytest.raises(ValueError, match="layer 0 \\('mamba2' mixer, 'swiglu' feed-forward\\): embedding channels"):
        check_by(random_model("mamba2"), "embedding+mlp", 10**4)


def test_a_kv_head_count_is_kept_exactly_or_refused_by_name():
    model = random_model("mha", n_layers=2)  # 4 KV heads a layer
    importance = measure_importance(model, windows(model))
    plan = plan_for_target(model, importance, resolve_target(model, 0.6), "heads+mlp", kv_heads=2)
    assert {i: len(kept) for i, kept in plan.kv_heads.items()} == {0: 2, 1: 2}
    with pytest.raises(ValueError, match="kv_heads must be between 1 and 4 .* got 5"):
        check_by(model, "heads+mlp", 10**4, kv_heads=5)
    with pytest.raises(ValueError, match="kv_heads is a heads\\+mlp setting, not mlp's"):
        check_by(model, "mlp", 10**4, kv_heads=2)
