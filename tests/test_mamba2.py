"""Mamba-2: the chunked SSD scan equals the per-step recurrence (float64 loop); cached prefill + single-token steps
equal the uncached forward; the state has (d_inner + 2GN)·d_conv + H·P·N elements; HF Mamba2ForCausalLM parity
(logits, and greedy tokens through the engine in both layouts); bad settings."""
import inspect
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import Mamba2Config, Mamba2ForCausalLM
from transformers.models.mamba2 import modeling_mamba2

from cache.state_slots import StateSlots
from harness import Engine, SamplingParams
from kernels import FORCE_TRITON_ENV, selective_state_update
from ssm.mamba2 import Mamba2, ssd_scan_ref
from zoo.hf_mamba2 import mamba2_config, mamba2_names
from zoo.model import DecoderLM
from batches import slot_batch  # tests/ is on sys.path under pytest
from helpers import assert_not_constant, spread_weights  # tests/ is on sys.path under pytest

VOCAB = 256
PROMPT_LEN = 150  # not a multiple of the chunk size (32)
NEW_TOKENS = 64


def naive_recurrence(x, dt, A, B, C, D, state):
    """S_t = exp(dt_t A) S_{t-1} + dt_t x_t ⊗ B_t, y_t = S_t C_t + D x_t, one step and one head at a time (float64)."""
    b_, t_, h_, _ = x.shape
    heads_per_group = h_ // B.shape[2]
    state = state.clone()
    y = torch.zeros_like(x)
    for b in range(b_):
        for h in range(h_):
            g = h // heads_per_group
            for t in range(t_):
                state[b, h] = math.exp(dt[b, t, h] * A[h]) * state[b, h] + dt[b, t, h] * torch.outer(x[b, t, h], B[b, t, g])
                y[b, t, h] = state[b, h] @ C[b, t, g] + D[h] * x[b, t, h]
    return y, state


@pytest.mark.parametrize("t, chunk_size", [(1, 8), (8, 8), (21, 8), (37, 16), (37, 64)])
@pytest.mark.parametrize("initial", [False, True])
def test_chunked_scan_equals_recurrence(t, chunk_size, initial):
    g = torch.Generator().manual_seed(t * 100 + chunk_size)
    b, h, p, groups, n = 2, 4, 3, 2, 5
    x = torch.randn(b, t, h, p, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(b, t, h, generator=g, dtype=torch.float64))
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 4
    B = torch.randn(b, t, groups, n, generator=g, dtype=torch.float64)
    C = torch.randn(b, t, groups, n, generator=g, dtype=torch.float64)
    D = torch.randn(h, generator=g, dtype=torch.float64)
    state0 = torch.randn(b, h, p, n, generator=g, dtype=torch.float64) if initial else torch.zeros(b, h, p, n, dtype=torch.float64)
    y, final = ssd_scan_ref(x, dt, A, B, C, chunk_size, D=D, initial_state=state0 if initial else None)
    want_y, want_final = naive_recurrence(x, dt, A, B, C, D, state0)
    assert y.dtype == final.dtype == torch.float64
    torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-10)


