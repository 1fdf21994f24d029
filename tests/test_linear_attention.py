"""Linear attention: parallel, chunked and recurrent forms agree; the parallel form equals a float64 loop; the cached
mixer (StateSlots) equals the uncached one; the state has exactly n_heads * (dk * dv + dk) elements."""
import math

import pytest
import torch

from attention.linear_attention import LinearAttention, taylor_feature_map
from cache.state_slots import StateSlots
from kernels import linear_attention_chunked, linear_attention_step
from kernels import linear_attention_parallel_ref as linear_attention_parallel
from batches import run_cached  # tests/ is on sys.path under pytest
from helpers import spread_weights  # tests/ is on sys.path under pytest

FEATURE_MAPS = ["elu", "taylor"]


def make_mixer(feature_map, seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"d_model": 32, "layer_idx": 0, "n_heads": 4, "feature_map": feature_map, "chunk_size": 16,
              **({"feature_dim": 4} if feature_map == "taylor" else {}), **kwargs}
    return spread_weights(LinearAttention(**kwargs), seed=seed, gain=1.0)


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def naive_loop(q, k, v, eps):
    """out[b, h, t] = sum_{s<=t} (q_t . k_s) v_s / (sum_{s<=t} q_t . k_s + eps), element by element in float64."""
    q, k, v = q.double(), k.double(), v.double()
    b_, h_, t_, _ = q.shape
    out = torch.zeros(b_, h_, t_, v.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            for t in range(t_):
                num, den = torch.zeros(v.shape[-1], dtype=torch.float64), 0.0
                for s in range(t + 1):
                    w = float(torch.dot(q[b, h, t], k[b, h, s]))
                    num += w * v[b, h, s]
                    den += w
                out[b, h, t] = num / (den + eps)
    return out


@pytest.mark.parametrize("t", [1, 5, 64, 100])
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_parallel_chunked_recurrent_forms_agree(feature_map, t):
    mixer = make_mixer(feature_map)
    x = torch.randn(2, t, 32)
    with torch.no_grad():
        q, k, v = mixer.project(x)
        parallel = linear_attention_parallel(q, k, v, mixer.eps)
        chunked, s_chunked, z_chunked = linear_attention_chunked(q, k, v, chunk_size=16, eps=mixer.eps)
        s = torch.zeros(2, 4, mixer.state_dim, mixer.head_dim)
        z = torch.zeros(2, 4, mixer.state_dim)
        recurrent = torch.stack([linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], s, z, mixer.eps)
                                 for i in range(t)], dim=2)
        # the chunked form continued from a state: split anywhere, chunk boundaries misaligned with the split
        cut = t // 3
        first, s0, z0 = linear_attention_chunked(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], chunk_size=16, eps=mixer.eps)
        rest, s1, z1 = linear_attention_chunked(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], s0, z0, 16, mixer.eps)
        resumed = torch.cat([first, rest], dim=2)
        # the module's forms, through the projections
        module_parallel, module_chunked = mixer.forward_parallel(x), mixer(x)
    for name, got in [("chunked", chunked), ("recurrent", recurrent), ("resumed chunked", resumed)]:
        assert rel_err(got, parallel) < 1e-5, f"{name} form differs from the parallel one by {rel_err(got, parallel):.3g}"
    for name, got_s, got_z in [("chunked", s_chunked, z_chunked), ("resumed chunked", s1, z1)]:
        assert rel_err(got_s, s) < 1e-5 and rel_err(got_z, z) < 1e-5, f"{name} final state differs from the recurrent one"
    assert rel_err(module_chunked, module_parallel) < 1e-5


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_parallel_form_equals_float64_loop(feature_map):
    mixer = make_mixer(feature_map)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        q, k, v = mixer.project(x)
        got = linear_attention_parallel(q, k, v, mixer.eps)
    assert rel_err(got.double(), naive_loop(q, k, v, mixer.eps)) < 1e-5


