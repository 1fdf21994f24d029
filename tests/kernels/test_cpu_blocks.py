"""kernels/cpu_blocks.py: a block's feed-forward half and an attention layer's half as one call each in an eager CPU
decode step, checked bit for bit against the modules' own path (the same C kernels, one op at a time), the C++ glue
against its Python glue, and the rule that decides where they serve."""
import pytest
import torch

import zoo
from attention.attention import Attention
from attention.linear_attention import LinearAttention
from attention.mla import MLAttention
from harness.decode_probe import decode_probe
from cache.layouts import ContiguousKV
from kernels import cpu_blocks, cpu_decode, cpu_kernels_available
from ssm.mamba import Mamba
from ssm.mamba2 import Mamba2
from zoo.ffn.swiglu import SwiGLU
from zoo.quantize import QuantizeConfig, quantize, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C kernels did not build here (a warning "
                                                                     "said why)")


MIXERS = (Attention, MLAttention, LinearAttention, Mamba2, Mamba)  # the mixers with a fused decode half


def turn_off(monkeypatch):
    """The blocks run their two modules each, as where the fused halves do not serve (no half decided: no plan)."""
    for cls in (*MIXERS, SwiGLU):
        monkeypatch.setattr(cls, "decode_half", lambda *args: None)


def decode_steps(model, batch: int, context: int, steps: int = 3, plans: bool = True):
    """Logits of `steps` greedy decode steps from a random cache of `context` tokens, and every layer's cache
    tensors after; plans=False: the engine keeps no decode plans (zoo/decode_plan.py), so each block decides its own
    halves every step."""
    torch.manual_seed(1)
    probe = decode_probe(model, batch, context, "contiguous", 16, compile=False, cuda_graphs=False)
    if not plans:
        probe.engine.runner.decode_plans = None
    logits = []
    for _ in range(steps):
        logits.append(probe.engine.runner.decode(probe.seqs))
        for seq, row in zip(probe.seqs, logits[-1]):
            seq.output_ids.append(int(row.argmax()))
    layers = probe.engine.pool.layers
    caches = [t.clone() for layer in layers for t in (layer.tensors.values() if hasattr(layer, "tensors")
                                                      else [layer.k, layer.v]) if t is not None]
    return torch.stack(logits), caches


def planned(model, batch: int) -> bool:
    """Whether an engine's decode step over `model` at `batch` runs through a plan of every block's halves."""
    probe = decode_probe(model, batch, 12, "contiguous", 16, compile=False, cuda_graphs=False)
    probe.step()
    plans = probe.engine.runner.decode_plans.plans
    return len(plans) == 1 and next(iter(plans.values())).lists is not None


def assert_steps_agree(fused, plain, close: bool, dtype) -> None:
    """Bit for bit, or with close to fp32 rounding (bf16: its own)."""
    (fused_logits, fused_caches), (logits, caches) = fused, plain
    if close:
        tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
        torch.testing.assert_close(fused_logits, logits, **tolerance)
        for a, b in zip(fused_caches, caches):
            torch.testing.assert_close(a, b, **tolerance)
    else:
        assert torch.equal(fused_logits, logits)
        assert all(torch.equal(a, b) for a, b in zip(fused_caches, caches))


