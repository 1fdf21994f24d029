"""The MoE grouped matmul: its Triton kernel (the CPU interpreter here) and its reference against a float64 loop, and
the expert alignment's layout."""
import pytest
import torch

from kernels.grouped_matmul import BLOCK_M, align_by_expert, grouped_matmul, grouped_matmul_ref, grouped_matmul_triton

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def float64_loop(x, weight, experts, source):
    rows = range(experts.shape[0])
    return torch.stack([weight[experts[m]].double() @ x[m if source is None else source[m]].double() for m in rows])


def routed(tokens: int, n_experts: int, top_k: int, seed: int, skew: bool = False):
    """(experts, source) of tokens * top_k pairs; skew sends most pairs to expert 0 and leaves some experts empty."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, n_experts, generator=g)
    if skew:
        scores[:, 0] += 1
        scores[:, n_experts // 2:] -= 2
    experts = scores.topk(top_k, dim=-1).indices.flatten()
    return experts, torch.arange(tokens).repeat_interleave(top_k)


@pytest.mark.parametrize("tokens,n_experts,top_k,skew", [(1, 8, 2, False), (5, 8, 2, True), (40, 6, 3, False),
                                                         (3, 64, 4, False)])
def test_alignment_puts_each_row_once_in_a_tile_of_its_expert(tokens, n_experts, top_k, skew):
    experts, _ = routed(tokens, n_experts, top_k, seed=tokens, skew=skew)
    padded_rows, tile_experts = align_by_expert(experts, n_experts)
    assert padded_rows.shape[0] == -(-(experts.shape[0] + n_experts * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    assert sorted(padded_rows[padded_rows >= 0].tolist()) == list(range(experts.shape[0]))
    for tile, expert in enumerate(tile_experts.tolist()):
        rows = padded_rows[tile * BLOCK_M:(tile + 1) * BLOCK_M]
        rows = rows[rows >= 0]
        assert expert >= 0 or rows.numel() == 0  # an unused tile holds no row
        assert all(experts[r] == expert for r in rows.tolist())
    used = (tile_experts >= 0).sum().item()
    assert used == sum(-(-(experts == e).sum().item() // BLOCK_M) for e in range(n_experts))


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("with_source", [True, False], ids=["pairs-of-tokens", "one-row-each"])
@pytest.mark.parametrize("tokens,n_experts,top_k,skew,k,n", [(1, 8, 2, False, 64, 96), (7, 8, 2, True, 48, 40),
                                                             (33, 4, 1, False, 37, 70)])
def test_triton_equals_reference_and_the_float64_loop(force_triton, dtype, with_source, tokens, n_experts, top_k,
                                                      skew, k, n):
    experts, source = routed(tokens, n_experts, top_k, seed=k, skew=skew)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(tokens if with_source else experts.shape[0], k, generator=g).to(dtype)
    weight = (torch.randn(n_experts, n, k, generator=g) / k**0.5).to(dtype)
    source = source if with_source else None
    got = grouped_matmul(x, weight, experts, source)  # forced onto the Triton path
    torch.testing.assert_close(got, grouped_matmul_ref(x, weight, experts, source), **TOLERANCE[dtype])
    torch.testing.assert_close(got.double(), float64_loop(x, weight, experts, source), **TOLERANCE[dtype])


def test_a_weight_view_with_strides_is_read_in_place(force_triton):
    """A transposed stack (stored [E, K, N], seen [E, N, K]) gives the same product."""
    experts, source = routed(4, 4, 2, seed=1)
    x = torch.randn(4, 32)
    weight = torch.randn(4, 32, 24).transpose(1, 2)
    torch.testing.assert_close(grouped_matmul_triton(x, weight, experts, source),
                               grouped_matmul_ref(x, weight, experts, source), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(2, 3, 4)), "expected x"), (dict(weight=torch.zeros(4, 8, 5)), "expected x"),
    (dict(source=torch.zeros(3, dtype=torch.long)), "source"), (dict(source=None), "one expert per row"),
])
def test_bad_shapes_raise(bad, match):
    args = dict(x=torch.zeros(2, 8), weight=torch.zeros(4, 6, 8), experts=torch.zeros(4, dtype=torch.long),
                source=torch.tensor([0, 0, 1, 1]))
    args.update(bad)
    for matmul in (grouped_matmul_ref, grouped_matmul_triton):
        with pytest.raises(ValueError, match=match):
            matmul(**args)