def test_state_update_equals_one_scan_step():
    """The decode step (kernels.selective_state_update with per-head inputs as stride-0 views) = one scan step."""
    g = torch.Generator().manual_seed(5)
    b, h, p, groups, n = 3, 4, 2, 2, 6
    x, z = torch.randn(b, h, p, generator=g), torch.randn(b, h, p, generator=g)
    dt_raw, dt_bias = torch.randn(b, h, generator=g), torch.randn(h, generator=g)
    A, D = -torch.rand(h, generator=g) * 3, torch.randn(h, generator=g)
    B, C = torch.randn(b, groups, n, generator=g), torch.randn(b, groups, n, generator=g)
    state = torch.randn(b, h, p, n, generator=g)
    want, want_state = ssd_scan_ref(x[:, None], F.softplus(dt_raw + dt_bias)[:, None], A, B[:, None], C[:, None], 4,
                                    D=D, initial_state=state)
    got_state = state.clone()
    got = selective_state_update(got_state, x, dt_raw[..., None].expand(-1, -1, p), A[:, None, None].expand(-1, p, n),
                                     B, C, D=D[:, None].expand(-1, p), z=z, dt_bias=dt_bias[:, None].expand(-1, p),
                                     dt_softplus=True)
    torch.testing.assert_close(got, want[:, 0] * F.silu(z), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


def make_mixer(seed=0, **kwargs):
    torch.manual_seed(seed)
    settings = dict(d_model=32, layer_idx=0, d_state=8, head_dim=16, n_groups=2, chunk_size=8, **kwargs)
    return spread_weights(Mamba2(**settings), seed=seed, gain=1.0)


@torch.no_grad()
@pytest.mark.parametrize("steps", [[13, 1, 1, 1, 1, 1], [8, 1, 7, 1, 9, 1]])  # prefill, decode steps, multi-token chunks
def test_cached_equals_uncached(steps):
    mixer = make_mixer().eval()
    x = torch.randn(3, sum(steps), 32)
    want = mixer(x)
    slots = [4, 0, 2]  # rows scattered over the pool
    cache = StateSlots(mixer.cache_spec(), max_batch=5, dtype=torch.float32, device="cpu")
    cache.tensors["ssm"].fill_(7.0)  # a finished request's leftovers: a prefill must not read them
    outs, start = [], 0
    for n in steps:
        positions = torch.arange(start, start + n).expand(3, n)
        outs.append(mixer(x[:, start:start + n], positions, cache, slot_batch(positions, start == 0, slots)))
        start += n
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-5, atol=1e-5)
    # rows are independent: the second sequence alone, in another slot, gives its row of the batched output
    alone = StateSlots(mixer.cache_spec(), max_batch=5, dtype=torch.float32, device="cpu")
    outs, start = [], 0
    for n in steps:
        positions = torch.arange(start, start + n).expand(1, n)
        outs.append(mixer(x[1:2, start:start + n], positions, alone, slot_batch(positions, start == 0, [3])))
        start += n
    torch.testing.assert_close(torch.cat(outs, 1), want[1:2], rtol=1e-5, atol=1e-5)
    for name in ("conv", "ssm"):
        torch.testing.assert_close(alone.tensors[name][3], cache.tensors[name][0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_decode_through_triton_kernel(monkeypatch):
    """The step as it runs on CUDA: selective_state_update's Triton kernel (interpreter on CPU) with stride-0 views."""
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    mixer = make_mixer().eval()
    x = torch.randn(2, 11, 32)
    want = mixer(x)
    cache = StateSlots(mixer.cache_spec(), max_batch=2, dtype=torch.float32, device="cpu")
    outs = []
    for start, n in ((0, 9), (9, 1), (10, 1)):
        positions = torch.arange(start, start + n).expand(2, n)
        outs.append(mixer(x[:, start:start + n], positions, cache, slot_batch(positions, start == 0, [1, 0])))
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-5, atol=1e-5)


def test_chunk_size_does_not_change_output():
    mixer = make_mixer()
    x = torch.randn(2, 45, 32)
    with torch.no_grad():
        want = mixer(x)
        for chunk_size in (1, 7, 64):
            mixer.chunk_size = chunk_size
            torch.testing.assert_close(mixer(x), want, rtol=1e-5, atol=1e-5)


def test_state_elements_and_init():
    mixer = Mamba2(d_model=48, layer_idx=0, d_state=16, d_conv=4, expand=2, head_dim=32, n_groups=3)
    d_inner, heads = 96, 3
    spec = mixer.cache_spec()
    assert spec.kind == "state" and dict(spec.state_shapes) == {"conv": (d_inner + 2 * 3 * 16, 4), "ssm": (heads, 32, 16)}
    assert spec.state_elements == (d_inner + 2 * 3 * 16) * 4 + heads * 32 * 16
    assert spec.elements(1) == spec.elements(10_000) == spec.state_elements
    A = -torch.exp(mixer.A_log)
    assert ((A <= -1) & (A >= -16)).all() and torch.equal(mixer.D, torch.ones(heads))
    dt = F.softplus(mixer.dt_bias)
    assert ((dt >= 0.001 - 1e-6) & (dt <= 0.1 + 1e-6)).all()
    assert mixer.in_proj.weight.shape == (2 * d_inner + 2 * 3 * 16 + heads, 48)
    assert mixer.conv1d.weight.shape == (d_inner + 2 * 3 * 16, 1, 4) and mixer.norm.weight.shape == (d_inner,)


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_state=0), r"d_state .* >= 1, got 0"),
    (dict(head_dim=24), r"head_dim=24 must divide expand\*d_model=64; allowed head_dim: \[1, 2, 4, 8, 16, 32, 64\]"),
    (dict(head_dim=16, n_groups=3), r"n_heads=4 .* not divisible by n_groups=3; allowed n_groups: \[1, 2, 4\]"),
    (dict(d_conv=0), r"d_conv .* >= 1, got 0"),
    (dict(chunk_size=0), r"chunk_size must be >= 1, got 0"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mamba2(d_model=32, layer_idx=0, **kwargs)


def test_no_mamba_ssm_import_on_cpu():
    mixer = make_mixer()
    with torch.no_grad():
        mixer(torch.randn(1, 9, 32))
    assert "mamba_ssm" not in sys.modules


# HF Mamba2ForCausalLM oracle.

def hf_mamba2(seed: int = 0, **overrides) -> Mamba2ForCausalLM:
    settings = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2,
                    state_size=16, n_groups=1, chunk_size=32, conv_kernel=4, layer_norm_epsilon=1e-5,
                    tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    hf = Mamba2ForCausalLM(Mamba2Config(**settings)).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Spread weights so greedy continuations vary; randomise gains and biases so a dropped mapping shows.
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("embeddings.weight"):
                p.copy_(noise)
            elif name.endswith("proj.weight") or name == "lm_head.weight":
                p.copy_(noise * 2.0 * p.shape[1] ** -0.5)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias") and "dt_bias" not in name:
                p.copy_(0.2 * noise)
    return hf


def zoo_from_hf(hf) -> DecoderLM:
    """mamba2_config + mamba2_names, as zoo.from_hf applies any converter."""
    config = mamba2_config(hf.config)
    model = DecoderLM(config)
    state = hf.state_dict()
    ours = {our: state[theirs] for theirs, our in mamba2_names(config)}
    if config.tie_embeddings:
        ours["head.weight"] = ours["embed.weight"]
    missing, unexpected = model.load_state_dict(ours, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


HF_CASES = {"groups1": dict(), "groups2_tied_bias": dict(n_groups=2, tie_word_embeddings=True, use_bias=True)}


def hf_norms_each_group() -> bool:
    """Whether this transformers' Mamba-2 gated RMSNorm normalizes each of the n_groups groups on its own, as the
    Mamba-2 reference does (mamba_ssm's RMSNormGated, group_size = d_inner / ngroups) and zoo does. Older releases
    (5.17 among them) normalize over all of d_inner, so they are no oracle for n_groups > 1."""
    return "group_size" in inspect.signature(modeling_mamba2.MambaRMSNormGated.__init__).parameters


def skip_unless_hf_oracle(case: str) -> None:
    if HF_CASES[case].get("n_groups", 1) > 1 and not hf_norms_each_group():
        pytest.skip(f"transformers {transformers.__version__}: its Mamba-2 gated norm spans all groups, unlike "
                    f"Mamba-2's per-group norm, so it is no oracle for n_groups > 1")


@pytest.fixture(scope="module", params=list(HF_CASES))
def hf_pair(request):
    skip_unless_hf_oracle(request.param)
    hf = hf_mamba2(seed=len(request.param), **HF_CASES[request.param])
    return request.param, hf, zoo_from_hf(hf)


def prompt_ids(seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hf_logits_match(hf_pair):
    name, hf, model = hf_pair
    tokens = torch.tensor([prompt_ids(), prompt_ids(2)])
    with torch.no_grad():
        want, got = hf(tokens).logits, model(tokens)
    assert got.shape == want.shape == (2, PROMPT_LEN, VOCAB)
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"{name}: logits differ from HF by {err:.3g}"
    assert want.std() > 0.5


@pytest.fixture(scope="module")
def hf_continuation(hf_pair) -> list[int]:
    _, hf, _ = hf_pair
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids()]), attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, PROMPT_LEN:].tolist()


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_hf_greedy_through_engine(hf_pair, hf_continuation, kv_cache):
    name, _, model = hf_pair
    want = hf_continuation
    assert len(want) == NEW_TOKENS
    assert_not_constant(want, name)
    engine = Engine(model, max_batch=2, max_seq_len=256, kv_cache=kv_cache, block_size=16)
    got = engine.generate([prompt_ids()], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0].token_ids
    assert got == want, f"{name}/{kv_cache}: first difference at step {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