@pytest.mark.parametrize("arch", ["gqa", "mha", "mqa", "cla", "swa", "mla", "linear", "mamba2", "mamba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, context", [(1, 12), (3, 40)])
def test_decode_steps_match_the_modules_path(arch, dtype, batch, context, monkeypatch):
    """The halves as each block decides them and as one plan runs them all (one C++ call a step), against the
    modules' path: bit for bit, except linear attention's fp32 state step, MLA's folds through W_UK and W_UV,
    Mamba-2's gated norm and Mamba's half (its own exps and dt_proj's sums), which compute in another order than the
    modules' path (its einsums, its mean, SLEEF's exp);
    the plan bit for bit with the blocks' halves.
    tiny's window is 16: swa at 40 tokens writes a ring; cla's second layer reads the first's cache."""
    torch.manual_seed(0)
    model = zoo.build(arch, preset="tiny").to(dtype).eval()
    served = {"mixer": 0, "ffn": 0}

    def counted(method, key):
        def call(*args):
            out = method(*args)
            served[key] += out is not None
            return out
        return call

    assert planned(model, batch)
    plan = decode_steps(model, batch, context)
    for cls in MIXERS:
        monkeypatch.setattr(cls, "decode_residual", counted(cls.decode_residual, "mixer"))
    monkeypatch.setattr(SwiGLU, "decode_residual", counted(SwiGLU.decode_residual, "ffn"))
    blocks = decode_steps(model, batch, context, plans=False)
    assert served == {"mixer": 3 * len(model.blocks), "ffn": 3 * len(model.blocks)}
    turn_off(monkeypatch)
    plain = decode_steps(model, batch, context)
    assert_steps_agree(plan, blocks, False, dtype)
    assert_steps_agree(plan, plain, arch == "linear" and dtype == torch.float32 or arch in ("mla", "mamba2", "mamba"),
                       dtype)


@pytest.mark.parametrize("arch", ["gqa", "cla", "swa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_int8_halves_match_the_modules_path(arch, dtype, batch, monkeypatch):
    """int8 weights (zoo.quantize's per-channel scales) through the fused attention and feed-forward halves, in a
    plan: the same int8 GEMV each QuantizedLinear's forward calls, so bit for bit."""
    torch.manual_seed(0)
    model = quantize(zoo.build(arch, preset="tiny").to(dtype).eval(), QuantizeConfig(weights="int8"))
    assert planned(model, batch)
    fused = decode_steps(model, batch, 40)
    turn_off(monkeypatch)
    assert_steps_agree(fused, decode_steps(model, batch, 40), False, dtype)


def block_inputs(dtype, batch=2, kv_heads=2, heads=4, head_dim=16, d_model=32, slots=3, rows=24):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return dict(x=randn(batch, 1, d_model), norm=randn(d_model), eps=1e-5, wq=randn(heads * head_dim, d_model),
                wk=randn(kv_heads * head_dim, d_model), wv=randn(kv_heads * head_dim, d_model),
                wo=randn(d_model, heads * head_dim), positions=torch.tensor([[5], [17]]),
                inv_freq=1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim),
                k_cache=randn(slots, kv_heads, rows, head_dim), v_cache=randn(slots, kv_heads, rows, head_dim),
                slots=torch.tensor([2, 0]), rows=torch.tensor([5, 17]), lengths=torch.tensor([6, 18]),
                scale=head_dim**-0.5)


def as_int8(inputs: dict, dtype) -> None:
    """The attention half's projections as zoo.quantize's int8 payloads and per-channel scales, in place."""
    for name in ("wq", "wk", "wv", "wo"):
        q, scales = quantize_int8(inputs[name].float())
        inputs[name], inputs[f"{name}_scales"] = q, scales.to(dtype)


def assert_attention_halves_agree(inputs: dict) -> None:
    """The attention half's C++ op and its Python glue, each on its own copy of the caches: the same output and
    caches, bit for bit."""
    results = {}
    for name, fn in (("op", cpu_blocks.attention_block_op), ("python", cpu_blocks.attention_block_eager)):
        args = {**inputs, "k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone()}
        results[name] = fn(**args), args["k_cache"], args["v_cache"]
    for op, python in zip(results["op"], results["python"]):
        assert torch.equal(op, python)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_halves_cpp_and_python_glue_agree(dtype):
    """The halves with int8 projections (payload and per-channel scales), their C++ kernels against their Python
    glue; a float weight where the scales say int8 is refused."""
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    inputs = block_inputs(dtype)
    as_int8(inputs, dtype)
    assert_attention_halves_agree(inputs)
    g = torch.Generator().manual_seed(1)
    d, hidden = inputs["x"].shape[-1], 48
    ffn = [torch.randn(shape, generator=g) for shape in ((hidden, d), (hidden, d), (d, hidden))]
    operands = [quantize_int8(w) for w in ffn]
    args = (inputs["x"], inputs["norm"], 1e-5, *[q for q, _ in operands], *[s.to(dtype) for _, s in operands])
    assert torch.equal(cpu_blocks.ffn_block_op(*args), cpu_blocks.ffn_block_eager(*args))
    with pytest.raises(ValueError, match="int8 with scales"):
        cpu_blocks.ffn_block_op(inputs["x"], inputs["norm"], 1e-5, *[w.to(dtype) for w in ffn],
                                *[s.to(dtype) for _, s in operands])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shares", [False, True])
def test_the_cpp_and_python_glue_agree(dtype, shares):
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    inputs = block_inputs(dtype)
    if shares:  # a layer that reads another's cache: no keys or values of its own, nothing written
        inputs.update(wk=None, wv=None)
    caches = {}
    outs = {}
    for name, fn in (("op", cpu_blocks.attention_block_op), ("python", cpu_blocks.attention_block_eager)):
        args = {**inputs, "k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone()}
        outs[name] = fn(**args)
        caches[name] = args["k_cache"], args["v_cache"]
    assert torch.equal(outs["op"], outs["python"])
    assert all(torch.equal(a, b) for a, b in zip(caches["op"], caches["python"]))
    written = not torch.equal(caches["op"][0], inputs["k_cache"])
    assert written != shares
    ffn = dict(x=inputs["x"], norm=inputs["norm"], eps=1e-5, gate=inputs["wq"], up=inputs["wq"].flip(0),
               down=inputs["wo"])
    assert torch.equal(cpu_blocks.ffn_block_op(**ffn), cpu_blocks.ffn_block_eager(**ffn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_half_splits_heads_off_its_gemv_tiles(dtype):
    """Heads whose rows are no whole number of the GEMV's 4-row tiles (head dim 6), one KV head and a width of 20:
    each thread's share of q, k, v and o still equals the whole GEMVs' rows, int8 projections too."""
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    inputs = block_inputs(dtype, batch=2, kv_heads=1, heads=3, head_dim=6, d_model=20, rows=30)
    assert_attention_halves_agree(inputs)
    as_int8(inputs, dtype)
    assert_attention_halves_agree(inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_feed_forward_half_splits_rows_off_its_gemv_tiles(dtype):
    """A width (20) and hidden size (30) that are no whole number of the GEMV's 4-row tiles, 3 rows: the threads'
    shares of gate, up and down equal the whole GEMVs', int8 projections too; shapes that disagree are refused."""
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    g = torch.Generator().manual_seed(2)
    x, norm = torch.randn(3, 1, 20, generator=g).to(dtype), torch.randn(20, generator=g).to(dtype)
    ffn = [torch.randn(shape, generator=g) for shape in ((30, 20), (30, 20), (20, 30))]
    args = (x, norm, 1e-5, *[w.to(dtype) for w in ffn])
    assert torch.equal(cpu_blocks.ffn_block_op(*args), cpu_blocks.ffn_block_eager(*args))
    operands = [quantize_int8(w) for w in ffn]
    args = (x, norm, 1e-5, *[q for q, _ in operands], *[s.to(dtype) for _, s in operands])
    assert torch.equal(cpu_blocks.ffn_block_op(*args), cpu_blocks.ffn_block_eager(*args))
    with pytest.raises(ValueError, match="must match x's width 20"):
        cpu_blocks.ffn_block_op(x, norm, 1e-5, *[w.to(dtype) for w in ffn[:2]], ffn[2][:, :-1].to(dtype))


@pytest.mark.parametrize("threads", [3, 5])
def test_rows_handed_out_as_threads_finish_end_off_a_tile(threads):
    """Each GEMV's rows are claimed as the threads finish (kernels/cpu/claims.h), a thread that is done taking pieces
    from the back of another's share: with down's 22 rows (the last share ends off a 4-row tile) and gate's and up's
    30, at 3 and 5 threads on 2 cores (so shares are taken from the back), the half equals the composed one."""
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    g = torch.Generator().manual_seed(5)
    x, norm = torch.randn(2, 1, 22, generator=g), torch.randn(22, generator=g)
    ffn = [torch.randn(shape, generator=g) for shape in ((30, 22), (30, 22), (22, 30))]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu_blocks.ffn_block_op(x, norm, 1e-5, *ffn)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, cpu_blocks.ffn_block_eager(x, norm, 1e-5, *ffn))


def test_bad_input_is_refused_before_any_write():
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    inputs = block_inputs(torch.float32)
    before = inputs["k_cache"].clone()
    with pytest.raises(ValueError, match="torch.bfloat16"):
        cpu_blocks.attention_block_op(**{**inputs, "v_cache": inputs["v_cache"].bfloat16()})
    with pytest.raises(IndexError, match="slot 3"):
        cpu_blocks.attention_block_op(**{**inputs, "slots": torch.tensor([3, 0])})
    with pytest.raises(IndexError, match="length 25"):  # more rows than the cache's 24 would be read
        cpu_blocks.attention_block_op(**{**inputs, "lengths": torch.tensor([6, 25])})
    with pytest.raises(ValueError, match="must match width"):
        cpu_blocks.attention_block_op(**{**inputs, "wo": inputs["wo"][:, :-1]})
    assert torch.equal(inputs["k_cache"], before)


def halves(model, cache_kind="contiguous", batch=2, grad=False, cache=None, **batch_fields):
    """(layer 0's attention half, its feed-forward half) as decode_residual answers them on an engine's decode step:
    None where the block runs its two modules. cache: a layer-0 cache to use instead of the engine's."""
    probe = decode_probe(model, batch, 12, cache_kind, 16, compile=False, cuda_graphs=False)
    seqs = probe.seqs
    step = probe.engine.runner.cache_batch(seqs, [[s.num_cached] for s in seqs], [s.num_cached + 1 for s in seqs],
                                           step="decode")
    for name, value in batch_fields.items():
        setattr(step, name, value)
    block = model.blocks[0]
    x = torch.randn(batch, 1, model.config.d_model, dtype=block.mixer_norm.weight.dtype, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        attention = block.mixer.decode_residual(block.mixer_norm, x, step.positions,
                                                cache or probe.engine.pool.layers[0], step)
        ffn = block.mlp.decode_residual(block.mlp_norm, x)
    return attention, ffn


def served(pair) -> tuple[bool, bool]:
    return tuple(half is not None for half in pair)


def test_where_the_fused_halves_serve():
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    assert served(halves(model)) == (True, True)
    assert served(halves(model, "paged")) == (False, True)
    assert served(halves(model, checkpoints=True)) == (False, True)  # a speculative step keeps what it overwrites
    assert served(halves(model, padded=True)) == (False, True)
    assert served(halves(model, grad=True)) == (False, False)
    one_byte = ContiguousKV(model.blocks[0].mixer.cache_spec(), 2, 32, torch.float32, "cpu", kv_format="int8")
    assert served(halves(model, cache=one_byte)) == (False, True)
    bf16 = zoo.build("gqa", preset="tiny").bfloat16().eval()
    assert served(halves(bf16, batch=8)) == (True, True)
    assert served(halves(bf16, batch=9)) == (False, False)  # F.linear's rows, past the C GEMV's
    assert served(halves(quantize(model, QuantizeConfig(weights="int8")))) == (True, True)  # the int8 GEMV's
    assert served(halves(quantize(model, QuantizeConfig(weights="int4", group_size=32)))) == (False, False)
    awq_like = quantize(model, QuantizeConfig(weights="int8"))
    for layer in (awq_like.blocks[0].mixer.q_proj, awq_like.blocks[0].mlp.up_proj):
        layer.input_scale = torch.ones(layer.in_features)  # AWQ's: the layer divides its input first
    assert served(halves(awq_like)) == (False, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_attention_half_cpp_and_python_agree(dtype):
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    g = torch.Generator().manual_seed(0)
    heads, dk, dv, d_model = 2, 8, 16, 32

    def randn(*shape, to=dtype):
        return torch.randn(*shape, generator=g).to(to)

    inputs = dict(x=randn(2, 1, d_model), norm=randn(d_model), eps=1e-5, wq=randn(heads * dk, d_model),
                  wk=randn(heads * dk, d_model), wv=randn(heads * dv, d_model), wo=randn(d_model, heads * dv),
                  kv=randn(3, heads, dk, dv, to=torch.float32), normalizer=randn(3, heads, dk, to=torch.float32).abs(),
                  slots=torch.tensor([2, 0]), attention_eps=1e-6)
    results = {}
    for name, fn in (("op", cpu_blocks.linear_attention_block_op), ("python", cpu_blocks.linear_attention_block_eager)):
        args = {**inputs, "kv": inputs["kv"].clone(), "normalizer": inputs["normalizer"].clone()}
        results[name] = fn(**args), args["kv"], args["normalizer"]
    for op, python in zip(results["op"], results["python"]):
        torch.testing.assert_close(op, python, rtol=1e-5, atol=1e-5)
    assert torch.equal(results["op"][1][1], inputs["kv"][1])  # slot 1 is no sequence's: untouched
    assert not torch.equal(results["op"][1][2], inputs["kv"][2])
    with pytest.raises(IndexError, match="slot 3"):
        cpu_blocks.linear_attention_block_op(**{**inputs, "slots": torch.tensor([3, 0])})


def test_where_the_linear_attention_half_serves():
    torch.manual_seed(0)
    model = zoo.build("linear", preset="tiny").eval()
    assert served(halves(model)) == (True, True)
    assert served(halves(model, checkpoints=True)) == (False, True)
    assert served(halves(model, grad=True)) == (False, False)
    taylor = zoo.build("linear", preset="tiny", feature_map="taylor").eval()
    assert served(halves(taylor)) == (False, True)
    model.blocks[0].mixer.phi = lambda x: torch.relu(x) + 1  # a feature map of the user's: the module runs it
    assert served(halves(model)) == (False, True)


def test_a_replaced_step_is_the_modules_to_run():
    """A fused half computes its module's decode step itself; a method replaced on the instance (or a subclass)
    must be run, not silently skipped."""
    for arch, method in (("mamba", "time_step"), ("mamba2", "split_xbc"), ("gqa", "forward"), ("mla", "absorbed")):
        model = zoo.build(arch, preset="tiny").eval()
        assert served(halves(model))[0]
        mixer = model.blocks[0].mixer
        setattr(mixer, method, getattr(mixer, method))
        assert not served(halves(model))[0], arch


# tiny's mixers, and odd widths: channels and states not whole tiles or vectors, two groups, no conv bias
MAMBA2_MIXERS = {"tiny": lambda: zoo.build("mamba2", preset="tiny").blocks[0].mixer,
                 "odd": lambda: Mamba2(38, 0, d_state=12, head_dim=19, n_groups=2, d_conv=3, conv_bias=False)}
MAMBA_MIXERS = {"tiny": lambda: zoo.build("mamba", preset="tiny").blocks[0].mixer,
                "odd": lambda: Mamba(38, 0, d_state=12, d_conv=3, dt_rank=5, conv_bias=False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["tiny", "odd"])
def test_mamba2_half_cpp_and_python_agree(dtype, shape):
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    torch.manual_seed(0)
    mixer = MAMBA2_MIXERS[shape]().to(dtype)
    g = torch.Generator().manual_seed(0)
    d_model = mixer.in_proj.weight.shape[1]
    ssm = torch.randn(3, mixer.n_heads, mixer.head_dim, mixer.d_state, generator=g).to(dtype)
    inputs = dict(x=torch.randn(2, 1, d_model, generator=g).to(dtype), norm=torch.randn(d_model, generator=g).to(dtype),
                  eps=1e-5, in_w=mixer.in_proj.weight, conv_w=mixer.conv1d.weight[:, 0], conv_b=mixer.conv1d.bias,
                  dt_bias=mixer.dt_bias, A_log=mixer.A_log, D=mixer.D, gate_norm=mixer.norm.weight,
                  gate_eps=mixer.norm.eps, out_w=mixer.out_proj.weight,
                  conv=torch.randn(3, mixer.conv_dim, mixer.d_conv, generator=g).to(dtype), ssm=ssm,
                  slots=torch.tensor([2, 0]), groups=mixer.n_groups)
    results = {}
    with torch.no_grad():
        for name, fn in (("op", cpu_blocks.mamba2_block_op), ("python", cpu_blocks.mamba2_block_eager)):
            args = {**inputs, "conv": inputs["conv"].clone(), "ssm": inputs["ssm"].clone()}
            results[name] = fn(**args), args["conv"], args["ssm"]
    # the conv state is shifted bit for bit (the in_proj rows are the same GEMV's); the output and the SSM state match
    # to rounding (kernels/cpu/mamba2_half.c: its own exps, the gated norm's mean summed in order)
    assert torch.equal(results["op"][1], results["python"][1])
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for op, python in zip(results["op"][::2], results["python"][::2]):
        torch.testing.assert_close(op, python, **tolerance)
    assert torch.equal(results["op"][2][1], ssm[1]) and not torch.equal(results["op"][2][2], ssm[2])
    with pytest.raises(ValueError, match="taps and bias"):
        cpu_blocks.mamba2_block_op(**{**inputs, "conv_w": inputs["conv_w"].double()})
    with pytest.raises(ValueError, match="weights in x's dtype"):  # read as they are: never a wrong answer
        cpu_blocks.mamba2_block_op(**{**inputs, "A_log": inputs["A_log"].double()})
    with pytest.raises(IndexError, match="slot 3"):
        cpu_blocks.mamba2_block_op(**{**inputs, "slots": torch.tensor([3, 0])})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["tiny", "odd"])
def test_mamba_half_cpp_and_python_agree(dtype, shape):
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    torch.manual_seed(0)
    mixer = MAMBA_MIXERS[shape]().to(dtype)
    g = torch.Generator().manual_seed(0)
    d_model = mixer.in_proj.weight.shape[1]
    ssm = torch.randn(3, mixer.d_inner, mixer.A_log.shape[1], generator=g).to(dtype)
    inputs = dict(x=torch.randn(2, 1, d_model, generator=g).to(dtype), norm=torch.randn(d_model, generator=g).to(dtype),
                  eps=1e-5, in_w=mixer.in_proj.weight, conv_w=mixer.conv1d.weight[:, 0], conv_b=mixer.conv1d.bias,
                  x_w=mixer.x_proj.weight, dt_w=mixer.dt_proj.weight, dt_b=mixer.dt_proj.bias, A_log=mixer.A_log,
                  D=mixer.D, out_w=mixer.out_proj.weight,
                  conv=torch.randn(3, mixer.d_inner, mixer.conv1d.weight.shape[-1], generator=g).to(dtype), ssm=ssm,
                  slots=torch.tensor([2, 0]))
    results = {}
    with torch.no_grad():
        for name, fn in (("op", cpu_blocks.mamba_block_op), ("python", cpu_blocks.mamba_block_eager)):
            args = {**inputs, "conv": inputs["conv"].clone(), "ssm": inputs["ssm"].clone()}
            results[name] = fn(**args), args["conv"], args["ssm"]
    # the conv state is shifted bit for bit (the in_proj rows are the same GEMV's); the output and the SSM state
    # match to rounding (kernels/cpu/mamba_half.c: its own exps, dt_proj summed in its own order)
    assert torch.equal(results["op"][1], results["python"][1])
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for op, python in zip(results["op"][::2], results["python"][::2]):
        torch.testing.assert_close(op, python, **tolerance)
    assert torch.equal(results["op"][2][1], ssm[1]) and not torch.equal(results["op"][2][2], ssm[2])
    with pytest.raises(ValueError, match="taps and bias"):
        cpu_blocks.mamba_block_op(**{**inputs, "conv_w": inputs["conv_w"].double()})
    with pytest.raises(ValueError, match="weights in x's dtype"):  # read as they are: never a wrong answer
        cpu_blocks.mamba_block_op(**{**inputs, "A_log": inputs["A_log"].double()})
    with pytest.raises(IndexError, match="slot 3"):
        cpu_blocks.mamba_block_op(**{**inputs, "slots": torch.tensor([3, 0])})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_half_cpp_and_python_agree(dtype):
    if not cpu_decode.glue_available():
        pytest.skip("the C++ glue did not build here (a warning said why)")
    torch.manual_seed(0)
    mixer = zoo.build("mla", preset="tiny").to(dtype).blocks[0].mixer
    g = torch.Generator().manual_seed(0)
    d_model, width = mixer.q_proj.weight.shape[1], mixer.kv_lora_rank + mixer.rope_dim
    cache = torch.randn(3, 1, 24, width, generator=g).to(dtype)
    inputs = dict(x=torch.randn(2, 1, d_model, generator=g).to(dtype), norm=torch.randn(d_model, generator=g).to(dtype),
                  eps=1e-5, wq=mixer.q_proj.weight, wkv_a=mixer.kv_a_proj_with_mqa.weight,
                  kv_norm=mixer.kv_a_layernorm.weight, kv_eps=mixer.kv_a_layernorm.eps, wkv_b=mixer.kv_b_proj.weight,
                  wo=mixer.o_proj.weight, positions=torch.tensor([[5], [17]]), inv_freq=mixer.rope.inv_freq,
                  cache=cache, slots=torch.tensor([2, 0]), rows=torch.tensor([5, 17]), lengths=torch.tensor([6, 18]),
                  scale=mixer.scale, heads=mixer.n_heads, nope=mixer.nope_dim, v_dim=mixer.v_head_dim)
    results = {}
    with torch.no_grad():
        for name, fn in (("op", cpu_blocks.mla_block_op), ("python", cpu_blocks.mla_block_eager)):
            args = {**inputs, "cache": inputs["cache"].clone()}
            results[name] = fn(**args), args["cache"]
    # the latent row is the same ops' (bit for bit); the output's folds sum in fp32 in another order than einsum
    assert torch.equal(results["op"][1], results["python"][1])
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(results["op"][0], results["python"][0], **tolerance)
    assert not torch.equal(results["op"][1][2, 0, 5], cache[2, 0, 5])
    with pytest.raises(IndexError, match="slot 3"):
        cpu_blocks.mla_block_op(**{**inputs, "slots": torch.tensor([3, 0])})


@pytest.mark.parametrize("arch", ["gqa", "mla", "linear", "mamba2", "mamba"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_quantized_decode_step_dequantizes_only_what_it_must(arch, weights, monkeypatch):
    """A quantized layer's `weight` rebuilds its float weight: asking for it on every step (the feed-forward once
    did, before it knew the layer was not plain) cost 2.5x the whole eager int8 step of a `base` model. Only MLA's
    kv_b_proj (absorbed into the query and the output) and Mamba's dt_proj (applied without its bias) use it."""
    from zoo.quantize import QuantizedLinear

    torch.manual_seed(0)
    model = quantize(zoo.build(arch, preset="tiny").eval(), QuantizeConfig(weights=weights, group_size=32))
    asked = []
    real = QuantizedLinear.weight
    monkeypatch.setattr(QuantizedLinear, "weight", property(lambda layer: asked.append(layer) or real.fget(layer)))
    decode_steps(model, batch=2, context=12)
    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    assert {names[id(layer)] for layer in asked} <= {"kv_b_proj", "dt_proj"}


@pytest.mark.parametrize("arch", ["gqa", "mla", "linear", "mamba2", "mamba"])
def test_a_forward_hook_is_run_not_skipped(arch):
    """A fused half runs none of its modules' forwards: a hook on the mixer, its norm, a projection (a pruning mask, an
    activation probe) or on every module makes the block run the modules, and the hook sees the step."""
    torch.manual_seed(0)
    model = zoo.build(arch, preset="tiny").eval()
    block = model.blocks[0]
    projection = next(m for name, m in block.mixer.named_children() if name.endswith("proj"))
    for hooked in (block.mixer, block.mixer_norm, projection):
        handle = hooked.register_forward_hook(lambda *args: None)
        assert not served(halves(model))[0], hooked
        handle.remove()
    assert served(halves(model))[0]
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert served(halves(model)) == (False, False)
    finally:
        handle.remove()
    calls = []
    handle = block.mlp.down_proj.register_forward_hook(lambda *args: calls.append(1))
    decode_steps(model, batch=1, context=8, steps=2)
    handle.remove()
    assert len(calls) == 2  # both decode steps (the probe fills its cache without a forward)


def test_a_bias_the_fused_half_would_drop_keeps_the_modules():
    torch.manual_seed(0)
    model = zoo.build("mamba", preset="tiny").eval()
    x_proj = model.blocks[0].mixer.x_proj
    x_proj.bias = torch.nn.Parameter(torch.zeros(x_proj.out_features))
    assert not served(halves(model))[0]
