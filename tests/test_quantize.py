"""Weight-only quantization (zoo.quantize): the packed CPU kernels equal the dequantize-then-multiply references,
rounding stays within half a step, every causal architecture's quantized model decodes through the engine exactly
as its own full forward in both layouts, the bytes counted are the bytes stored, and activation-aware scales never
do worse than plain rounding on their calibration data."""
import sys

import pytest
import torch

import zoo
from harness import Engine
from helpers import greedy, make_prompts, random_model
from kernels.quantized_matmul import (int4_cpu_layout, int4_dequantize, int4_matmul, int4_matmul_ref, int8_matmul,
                                      int8_matmul_ref, pack_int4, unpack_int4)
from zoo.quantize import QuantizedLinear, plain_linear, quantize_int4, quantize_int8

ARCHS = [name for name in zoo.architectures() if zoo.is_causal(name)]
SCHEMES = [zoo.QuantizeConfig("int8"), zoo.QuantizeConfig("int4", group_size=32)]


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (48, 64))
    assert torch.equal(unpack_int4(pack_int4(q)), q.to(torch.int32))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])  # bf16: scales rounded, ~4e-3 seen
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_packed_cpu_kernels_equal_the_references(dtype, atol, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 256, generator=generator)
    x = torch.randn(rows, 256, generator=generator).to(dtype)
    q8, scales8 = quantize_int8(weight)
    want = int8_matmul_ref(x.float(), q8, scales8)
    assert (int8_matmul(x, q8, scales8.to(dtype)).float() - want).abs().max() < atol * want.abs().max().clamp_min(1)
    q4, scales4, zeros4 = quantize_int4(weight, 64)
    want = int4_matmul_ref(x.float(), q4, scales4, zeros4, 64)
    layout = int4_cpu_layout(q4, scales4, zeros4)
    got = int4_matmul(x, q4, scales4.to(dtype), zeros4.to(dtype), 64, (layout[0], layout[1].to(dtype)))
    assert (got.float() - want).abs().max() < atol * want.abs().max().clamp_min(1)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("group", [0, 32, 64, 128])
def test_c_gemv_equals_the_reference(dtype, atol, rows, group):
    """The CPU GEMVs against dequantize-then-multiply: int8 (group 0, kernels/cpu/dense_gemv.c's int8_gemv) and int4
    in every group size (kernels/cpu/quantized_gemv.c), 103 output channels (a partial last tile of 4), up to the 16
    rows they serve."""
    from kernels import cpu_decode, cpu_kernels_available
    if not cpu_kernels_available():
        pytest.skip("no C compiler: the CPU kernels did not build")
    generator = torch.Generator().manual_seed(rows + group)
    weight = torch.randn(103, 256, generator=generator)
    x = torch.randn(rows, 256, generator=generator).to(dtype)
    if group:
        q, scales, zeros = quantize_int4(weight, group)
        want = int4_matmul_ref(x.float(), q, scales, zeros, group)
        got = cpu_decode.quantized_gemv(x, q, scales.to(dtype), zeros.to(dtype), group)
    else:
        q, scales = quantize_int8(weight)
        want = int8_matmul_ref(x.float(), q, scales)
        got = cpu_decode.quantized_gemv(x, q, scales.to(dtype), None, 0)
    assert got.dtype == dtype and got.shape == (rows, 103)
    assert (got.float() - want).abs().max() < atol * want.abs().max()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 4, 40])
@pytest.mark.parametrize("k", [100, 1030])
def test_int8_gemv_takes_any_width(dtype, atol, rows, k):
    """int8_gemv sums whole 64-byte lines in vectors and the rest in scalar, over several K blocks (1030 columns),
    and past 16 rows passes over the weight again."""
    from kernels import cpu_decode, cpu_kernels_available
    if not cpu_kernels_available():
        pytest.skip("no C compiler: the CPU kernels did not build")
    generator = torch.Generator().manual_seed(rows + k)
    q, scales = quantize_int8(torch.randn(37, k, generator=generator))
    x = torch.randn(rows, k, generator=generator).to(dtype)
    want = int8_matmul_ref(x.float(), q, scales)
    got = cpu_decode.quantized_gemv(x, q, scales.to(dtype), None, 0)
    assert got.dtype == dtype and got.shape == (rows, 37)
    assert (got.float() - want).abs().max() < atol * want.abs().max()


