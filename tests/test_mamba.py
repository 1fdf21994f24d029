"""Mamba (v1): the scan against a per-step loop written from the math, cached decode against the full forward,
HF MambaForCausalLM parity (logits and greedy tokens through the engine), bad settings, no mamba_ssm on CPU."""
import importlib.abc
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import MambaConfig, MambaForCausalLM

import ssm.mamba
import zoo
import zoo.hf
import zoo.model
from cache.state_slots import StateSlots
from harness import Engine, SamplingParams
from ssm.mamba import Mamba
from zoo.config import MixerSpec, ModelConfig
from zoo.hf_mamba import mamba_config, mamba_names
from zoo.model import DecoderLM
from batches import slot_batch  # tests/ is on sys.path under pytest
from helpers import spread_weights  # tests/ is on sys.path under pytest

VOCAB = 256
PROMPT_LEN = 128
NEW_TOKENS = 64


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """Until zoo.hf registers the "mamba" converter (the lead's change), register it for these tests."""
    if "mamba" not in zoo.hf.CONVERTERS:
        monkeypatch.setitem(zoo.hf.CONVERTERS, "mamba", zoo.hf.Converter(mamba_config, mamba_names))


@torch.no_grad()
def random_mamba(seed: int = 0, dtype=torch.float32, **kwargs) -> Mamba:
    torch.manual_seed(seed)
    m = Mamba(kwargs.pop("d_model", 32), 0, **kwargs).to(dtype)
    for p in m.parameters():  # every weight random (biases, D included), so a dropped term shows
        if p is not m.A_log:
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
    return m.eval()


@torch.no_grad()
def naive_mamba(m: Mamba, u: torch.Tensor) -> torch.Tensor:
    """The recurrence one step at a time, straight from the definition, in float64."""
    p = {k: v.double() for k, v in m.state_dict().items()}
    u = u.double()
    b, t, _ = u.shape
    xz = u @ p["in_proj.weight"].T + p.get("in_proj.bias", 0)
    x, z = xz[..., : m.d_inner], xz[..., m.d_inner:]
    w = p["conv1d.weight"][:, 0]  # [d_inner, d_conv]; tap k multiplies the input k - (d_conv - 1) steps back
    A = -torch.exp(p["A_log"])
    out = torch.zeros(b, t, m.d_inner, dtype=torch.float64)
    for row in range(b):
        h = torch.zeros(m.d_inner, m.d_state, dtype=torch.float64)
        for i in range(t):
            xc = p.get("conv1d.bias", torch.zeros(m.d_inner)).clone()
            for k in range(m.d_conv):
                j = i - (m.d_conv - 1) + k
                if j >= 0:
                    xc = xc + w[:, k] * x[row, j]
            xc = xc * torch.sigmoid(xc)
            proj = p["x_proj.weight"] @ xc
            dt_in, B, C = proj[: m.dt_rank], proj[m.dt_rank: m.dt_rank + m.d_state], proj[m.dt_rank + m.d_state:]
            dt = torch.log1p(torch.exp(p["dt_proj.weight"] @ dt_in + p["dt_proj.bias"]))
            h = torch.exp(dt[:, None] * A) * h + (dt * xc)[:, None] * B[None, :]
            y = h @ C + p["D"] * xc
            out[row, i] = y * z[row, i] * torch.sigmoid(z[row, i])
    return out @ p["out_proj.weight"].T + p.get("out_proj.bias", 0)


@pytest.mark.parametrize("settings", [dict(), dict(bias=True, d_conv=3, dt_rank=5), dict(conv_bias=False, d_state=4)])
def test_scan_matches_naive_loop(settings):
    m = random_mamba(**settings)
    u = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(1))
    want = naive_mamba(m, u)
    got = m.double()(u.double())
    assert (got - want).abs().max().item() < 1e-10
    got32 = m.float()(u)
    assert (got32.double() - want).abs().max().item() < 1e-4


