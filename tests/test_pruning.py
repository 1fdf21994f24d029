"""Structured pruning (zoo/pruning.py): a pruned model computes what the original computes with the cut parts'
output weights zeroed (a block whose outputs are zero is the identity, through the residual), and it is a normal
model: the float64 reference, zoo.save (and the engine's contract, in tests/test_conformance.py)."""
import pytest
import torch

import zoo
from zoo.pruning import PrunePlan, prune
from zoo.reference import reference_forward
from helpers import random_model  # tests/ is on sys.path under pytest


@torch.no_grad()
def zeroed(model, plan: PrunePlan):
    """The original model with what plan cuts silenced: a dropped layer's o_proj and down_proj, a cut KV group's
    query heads' o_proj columns, a cut Gated DeltaNet head's out_proj columns, a cut channel's down_proj column, a cut embedding channel's embedding column and
    o_proj and down_proj rows (so the residual stream carries nothing there)."""
    silent = zoo.build(model.config)
    silent.load_state_dict(model.state_dict())
    if plan.embedding is not None:
        residual = sorted(set(range(model.config.d_model)) - set(plan.embedding))
        silent.embed.weight[:, residual] = 0
        for block in silent.blocks:
            for linear in (block.mixer.o_proj, *([block.mlp.down_proj] if block.mlp is not None else [])):
                linear.weight[residual] = 0
    for i, block in enumerate(silent.blocks):
        if i not in plan.layers:
            block.mixer.o_proj.weight.zero_()
            if block.mlp is not None:
                block.mlp.down_proj.weight.zero_()
            continue
        if i in plan.kv_heads:
            mixer = block.mixer
            group, dim = mixer.n_heads // mixer.n_kv_heads, mixer.head_dim
            for h in set(range(mixer.n_kv_heads)) - set(plan.kv_heads[i]):
                mixer.o_proj.weight[:, h * group * dim:(h + 1) * group * dim] = 0
        if i in plan.state_heads:
            dim = block.mixer.value_dim
            for h in set(range(block.mixer.n_heads)) - set(plan.state_heads[i]):
                block.mixer.out_proj.weight[:, h * dim:(h + 1) * dim] = 0
        if i in plan.channels:
            cut = sorted(set(range(block.mlp.down_proj.weight.shape[1])) - set(plan.channels[i]))
            block.mlp.down_proj.weight[:, cut] = 0
    return silent.eval()


def tokens(model, length: int = 30) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))


CASES = {
    "gqa: a layer, a KV group, channels": (
        "gqa", {"n_layers": 3}, PrunePlan((0, 2), kv_heads={2: (1,)}, channels={0: tuple(range(0, 192, 3))})),
    "mha: heads in every kept layer": ("mha", {}, PrunePlan((0, 1), kv_heads={0: (0, 3), 1: (2,)})),
    "gelu, biases off, channels only": ("gqa", {"mlp": "gelu"}, PrunePlan((0, 1), channels={1: (5, 6, 100)})),
    "cla: the sharing layer kept with its source": ("cla", {"n_layers": 4, "share": 2}, PrunePlan((2, 3))),
    "gdn: state heads, each layer its own": ("gdn", {"n_layers": 3}, PrunePlan(
        (0, 1, 2), state_heads={0: (0, 2), 2: (3,)}, channels={1: tuple(range(0, 192, 2))})),
    "hybrid: a KV group and state heads": ("hybrid", {"layers": "gqa,gdn", "expand_v": 2}, PrunePlan(
        (0, 1), kv_heads={0: (1,)}, state_heads={1: (1, 2)})),
    "qk_norm per head": ("gqa", {"qk_norm": "head"}, PrunePlan((0, 1), kv_heads={1: (0,)})),
    # an RMSNorm's eps is added to a mean over the channels: over fewer it weighs more (4e-4 of the logits at the
    # tiny preset's 1e-5), so the embedding cases test the cut itself at a negligible eps
    "embedding channels with a KV group and channels": (
        "gqa", {"n_layers": 3, "norm_eps": 1e-12}, PrunePlan((0, 1, 2), kv_heads={1: (0,)}, channels={2: tuple(range(50))},
                                          embedding=tuple(range(1, 64, 3)))),
    "embedding channels, tied head, gelu, a layer dropped": (
        "mha", {"tie_embeddings": True, "mlp": "gelu", "norm_eps": 1e-12}, PrunePlan((1,), embedding=(0, 5, 9, 20, 33, 60, 63))),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_pruned_model_computes_the_original_with_its_cut_parts_silenced(case):
    arch, overrides, plan = CASES[case]
    model = random_model(arch, **overrides)
    pruned = prune(model, plan)
    x = tokens(model)
    with torch.no_grad():
        want, got = zeroed(model, plan)(x), pruned(x)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())