def test_decode_sized_inputs_run_the_c_gemvs(monkeypatch):
    """At decode sizes int8 goes to the C GEMV in every float dtype and int4 in fp32 and fp16 (torch's packed int4
    kernel is fast for bf16); larger inputs to dequantize-then-multiply (fp32) or torch's packed kernel (bf16)."""
    from kernels import cpu_decode, cpu_kernels_available, quantized_matmul
    if not cpu_kernels_available():
        pytest.skip("no C compiler: the CPU kernels did not build")
    calls = []
    for name in ("quantized_gemv", "quantized_gemv_eager"):  # the op (its C++ glue) or the plain function
        real = getattr(cpu_decode, name)
        monkeypatch.setattr(cpu_decode, name, lambda *args, real=real: calls.append((args[0].shape, args[0].dtype,
                                                                                     args[4])) or real(*args))
    weight = torch.randn(64, 128)
    q8, scales8 = quantize_int8(weight)
    q4, scales4, zeros4 = quantize_int4(weight, 32)
    quantized_matmul.int8_matmul(torch.randn(2, 1, 128), q8, scales8)
    quantized_matmul.int8_matmul(torch.randn(40, 128), q8, scales8)  # prefill-sized: the dense multiply
    quantized_matmul.int8_matmul(torch.randn(1, 128).bfloat16(), q8, scales8.bfloat16())
    quantized_matmul.int8_matmul(torch.randn(40, 128).bfloat16(), q8, scales8.bfloat16())  # torch's packed kernel
    quantized_matmul.int4_matmul(torch.randn(3, 128), q4, scales4, zeros4, 32)
    layout = int4_cpu_layout(q4, scales4.bfloat16(), zeros4.bfloat16())
    quantized_matmul.int4_matmul(torch.randn(3, 128).bfloat16(), q4, scales4.bfloat16(), zeros4.bfloat16(), 32,
                                 layout)  # torch's packed int4 kernel
    assert calls == [((2, 1, 128), torch.float32, 0), ((1, 128), torch.bfloat16, 0), ((3, 128), torch.float32, 32)]


def test_rounding_is_within_half_a_step():
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 3
    q8, scales8 = quantize_int8(weight)
    assert ((q8.float() * scales8[:, None] - weight).abs() <= scales8[:, None] / 2 + 1e-6).all()
    q4, scales4, zeros4 = quantize_int4(weight, 32)
    error = (int4_dequantize(q4, scales4, zeros4, 32, torch.float32) - weight).abs().unflatten(-1, (-1, 32))
    assert (error <= scales4[..., None] / 2 + 1e-6).all()
    layer = QuantizedLinear(plain_linear(weight), "int4", 32)
    assert torch.allclose(layer.weight, int4_dequantize(q4, scales4, zeros4, 32, torch.float32))