def test_training_path_equals_inference_path_and_has_gradients():
    """Under autograd the scan keeps every state for its hand-written backward (ssm/scan.py); without, it keeps
    only the last: same output, and gradcheck (finite differences) holds for both outputs, y and the final state."""
    m = random_mamba(d_model=16, d_state=4).double()
    u = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        inference = m(u)
    training = m(u)
    assert (training - inference).abs().max().item() < 1e-12
    training.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    dt = F.softplus(torch.randn(2, 4, 3, dtype=torch.float64))
    inputs = [torch.randn(2, 4, 3, dtype=torch.float64), dt, -torch.rand(3, 2, dtype=torch.float64),
              torch.randn(2, 4, 2, dtype=torch.float64), torch.randn(2, 4, 2, dtype=torch.float64),
              torch.randn(3, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64),
              torch.randn(2, 3, 2, dtype=torch.float64)]
    for t in inputs:
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: ssm.mamba.selective_scan(*a), inputs)


def slots_batch(slots, lengths, new, prefill):
    """CacheBatch for rows in `slots` whose sequences reach `lengths` after `new` tokens each (as the engine builds it)."""
    positions = torch.stack([torch.arange(n - k, n - k + max(new)) for n, k in zip(lengths, new)])
    return slot_batch(positions, prefill, slots, lengths)


@torch.no_grad()
def test_cached_prefill_then_steps_match_full_forward():
    m = random_mamba(d_model=48, d_state=8)
    u = torch.randn(1, 20, 48, generator=torch.Generator().manual_seed(3))
    full = m(u)
    cache = StateSlots(m.cache_spec(), max_batch=3, dtype=torch.float32, device="cpu")
    cache.tensors["ssm"].fill_(7.0)  # a finished request's leftovers: prefill must start from zeros
    cache.tensors["conv"].fill_(7.0)
    prompt = 6
    outs = [m(u[:, :prompt], cache=cache, batch=slots_batch([2], [prompt], [prompt], True))]
    for i in range(prompt, 20):
        outs.append(m(u[:, i: i + 1], cache=cache, batch=slots_batch([2], [i + 1], [1], False)))
    err = (torch.cat(outs, dim=1) - full).abs().max().item()
    assert err <= 1e-5, f"prefill + decode steps differ from the full forward by {err:.3g}"
    # a multi-token continuation from a cached state (chunked prefill) runs the scan from that state
    cache2 = StateSlots(m.cache_spec(), max_batch=1, dtype=torch.float32, device="cpu")
    first = m(u[:, :9], cache=cache2, batch=slots_batch([0], [9], [9], True))
    rest = m(u[:, 9:], cache=cache2, batch=slots_batch([0], [20], [11], False))
    assert (torch.cat([first, rest], dim=1) - full).abs().max().item() <= 1e-5


@torch.no_grad()
def test_mixed_lengths_rows_independent():
    """Prefill a right-padded batch of unequal prompts into non-consecutive slots, decode them together:
    each row equals its sequence run alone; the padding never reaches a row's state."""
    m = random_mamba(d_model=32, d_conv=4)
    lengths = [2, 9, 5]  # 2 < d_conv: the conv state keeps zeros from before the first token
    slots = [2, 0, 3]
    seqs = [torch.randn(1, n + 4, 32, generator=torch.Generator().manual_seed(10 + n)) for n in lengths]
    cache = StateSlots(m.cache_spec(), max_batch=4, dtype=torch.float32, device="cpu")
    padded = torch.zeros(3, max(lengths), 32)
    for row, (s, n) in enumerate(zip(seqs, lengths)):
        padded[row, :n] = s[0, :n]
        padded[row, n:] = 100.0  # garbage after each row's end
    out = m(padded, cache=cache, batch=slots_batch(slots, lengths, lengths, True))
    steps = []
    for i in range(4):
        x = torch.cat([s[:, n + i: n + i + 1] for s, n in zip(seqs, lengths)])
        steps.append(m(x, cache=cache, batch=slots_batch(slots, [n + i + 1 for n in lengths], [1, 1, 1], False)))
    steps = torch.cat(steps, dim=1)
    for row, (s, n) in enumerate(zip(seqs, lengths)):
        alone = m(s)
        assert (out[row, :n] - alone[0, :n]).abs().max() <= 1e-5
        assert (steps[row] - alone[0, n:]).abs().max() <= 1e-5, f"row {row} (prompt {n}) decode differs"