def test_feature_maps_match_their_definitions():
    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    # Taylor: phi(x).phi(y) = 1 + u + u^2 / 2 with u = x.y / sqrt(f), the 2nd-order expansion of exp(u)
    u = (x * y).sum(-1) / math.sqrt(5)
    phi_x, phi_y = taylor_feature_map(x), taylor_feature_map(y)
    assert phi_x.shape == (3, 1 + 5 + 25)
    torch.testing.assert_close((phi_x * phi_y).sum(-1), 1 + u + u**2 / 2)
    # elu + 1 is positive and equals x + 1 for x >= 0, exp(x) below
    mixer = LinearAttention(d_model=8, layer_idx=0, n_heads=2)
    torch.testing.assert_close(mixer.phi(x), torch.where(x >= 0, x + 1, x.exp()))


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_cached_prefill_then_decode_equals_uncached(feature_map):
    mixer = make_mixer(feature_map)
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        full = mixer(x)
        cache = StateSlots(mixer.cache_spec(), max_batch=2, dtype=torch.float32, device="cpu")
        # prefill 21 (two chunks, the second short), then single tokens, a 7-token continuation, single tokens
        cached = run_cached(mixer, cache, x, [21, 1, 1, 1, 7] + [1] * 9)
    assert rel_err(cached, full) < 1e-5, f"cached differs from uncached by {rel_err(cached, full):.3g}"


def test_prefill_overwrites_a_finished_sequences_state():
    """A slot's previous owner leaves its state behind; a prefill must start from zeros regardless."""
    mixer = make_mixer("elu")
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        cache = StateSlots(mixer.cache_spec(), max_batch=1, dtype=torch.float32, device="cpu")
        run_cached(mixer, cache, torch.randn(1, 6, 32), [6])
        cached = run_cached(mixer, cache, x, [5] + [1] * 7)
        full = mixer(x)
    assert rel_err(cached, full) < 1e-5


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_batch_rows_are_independent(feature_map):
    """Three sequences in non-consecutive slots of a larger pool equal each run alone."""
    mixer = make_mixer(feature_map)
    x = torch.randn(3, 20, 32)
    with torch.no_grad():
        cache = StateSlots(mixer.cache_spec(), max_batch=5, dtype=torch.float32, device="cpu")
        batched = run_cached(mixer, cache, x, [8, 1, 1, 4, 1, 1, 1, 1, 1, 1], slots=[4, 0, 2])
        for row in range(3):
            alone_cache = StateSlots(mixer.cache_spec(), max_batch=1, dtype=torch.float32, device="cpu")
            alone = run_cached(mixer, alone_cache, x[row : row + 1], [8] + [1] * 12)
            assert rel_err(batched[row : row + 1], alone) < 1e-5, f"row {row} depends on its batch"
        assert cache.tensors["kv"][[1, 3]].abs().max() == 0, "unused slots were written"


@pytest.mark.parametrize("feature_map,feature_dim,dk", [("elu", None, 8), ("elu", 5, 5), ("taylor", None, 1 + 16 + 256),
                                                        ("taylor", 4, 1 + 4 + 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_are_n_heads_times_dk_dv_plus_dk(feature_map, feature_dim, dk, dtype):
    n_heads, dv = 4, 8
    mixer = LinearAttention(d_model=32, layer_idx=0, n_heads=n_heads, feature_map=feature_map, feature_dim=feature_dim)
    spec = mixer.cache_spec()
    elements = n_heads * (dk * dv + dk)  # S [dk, dv] and z [dk] per head
    assert spec.kind == "state" and mixer.state_dim == dk
    assert dict(spec.state_shapes) == {"kv": (n_heads, dk, dv), "normalizer": (n_heads, dk)}
    assert spec.state_elements == elements and spec.elements_per_token == 0
    assert spec.elements(1) == spec.elements(10_000) == elements and spec.elements(0) == 0
    cache = StateSlots(spec, max_batch=3, dtype=dtype, device="cpu")
    assert cache.nbytes == 3 * elements * 4  # the state is fp32 whatever the model's dtype
    assert spec.bytes(7, dtype) == spec.state_bytes(dtype) == elements * 4


def test_bad_settings_raise():
    with pytest.raises(ValueError, match=r"'softmax'.*elu, taylor"):
        LinearAttention(d_model=32, layer_idx=0, n_heads=4, feature_map="softmax")
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        LinearAttention(d_model=30, layer_idx=0, n_heads=4)
    LinearAttention(d_model=30, layer_idx=0, n_heads=4, head_dim=8)  # an explicit head_dim need not divide
    for bad in [{"n_heads": 0}, {"chunk_size": 0}, {"feature_dim": 0}, {"eps": 0.0}]:
        with pytest.raises(ValueError):
            LinearAttention(**{"d_model": 32, "layer_idx": 0, "n_heads": 4, **bad})