@pytest.mark.parametrize("config", SCHEMES, ids=["int8", "int4-g32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_models_decode_as_their_own_full_forward(arch, config):
    model = zoo.quantize(random_model(arch, seed=1), config)
    assert any(isinstance(m, QuantizedLinear) for m in model.modules())
    prompts = make_prompts([5, 17], model.config.vocab_size, seed=1)
    runs = {}
    for layout in ("contiguous", "paged"):
        runs[layout] = Engine(model, max_batch=2, max_seq_len=64, kv_cache=layout).generate(prompts, greedy(10))
        for prompt, out in zip(prompts, runs[layout]):
            with torch.no_grad():
                full = model(torch.tensor([prompt + out.token_ids[:-1]]))[0, len(prompt) - 1:]
            assert (full - torch.stack(out.logits)).abs().max() < 1e-4, f"{arch} {config.weights} {layout}"
    assert [o.token_ids for o in runs["paged"]] == [o.token_ids for o in runs["contiguous"]]


@pytest.mark.parametrize("config", SCHEMES + [zoo.QuantizeConfig("int4", group_size=64, head=True)],
                         ids=["int8", "int4-g32", "int4-g64-head"])
def test_weight_bytes_count_the_quantized_payload_and_scales(config):
    model = random_model("gqa", seed=2)
    quantized = zoo.quantize(model, config)
    expected = zoo.parameter_bytes(model)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (name.startswith("blocks.") or name == "head" and config.head):
            n, k = module.weight.shape
            per_row = k + 4 if config.weights == "int8" else k // 2 + 2 * 4 * (k // config.group_size)
            expected += n * per_row - module.weight.nbytes
    assert zoo.parameter_bytes(quantized) == expected
    assert zoo.decode_weight_bytes(quantized) == expected - quantized.embed.weight.nbytes  # untied: one row read


@pytest.mark.parametrize("weights,group", [("int8", 128), ("int4", 32)])
def test_activation_aware_scales_do_no_worse_than_rounding(weights, group):
    """On its calibration tokens the AWQ model's next-token distributions diverge from the unquantized model's no more
    than round to nearest's, and its top tokens agree with the unquantized model's no less often (alpha 0 is among
    the candidates it picks from); with an outlier input channel, the case AWQ is for, it keeps scales and diverges
    less."""
    model = random_model("gqa", seed=3)
    with torch.no_grad():  # an outlier input channel
        model.blocks[0].mixer_norm.weight[5] = 8.0
    tokens = torch.tensor(make_prompts([64] * 4, model.config.vocab_size, seed=5))
    rtn = zoo.quantize(model, zoo.QuantizeConfig(weights, group_size=group))
    awq = zoo.quantize(model, zoo.QuantizeConfig(weights, group_size=group, method="awq"), calibration=tokens)
    assert any(m.input_scale is not None for m in awq.modules() if isinstance(m, QuantizedLinear))

    with torch.no_grad():
        want = model(tokens).log_softmax(-1)

        def divergence(m):
            return torch.nn.functional.kl_div(m(tokens).log_softmax(-1), want, log_target=True, reduction="batchmean")

        def agreement(m):
            return (m(tokens).argmax(-1) == want.argmax(-1)).float().mean()

        assert divergence(awq) < divergence(rtn)
        assert agreement(awq) >= agreement(rtn)


def test_a_score_keeps_only_candidates_that_score_no_lower_than_rounding():
    """Given a score, AWQ takes the least divergent candidate that scores no lower than plain rounding: a score only
    plain rounding's outputs reach gives plain rounding's weights exactly; a score every candidate ties on changes
    nothing."""
    model = random_model("gqa", seed=3)
    with torch.no_grad():
        model.blocks[0].mixer_norm.weight[5] = 8.0  # an outlier input channel: without a score AWQ keeps scales
    tokens = torch.tensor(make_prompts([64] * 4, model.config.vocab_size, seed=5))
    config = zoo.QuantizeConfig("int4", group_size=32, method="awq")
    rtn = zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=32))
    with torch.no_grad():
        rtn_logits = rtn(tokens)
    calls = []

    def like_rounding(m):
        calls.append(1)
        with torch.no_grad():
            return -float((m(tokens) - rtn_logits).abs().max())

    plain = zoo.quantize(model, config, tokens, score=like_rounding)
    assert len(calls) >= 2  # plain rounding's own score, and at least one candidate turned down
    for name, tensor in rtn.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name
    assert all(m.input_scale is None for m in plain.modules() if isinstance(m, QuantizedLinear))
    unscored = zoo.quantize(model, config, tokens)
    tied = zoo.quantize(model, config, tokens, score=lambda m: 0.0)
    for name, tensor in unscored.state_dict().items():
        assert torch.equal(tied.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="score ranks AWQ's candidates; method='rtn'"):
        zoo.quantize(model, zoo.QuantizeConfig("int8"), score=lambda m: 0.0)


def test_clip_search_lowers_each_groups_output_error():
    """AWQ's clip search (int4): every bound lies within its group's max |w|, a group whose range a lone large weight
    on a quiet input channel stretches is clipped, and no group's share of the output is further from the float one
    than without clipping (the full range is one of the candidates)."""
    from zoo.quantize import awq_clips, clip_groups
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(24, 128, generator=generator)
    weight[3, 5] = 12.0  # stretches its group's range, so the other 31 weights round coarsely
    x = torch.randn(512, 128, generator=generator)
    x[:, 5] *= 0.01  # and its input is quiet: clipping it costs less than the coarse rounding
    bounds = awq_clips({"layer": plain_linear(weight)}, {"layer": x}, {}, 32)["layer"]
    top = weight.unflatten(-1, (-1, 32)).abs().amax(dim=-1)
    assert bounds.shape == (24, 4) and (bounds <= top + 1e-6).all() and bounds[3, 0] < top[3, 0]

    def group_errors(w):
        dq = int4_dequantize(*quantize_int4(w, 32), 32, torch.float32)
        return torch.einsum("tgk,ngk->tng", x.unflatten(-1, (-1, 32)),
                            (dq - weight).unflatten(-1, (-1, 32))).pow(2).mean(dim=0)

    assert (group_errors(clip_groups(weight, bounds, 32)) <= group_errors(weight) * (1 + 1e-5)).all()