def test_cache_spec_and_init():
    m = Mamba(40, 3, d_state=8, d_conv=3, expand=2)
    spec = m.cache_spec()
    assert spec.kind == "state" and dict(spec.state_shapes) == {"conv": (80, 3), "ssm": (80, 8)}
    assert spec.state_elements == 80 * 3 + 80 * 8 and spec.elements_per_token == 0
    assert m.dt_rank == 3  # ceil(40 / 16)
    assert torch.equal(m.A_log[5], torch.log(torch.arange(1.0, 9.0))) and torch.equal(m.D, torch.ones(80))
    dt = F.softplus(m.dt_proj.bias)
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    names = {k for k, _ in m.named_parameters()}
    assert names == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                     "dt_proj.bias", "A_log", "D", "out_proj.weight"}


def mamba_layers(n=2, **params):
    return [MixerSpec("mamba", dict(params)) for _ in range(n)]


def test_dt_init_survives_model_init():
    """DecoderLM's init re-draws every Linear; the time-step bias is marked (`_no_reinit`) and must keep its range."""
    model = DecoderLM(ModelConfig(vocab_size=64, d_model=32, layers=mamba_layers(), mlp="none"))
    for block in model.blocks:
        dt = F.softplus(block.mixer.dt_proj.bias)
        assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4), "dt_proj.bias was re-initialised"


@pytest.mark.parametrize("bad, match", [
    (dict(d_state=0), "d_state=0"), (dict(d_conv=-1), "d_conv=-1"), (dict(expand=0), "expand=0"),
    (dict(dt_rank=0), "dt_rank=0"), (dict(dt_min=0.2, dt_max=0.1), "dt_min=0.2"),
])
def test_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        Mamba(32, 0, **bad)