def test_a_pruned_model_holds_the_float64_reference():  # the engine's contract: tests/test_conformance.py's SURGERY
    model = random_model("gqa", n_layers=3)
    pruned = prune(model, PrunePlan((0, 2), kv_heads={0: (0,)}, channels={2: tuple(range(64))}))
    x = tokens(pruned, 40)
    with torch.no_grad():
        logits, want = pruned(x), reference_forward(pruned, x)
    assert ((logits.double() - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_a_pruned_model_saves_and_loads_as_itself(tmp_path):
    pruned = prune(random_model("gqa"), PrunePlan((1,), kv_heads={1: (1,)}, channels={1: (0, 1, 2, 3)}))
    loaded = zoo.load(zoo.save(pruned, tmp_path / "pruned"))
    assert loaded.config.layers == pruned.config.layers and loaded.config.ffns == pruned.config.ffns
    x = tokens(pruned)
    with torch.no_grad():
        assert torch.equal(loaded(x), pruned(x))


@pytest.mark.parametrize("plan, message", [
    (PrunePlan(()), r"layers kept must be distinct ascending indices in \[0, 2\), at least one, got \[\]"),
    (PrunePlan((1, 0)), "distinct ascending"),
    (PrunePlan((0, 2)), r"in \[0, 2\)"),
    (PrunePlan((0,), kv_heads={1: (0,)}), r"kv_heads names layers \[1\] that the plan does not keep"),
    (PrunePlan((0,), kv_heads={0: (2,)}), r"kv_heads of layer 0 must be distinct ascending indices in \[0, 2\)"),
    (PrunePlan((0,), kv_heads={0: ()}), "at least one"),
    (PrunePlan((0,), channels={0: (0, 0)}), "channels of layer 0 must be distinct"),
    (PrunePlan((0,), state_heads={0: (0,)}), "layer 0 is a 'attention' mixer: only gdn layers can lose state heads"),
])
def test_bad_plans_are_refused_by_name(plan, message):
    with pytest.raises(ValueError, match=message):
        prune(random_model("gqa"), plan)


def test_what_cannot_be_cut_is_named():
    with pytest.raises(ValueError, match="layer 1 reads the keys and values of layer 0"):
        prune(random_model("cla", n_layers=4, share=2), PrunePlan((1, 2, 3)))
    with pytest.raises(ValueError, match="shares its keys and values"):
        prune(random_model("cla", n_layers=4, share=2), PrunePlan((0, 1), kv_heads={0: (0,)}))
    with pytest.raises(ValueError, match="layer 0 is a 'mamba2' mixer"):
        prune(random_model("mamba2"), PrunePlan((0,), kv_heads={0: (0,)}))
    with pytest.raises(ValueError, match=r"state_heads of layer 1 must be distinct ascending indices in \[0, 4\)"):
        prune(random_model("gdn"), PrunePlan((0, 1), state_heads={1: (4,)}))
    with pytest.raises(ValueError, match="feed-forward is 'none'"):
        prune(random_model("gqa", mlp="none"), PrunePlan((0,), channels={0: (0,)}))
    with pytest.raises(ValueError, match=r"layer 0 \('mamba2' mixer, 'swiglu' feed-forward\): embedding channels"):
        prune(random_model("mamba2"), PrunePlan((0,), embedding=(0, 1)))
    with pytest.raises(ValueError, match=r"embedding channels must be distinct ascending indices in \[0, 64\)"):
        prune(random_model("gqa"), PrunePlan((0, 1), embedding=(3, 64)))


def test_an_embedding_cut_shrinks_every_residual_weight():
    pruned = prune(random_model("gqa"), PrunePlan((0, 1), embedding=tuple(range(24))))
    assert pruned.config.d_model == 24 and pruned.embed.weight.shape[1] == 24
    assert [b.mixer.head_dim for b in pruned.blocks] == [16, 16]  # the original's, not 24 // n_heads
    assert pruned.blocks[0].mlp.down_proj.weight.shape == (24, 192)
