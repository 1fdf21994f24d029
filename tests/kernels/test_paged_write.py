import pytest
import torch

from kernels import FORCE_TRITON_ENV, write_paged_kv, write_paged_kv_ref, write_paged_kv_triton

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS = 5, 8, 2
SLOTS = [17, 3, -1, 39, 8, -1, 0]  # out of order, across blocks, with skipped (padding) tokens


def make_pools(dim_k, dim_v, dtype, device, head_major=False):
    """head_major: stored [blocks, heads, positions, dim] and seen transposed, as the engine keeps its pools."""
    generator = torch.Generator().manual_seed(1)
    k_pool = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, dim_k, generator=generator)
    v_pool = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, dim_v, generator=generator)
    if head_major:
        k_pool, v_pool = (pool.transpose(1, 2).contiguous().transpose(1, 2) for pool in (k_pool, v_pool))
    return k_pool.to(device, dtype), v_pool.to(device, dtype)


def make_tokens(dim_k, dim_v, dtype, device):
    """New K/V as strided views into one fused projection output, as an attention layer produces them."""
    generator = torch.Generator().manual_seed(2)
    fused = torch.randn(len(SLOTS), NUM_KV_HEADS, dim_k + dim_v, generator=generator).to(device, dtype)
    return fused[..., :dim_k], fused[..., dim_k:]


@pytest.mark.parametrize("head_major", [False, True], ids=["position-major", "head-major"])
def test_reference_writes_each_token_to_its_slot(head_major):
    k_pool, v_pool = make_pools(4, 4, torch.float32, "cpu", head_major)
    original_k, original_v = k_pool.clone(), v_pool.clone()
    k, v = make_tokens(4, 4, torch.float32, "cpu")
    write_paged_kv_ref(k, v, k_pool, v_pool, torch.tensor(SLOTS))
    for token, slot in enumerate(SLOTS):
        if slot >= 0:
            block, offset = divmod(slot, BLOCK_SIZE)
            assert torch.equal(k_pool[block, offset], k[token]) and torch.equal(v_pool[block, offset], v[token])
            original_k[block, offset], original_v[block, offset] = k[token], v[token]
    # every slot not written keeps its old contents
    assert torch.equal(k_pool, original_k) and torch.equal(v_pool, original_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("dim_k,dim_v", [(16, 16), (24, 20)])
@pytest.mark.parametrize("head_major", [False, True], ids=["position-major", "head-major"])
def test_triton_matches_reference(force_triton, device, dtype, dim_k, dim_v, head_major):
    k, v = make_tokens(dim_k, dim_v, dtype, device)
    slot_mapping = torch.tensor(SLOTS, device=device)
    expected_k, expected_v = make_pools(dim_k, dim_v, dtype, device)
    write_paged_kv_ref(k, v, expected_k, expected_v, slot_mapping)
    k_pool, v_pool = make_pools(dim_k, dim_v, dtype, device, head_major)
    write_paged_kv_triton(k, v, k_pool, v_pool, slot_mapping)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)


def test_triton_all_skipped_leaves_pools_untouched(force_triton, device):
    k, v = make_tokens(16, 16, torch.float16, device)
    k_pool, v_pool = make_pools(16, 16, torch.float16, device)
    original_k, original_v = k_pool.clone(), v_pool.clone()
    write_paged_kv_triton(k, v, k_pool, v_pool, torch.full((len(SLOTS),), -1, device=device))
    assert torch.equal(k_pool, original_k) and torch.equal(v_pool, original_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_keys_only_write(force_triton, device, dtype):
    # an MLA latent cache: one 48-wide row per token ([latent 32 ; rope key 16]) and no value pool
    latent, _ = make_tokens(48, 4, dtype, device)
    slot_mapping = torch.tensor(SLOTS, device=device)
    expected, _ = make_pools(48, 4, dtype, device)
    for token, slot in enumerate(SLOTS):
        if slot >= 0:  # negative slots (padding tokens) leave the pool as it was
            expected.view(-1, NUM_KV_HEADS, 48)[slot] = latent[token]
    for write in (write_paged_kv_ref, write_paged_kv_triton, write_paged_kv):  # the dispatcher given v = None too
        pool, _ = make_pools(48, 4, dtype, device)
        write(latent, None, pool, None, slot_mapping)
        assert torch.equal(pool, expected), write.__name__


@pytest.mark.parametrize("write", [write_paged_kv_ref, write_paged_kv_triton])
def test_values_without_value_pool_raise(write):
    k, v = make_tokens(4, 4, torch.float32, "cpu")
    k_pool, v_pool = make_pools(4, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="v_pool"):
        write(k, v, k_pool, None, torch.tensor(SLOTS))
    with pytest.raises(ValueError, match="v_pool"):
        write(k, None, k_pool, v_pool, torch.tensor(SLOTS))


def test_dispatcher_writes_on_cpu_without_triton_path(monkeypatch):
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    k, v = make_tokens(4, 4, torch.float32, "cpu")
    k_pool, v_pool = make_pools(4, 4, torch.float32, "cpu")
    write_paged_kv(k, v, k_pool, v_pool, torch.tensor(SLOTS))
    assert torch.equal(k_pool[2, 1], k[0])  # slot 17 = block 2, offset 1