class ImportBlocker(importlib.abc.MetaPathFinder):
    """Records (and refuses) any attempt to import the CUDA-only packages."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mamba_ssm", "causal_conv1d"):
            self.attempts.append(name)
            raise ImportError(f"blocked {name}")
        return None


def test_cpu_never_imports_mamba_ssm(monkeypatch):
    blocker = ImportBlocker()
    monkeypatch.setattr(sys, "meta_path", [blocker, *sys.meta_path])
    ssm.mamba.cuda_kernels.cache_clear()
    model = DecoderLM(ModelConfig(vocab_size=64, d_model=32, layers=mamba_layers(), mlp="none")).eval()
    engine = Engine(model, max_batch=2, max_seq_len=32)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0))
    with torch.no_grad():
        model(torch.tensor([[4, 5, 6]]))
    assert blocker.attempts == [] and "mamba_ssm" not in sys.modules and "causal_conv1d" not in sys.modules


# HF MambaForCausalLM oracle


def hf_mamba_config(**overrides) -> MambaConfig:
    settings = dict(vocab_size=VOCAB, hidden_size=64, state_size=16, num_hidden_layers=3, expand=2, conv_kernel=4,
                    use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
                    pad_token_id=0, bos_token_id=0, eos_token_id=0)
    settings.update(overrides)
    return MambaConfig(**settings)


@torch.no_grad()
def random_hf_mamba(seed=0, **overrides) -> MambaForCausalLM:
    torch.manual_seed(seed)
    hf = MambaForCausalLM(hf_mamba_config(**overrides)).float()
    dt_weights = {n: p.clone() for n, p in hf.named_parameters() if n.endswith("dt_proj.weight")}
    spread_weights(hf, seed=seed)
    # dt_proj keeps HF's init (uniform +-rank^-0.5): spread to unit scale, dt swings by e^+-3 and fp32 rounding
    # alone moves the logits by ~1e-4 over 128 tokens
    hf.load_state_dict(dt_weights, strict=False)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in hf.named_parameters():  # norms, biases, D randomised: a dropped or swapped mapping shows
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias") and "dt_proj" not in name:
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return hf.eval()


def prompt_ids(seed=1) -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_pair():
    """(HF model, zoo model, HF greedy continuation), built once."""
    hf = random_hf_mamba()
    model = DecoderLM(mamba_config(hf.config))
    state = hf.state_dict()
    model.load_state_dict({ours: state[theirs] for theirs, ours in mamba_names(model.config)})
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt_ids()]), attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return hf, model.eval(), generated[0, PROMPT_LEN:].tolist()


def test_from_hf_logits_match(hf_pair):
    hf, _, _ = hf_pair
    model = zoo.from_hf(hf).eval()  # through zoo.hf's registry entry
    assert [s.kind for s in model.config.layers] == ["mamba"] * 3 and model.blocks[0].mlp is None
    tokens = torch.tensor([prompt_ids(), prompt_ids(seed=2)])
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"logits differ from HF by {err:.3g}"
    assert want.std() > 0.5


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_greedy_matches_hf_generate(hf_pair, kv_cache):
    hf, model, want = hf_pair
    assert len(want) == NEW_TOKENS and len(set(want)) > 8, f"HF continuation nearly constant {want}"
    engine = Engine(model, max_batch=2, max_seq_len=256, kv_cache=kv_cache, block_size=16)
    got = engine.generate([prompt_ids()], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0].token_ids
    assert got == want, f"{kv_cache}: first difference at step {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


@pytest.mark.parametrize("overrides", [dict(tie_word_embeddings=True, num_hidden_layers=2),
                                       dict(use_bias=True, use_conv_bias=False, num_hidden_layers=2, conv_kernel=3,
                                            time_step_rank=6)])
def test_variants_and_reverse_mapping(overrides):
    hf = random_hf_mamba(seed=5, **overrides)
    model = zoo.from_hf(hf).eval()
    tokens = torch.tensor([prompt_ids()[:40]])
    with torch.no_grad():
        want = hf(tokens).logits
        assert (model(tokens) - want).abs().max().item() <= 1e-4
        # zoo -> a freshly initialised HF twin: same logits
        twin = MambaForCausalLM(hf.config).float().eval()
        zoo.hf.copy_weights_to_hf(model, twin)
        assert (twin(tokens).logits - want).abs().max().item() <= 1e-4
    if hf.config.tie_word_embeddings:
        assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()


def test_hf_unsupported_activation():
    with pytest.raises(ValueError, match="hidden_act"):
        mamba_config(hf_mamba_config(hidden_act="gelu"))


def test_zoo_built_mamba_to_hf():
    """A registry-built model (dt_rank left to its default) copies into HF's Mamba; one with MLPs is refused."""
    model = zoo.build("mamba", preset="tiny", mlp="none").eval()
    c, mixer = model.config, model.blocks[0].mixer
    hf = MambaForCausalLM(hf_mamba_config(
        vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers, state_size=mixer.d_state,
        conv_kernel=mixer.d_conv, expand=mixer.d_inner // c.d_model, tie_word_embeddings=c.tie_embeddings,
    )).float().eval()
    zoo.hf.copy_weights_to_hf(model, hf)
    tokens = torch.randint(0, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="mlp: zoo swiglu vs HF none"):
        zoo.hf.copy_weights_to_hf(zoo.build("mamba", preset="tiny", mlp="swiglu"), hf)
