"""kernels/cpu_fused.py: RMSNorm, rotary embedding and SwiGLU as one call each in an eager CPU decode step, checked
against torch's own composition of the same ops (the modules' path with the fused ops turned off) and a float64
oracle, and the dispatch that decides where they serve."""
import pytest
import torch
import torch.nn.functional as F

import zoo
from attention.norm import RMSNorm
from attention.rope import RotaryEmbedding, apply_rope
from harness.decode_probe import decode_probe
from kernels import cpu_blocks, cpu_decode, cpu_fused, cpu_kernels_available
from zoo.ffn.swiglu import PROJECTIONS, SwiGLU
from zoo.quantize import QuantizeConfig, quantize

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C kernels did not build here (a warning "
                                                                     "said why)")
BF16_STEP = 2**-7  # bf16's relative spacing: one rounding moves a value by at most half of it


@pytest.fixture
def unfused(monkeypatch):
    """Turns the fused ops off, so the modules run torch's ops."""
    monkeypatch.setattr(cpu_fused, "fused_path", lambda *args, **kwargs: False)


def rms_norm_oracle(x, weight, eps):
    x64 = x.double()
    return weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 512), (4, 1, 96), (16, 1030)])
def test_rms_norm_equals_torch_and_the_oracle(dtype, shape):
    generator = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], eps=1e-6).to(dtype)
    norm.weight.data = (1 + torch.randn(shape[-1], generator=generator)).to(dtype)
    x = (3 * torch.randn(*shape, generator=generator)).to(dtype)
    with torch.inference_mode():
        got = cpu_fused.rms_norm(x, norm.weight, norm.eps)
        xf = x.float()  # RMSNorm.forward's torch ops
        want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)
    assert got.shape == x.shape and got.dtype == dtype
    oracle = rms_norm_oracle(x, norm.weight, norm.eps)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(got.double(), oracle, rtol=2e-6, atol=1e-6)
    else:  # two bf16 roundings (before and after the gain), as torch's; a mean's last bit may flip the first
        assert ((got.double() - want.double()).abs() <= BF16_STEP * want.double().abs()).all()
        assert ((got.double() - oracle).abs() <= 1.5 * BF16_STEP * oracle.abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,seq,dim", [(4, 1, 64), (2, 3, 128), (1, 1, 32)])
def test_rotary_equals_torch(dtype, heads, seq, dim):
    generator = torch.Generator().manual_seed(dim + seq)
    rope = RotaryEmbedding(dim)
    x = torch.randn(3, seq, heads, dim, generator=generator).to(dtype).transpose(1, 2)  # a projection's view
    positions = torch.randint(0, 40000, (3, seq), generator=generator)
    with torch.inference_mode():
        got = cpu_fused.rotary(x, positions, rope.inv_freq)
        cos, sin = rope(positions, dtype)
        want = apply_rope(x, cos, sin)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:  # a cosine or sine may differ in its last bit from torch's vectorized one
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # ... which can move a bf16 cos or sin, and so each rounded product, by one step
        assert ((got.float() - want.float()).abs() <= 2 * BF16_STEP * x.float().abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_swiglu_is_bit_identical_to_its_three_gemvs(dtype, rows, unfused):
    generator = torch.Generator().manual_seed(rows)
    ffn = SwiGLU(96, 200).to(dtype).eval()
    x = torch.randn(rows, 1, 96, generator=generator).to(dtype)
    with torch.inference_mode():
        want = ffn(x)  # the module's own path: three Linear calls on the C GEMV, F.silu, *
        got = cpu_fused.swiglu_gemv(x, ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), ffn.reference(x), rtol=1e-4 if dtype == torch.float32 else 3e-2,
                               atol=1e-4 if dtype == torch.float32 else 3e-2)


def test_the_cpp_and_python_glue_agree():
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, weight = torch.randn(3, 1, 128, generator=generator).to(dtype), torch.randn(128).to(dtype)
        assert torch.equal(cpu_fused.rms_norm_op(x, weight, 1e-5), cpu_fused.rms_norm_eager(x, weight, 1e-5))
        q, positions = torch.randn(3, 4, 1, 64).to(dtype), torch.tensor([[5], [700], [2**20]])
        inv_freq = RotaryEmbedding(64).inv_freq
        assert torch.equal(cpu_fused.rotary_op(q, positions, inv_freq), cpu_fused.rotary_eager(q, positions, inv_freq))
        shapes = ((64, 128), (64, 128), (128, 64))
        gate, up, down = (torch.randn(*shape, generator=generator).to(dtype) for shape in shapes)
        assert torch.equal(cpu_fused.swiglu_gemv_op(x, gate, up, down), cpu_fused.swiglu_gemv_eager(x, gate, up, down))


@pytest.mark.parametrize("glue", ["op", "eager"])
def test_bad_input_is_refused_with_the_sizes(glue):
    rms_norm = cpu_fused.rms_norm_op if glue == "op" else cpu_fused.rms_norm_eager
    rotary = cpu_fused.rotary_op if glue == "op" else cpu_fused.rotary_eager
    with pytest.raises(ValueError, match="weight .* of 63 must match x's dtype .* and width 64"):
        rms_norm(torch.randn(2, 64), torch.randn(63), 1e-5)
    with pytest.raises(ValueError, match="float16 is beyond the CPU kernel"):
        rms_norm(torch.randn(2, 64).half(), torch.randn(64).half(), 1e-5)
    with pytest.raises(ValueError, match=r"must be \[B, H, T, D\] with positions \[B, T\]"):
        rotary(torch.randn(2, 4, 1, 64), torch.zeros(2, 2, dtype=torch.long), torch.ones(32))
    with pytest.raises(ValueError, match="head_dim 2048 .* is beyond the CPU kernel"):
        rotary(torch.randn(1, 1, 1, 2048), torch.zeros(1, 1, dtype=torch.long), torch.ones(1024))


def test_where_the_fused_ops_serve():
    x, weight = torch.randn(1, 1, 64), torch.ones(64)
    with torch.inference_mode():
        assert cpu_fused.fused_path(x, 1, weight)
        assert cpu_fused.fused_path(x, 16, weight)
        assert not cpu_fused.fused_path(x, 17, weight)  # a prefill's rows keep torch's threaded kernels
        assert not cpu_fused.fused_path(x.half(), 1, weight.half())
        assert not cpu_fused.fused_path(x, 1, weight.bfloat16())  # a parameter in another dtype
        assert not cpu_fused.fused_path(torch.randn(1, 1, 64, device="meta"), 1)
    trainable = torch.ones(64, requires_grad=True)
    assert not cpu_fused.fused_path(x, 1, trainable)  # a gradient to record
    with torch.no_grad():
        assert cpu_fused.fused_path(x, 1, trainable)


def test_a_quantized_swiglu_keeps_its_own_layers():
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    assert cpu_blocks.half_weights(model.blocks[0].mlp, None, PROJECTIONS) is not None
    assert cpu_blocks.half_weights(quantize(model, QuantizeConfig(weights="int8")).blocks[0].mlp, None,
                                   PROJECTIONS) is None


@pytest.mark.parametrize("arch", ["gqa", "mla", "cla", "swa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_matches_torchs_ops(arch, dtype, monkeypatch):
    """A model's eager decode step with the fused ops against the same step with torch's ops (one step of the engine's
    contiguous-cache decode, from the same cache)."""
    torch.manual_seed(0)
    model = zoo.build(arch, preset="tiny").to(dtype).eval()
    logits = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(cpu_fused, "fused_path", lambda *args, **kwargs: False)
        torch.manual_seed(1)
        probe = decode_probe(model, 2, 40, "contiguous", 16, compile=False, cuda_graphs=False)
        logits[fused] = probe.engine.runner.decode(probe.seqs).float()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(logits[True], logits[False], rtol=tolerance, atol=tolerance)