def test_weights_round_trip_to_hf(hf_pair):
    """zoo -> HF: the names map back, so a zoo model's weights loaded into a fresh HF model give the same logits."""
    name, hf, model = hf_pair
    twin = Mamba2ForCausalLM(hf.config).float().eval()
    ours = model.state_dict()
    twin.load_state_dict({theirs: ours[our] for theirs, our in mamba2_names(model.config)},
                         strict=not model.config.tie_embeddings)
    tokens = torch.tensor([prompt_ids(3)[:40]])
    with torch.no_grad():
        err = (twin(tokens).logits - model(tokens)).abs().max().item()
    assert err <= 1e-4, f"{name}: zoo -> HF logits {err:.3g} apart"


def test_hf_config_mapped():
    hf = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_heads=4, head_dim=16,
                                        state_size=8, n_groups=2, chunk_size=16, conv_kernel=3, use_conv_bias=False,
                                        layer_norm_epsilon=1e-6))
    config = mamba2_config(hf.config)
    assert config.mlp == "none" and config.norm == "rmsnorm" and config.norm_eps == 1e-6 and config.n_layers == 3
    assert not config.tie_embeddings
    params = config.layers[0].params
    assert (params["d_state"], params["d_conv"], params["head_dim"], params["n_groups"], params["chunk_size"]) == (8, 3, 16, 2, 16)
    assert not params["conv_bias"] and "blocks.2.mixer.conv1d.bias" not in dict(mamba2_names(config)).values()


@pytest.mark.parametrize("overrides, match", [
    (dict(time_step_limit=(0.0, 0.5)), r"time_step_limit=\(0.0, 0.5\)"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
])
def test_hf_config_rejected(overrides, match):
    config = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, state_size=8,
                          n_groups=1, **overrides)
    with pytest.raises(ValueError, match=match):
        mamba2_config(config)