@pytest.mark.parametrize("arch", ["gqa", "mla", "linear", "hybrid"])
def test_awq_clip_search_leaves_query_and_key_projections_unclipped(arch, monkeypatch):
    """As in AWQ's own code, the clip search skips the layers whose outputs meet in a query-key product (attention's
    q and k projections; MLA's query and latent projections, whose latent feeds the keys) and sees every other
    quantized layer (o_proj, the MLP, a recurrent mixer's projections)."""
    quantize_module = sys.modules["zoo.quantize"]
    search, searched = quantize_module.awq_clips, set()

    def recording(layers, *args):
        searched.update(layers)
        return search(layers, *args)

    monkeypatch.setattr(quantize_module, "awq_clips", recording)
    model = random_model(arch)
    tokens = torch.tensor(make_prompts([32] * 2, model.config.vocab_size, seed=1))
    quantized = zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=32, method="awq"), calibration=tokens)
    query_key = {"q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
    names = {name for name, m in quantized.named_modules() if isinstance(m, QuantizedLinear)}
    assert names & {n for n in names if n.rpartition(".")[2] in query_key}, "the model has query or key projections"
    assert searched == {n for n in names if n.rpartition(".")[2] not in query_key}


def test_bad_quantization_settings_are_errors_before_work():
    with pytest.raises(ValueError, match="unknown weights"):
        zoo.QuantizeConfig("int3")
    with pytest.raises(ValueError, match="unknown group_size 48"):
        zoo.QuantizeConfig("int4", group_size=48)
    with pytest.raises(ValueError, match="unknown method"):
        zoo.QuantizeConfig("int8", method="gptq")
    model = random_model("gqa", seed=4, d_model=96, n_heads=4, mlp_hidden=192)
    with pytest.raises(ValueError, match=r"group_size=64 does not divide the input width 96 .*allowed group sizes: \[32\]"):
        zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=64))
    with pytest.raises(ValueError, match="calibration"):
        zoo.quantize(model, zoo.QuantizeConfig("int8", method="awq"))
    with pytest.raises(ValueError, match="calibration"):
        zoo.quantize(model, zoo.QuantizeConfig("int8", method="awq"), calibration=torch.tensor([[1, 9999]]))
    with pytest.raises(ValueError, match="QuantizeConfig"):
        zoo.quantize(model, "int8")
    with pytest.raises(ValueError, match="not both"):
        zoo.quantize(model, zoo.QuantizeConfig("int8"), weights="int4")
    with pytest.raises(ValueError, match="unknown weights"):
        zoo.quantize(model, weights="int2")


def test_keyword_settings_equal_a_config():
    model = random_model("gqa", seed=8)
    by_keywords = zoo.quantize(model, weights="int4", group_size=32)
    by_config = zoo.quantize(model, zoo.QuantizeConfig("int4", group_size=32))
    assert by_keywords.quantization == by_config.quantization
    for a, b in zip(by_keywords.state_dict().values(), by_config.state_dict().values()):
        assert torch.equal(a, b)


def test_engine_quantize_runs_a_quantized_copy():
    model = random_model("hybrid", seed=6, layers="mamba,gqa")
    config = zoo.QuantizeConfig("int4", group_size=32)
    engine = Engine(model, max_batch=2, max_seq_len=48, quantize=config)
    assert isinstance(engine.model.blocks[1].mixer.q_proj, QuantizedLinear)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # the caller's model is untouched
    prompts = make_prompts([6, 9], model.config.vocab_size, seed=7)
    want = Engine(zoo.quantize(model, config), max_batch=2, max_seq_len=48).generate(prompts, greedy(6))
    assert [o.token_ids for o in engine.generate(prompts, greedy(6))] == [o.token_ids for o in want]
    with pytest.raises(ValueError, match="calibration"):
        Engine(model, quantize=zoo.QuantizeConfig("int8", method="awq"))
    with pytest.raises(ValueError, match="QuantizeConfig"):
        Engine(model, quantize="int8")


def test_the_quantized_decode_step_compiles():
    """compile=True on int8 and int4 weights: one graph like the float step (torch's packed ops trace), same tokens
    and logits as eager."""
    model = random_model("gqa", seed=8, n_layers=1)
    prompts = make_prompts([7, 12], model.config.vocab_size, seed=9)
    for config in SCHEMES:
        quantized = zoo.quantize(model, config)
        eager, compiled = (Engine(quantized, max_batch=2, max_seq_len=32, compile=c).generate(prompts, greedy(6))
                           for c in (False, True))
        for a, b in zip(eager, compiled):
            assert a.token_ids == b.token_ids
            assert (torch.stack(a.logits) - torch.stack(b.logits)).abs().max() < 1e-4
