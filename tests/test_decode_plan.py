"""zoo/decode_plan.py: an engine's eager CPU decode step runs every block's halves through one plan, decided once per
batch size, and decided again whenever what it was decided from changes (a hook, a module replaced, a parameter's
data swapped, a method replaced); each step's logits then equal those of an engine without plans. And
kernels/cpu_blocks.py's decode_blocks: the C++ op against its Python reference, and bad layouts refused."""
import pytest
import torch

import zoo
from attention.attention import Attention
from kernels.linear import Linear
from harness.decode_probe import decode_probe
from kernels import cpu_blocks, cpu_kernels_available
from zoo.decode_plan import DecodePlans
from zoo.ffn.swiglu import SwiGLU
from zoo.quantize import QuantizeConfig, quantize

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C kernels did not build here (a warning "
                                                                     "said why)")


def engine_pair(model, batch=2, context=12):
    """Two probes over the same model and caches filled alike: the first keeps decode plans, the second none."""
    probes = []
    for plans in (True, False):
        probe = decode_probe(model, batch, context, "contiguous", 16, compile=False, cuda_graphs=False)
        if not plans:
            probe.engine.runner.decode_plans = None
        probes.append(probe)
    return probes


def step(probe) -> torch.Tensor:
    logits = probe.engine.runner.decode(probe.seqs)
    for seq in probe.seqs:
        seq.output_ids.append(7)
    return logits


def plans_of(probe) -> dict:
    return probe.engine.runner.decode_plans.plans


def used(probe) -> bool:
    return any(plan.lists is not None for plan in plans_of(probe).values())


def count_decisions(monkeypatch) -> list:
    decided = []
    method = Attention.decode_half
    monkeypatch.setattr(Attention, "decode_half", lambda *args: decided.append(1) or method(*args))
    return decided


def test_a_plan_is_decided_once_a_batch_size_and_equals_the_blocks(monkeypatch):
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    decided = count_decisions(monkeypatch)
    planned, plain = engine_pair(model)
    for _ in range(4):
        assert torch.equal(step(planned), step(plain))
    assert used(planned)
    # the blocks without plans decide each step (4 x 2 layers); the plan decided once (2 layers)
    assert len(decided) == 4 * len(model.blocks) + len(model.blocks)
    smaller = decode_probe(model, 1, 12, "contiguous", 16, compile=False, cuda_graphs=False)
    smaller.engine.runner.decode_plans = planned.engine.runner.decode_plans  # one store: a plan per batch size
    step(smaller)
    assert set(plans_of(planned)) == {(2, torch.float32), (1, torch.float32)}


def test_a_hook_added_after_the_first_step_is_run_and_removed_it_plans_again():
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    planned, plain = engine_pair(model)
    assert torch.equal(step(planned), step(plain)) and used(planned)
    calls = []
    handle = model.blocks[1].register_forward_hook(lambda *args: calls.append(1))  # a block's own hook
    assert torch.equal(step(planned), step(plain))
    assert len(calls) == 2 and not used(planned)  # both engines ran the block's forward
    handle.remove()
    assert torch.equal(step(planned), step(plain))
    assert len(calls) == 2 and used(planned)


def test_a_module_replaced_after_the_first_step_is_planned_again():
    """A projection swapped for zoo.quantize's int8 layer: the plan streams its int8 payload, as the module does."""
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    planned, plain = engine_pair(model)
    assert torch.equal(step(planned), step(plain))
    int8 = quantize(model, QuantizeConfig(weights="int8"))  # a quantized copy: its layers are put into the model
    model.blocks[0].mixer.q_proj = int8.blocks[0].mixer.q_proj
    model.blocks[1].mlp.down_proj = int8.blocks[1].mlp.down_proj
    for _ in range(2):
        assert torch.equal(step(planned), step(plain))
    assert used(planned)
    weights = next(iter(plans_of(planned).values())).lists[0]
    assert sum(w is not None and w.dtype == torch.int8 for w in weights) == 2


def test_a_parameters_data_swapped_or_written_in_place_is_what_the_plan_reads():
    torch.manual_seed(0)
    model = zoo.build("mamba2", preset="tiny").eval()
    planned, plain = engine_pair(model)
    assert torch.equal(step(planned), step(plain))
    conv = model.blocks[0].mixer.conv1d.weight  # the plan holds a view of it ([:, 0]): a swap must be seen
    conv.data = conv.data * 1.5
    assert torch.equal(step(planned), step(plain))
    with torch.no_grad():
        model.blocks[1].mlp.down_proj.weight.mul_(0.5)  # in place: the plan reads it where it lies
    assert torch.equal(step(planned), step(plain))
    assert used(planned)


def test_a_method_replaced_on_an_instance_or_a_class_runs_the_modules(monkeypatch):
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    planned, plain = engine_pair(model)
    assert torch.equal(step(planned), step(plain)) and used(planned)
    mixer, calls = model.blocks[0].mixer, []
    mixer.forward = lambda *args: calls.append(1) or Attention.forward(mixer, *args)
    assert torch.equal(step(planned), step(plain))
    assert len(calls) == 2 and not used(planned)
    del mixer.forward
    assert torch.equal(step(planned), step(plain))
    assert used(planned)
    monkeypatch.setattr(SwiGLU, "decode_half", lambda *args: None)
    assert torch.equal(step(planned), step(plain))
    assert not used(planned)


def test_other_caches_or_a_step_that_is_not_a_plain_decode_take_no_stale_plan():
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    planned, other = engine_pair(model)
    other.engine.runner.decode_plans = planned.engine.runner.decode_plans  # one store, two engines' caches
    reference = decode_probe(model, 2, 12, "contiguous", 16, compile=False, cuda_graphs=False)
    reference.engine.runner.decode_plans = None
    for _ in range(2):
        first, second, expected = step(planned), step(other), step(reference)
        assert torch.equal(first, expected) and torch.equal(second, expected)
        assert next(iter(plans_of(other).values())).guard.caches == tuple(other.engine.pool.layers)
    x = torch.zeros(2, 1, model.config.d_model)
    batch = planned.engine.runner.cache_batch(planned.seqs, [[s.num_cached] for s in planned.seqs],
                                              [s.num_cached + 1 for s in planned.seqs], step="decode")
    with torch.enable_grad():
        assert DecodePlans().plan(model, x, planned.engine.pool.layers, batch) is None  # a gradient recorded
    with torch.no_grad():
        assert DecodePlans().plan(model, x, planned.engine.pool.layers, batch) is not None
        batch.padded = True
        assert DecodePlans().plan(model, x, planned.engine.pool.layers, batch) is None


def test_the_plan_ends_with_the_final_norm_and_the_head_and_its_guard_covers_them():
    """The model's final RMSNorm and its head run as the plan's last entries (the plan returns logits); a hook on
    either runs the modules after the blocks, as a head replaced by one the plan does not take runs after the norm
    (and a LayerNorm, which the kernels do not take); each step's logits equal an engine's without plans."""
    torch.manual_seed(0)
    model = zoo.build("gqa", preset="tiny").eval()
    planned, plain = engine_pair(model)
    assert torch.equal(step(planned), step(plain))
    plan = next(iter(plans_of(planned).values()))
    weights, _, floats, ints = plan.lists
    assert plan.ends_at == "head" and weights[-3:] == [model.norm.weight, model.head.weight, None]
    assert floats[-1] == model.norm.eps
    assert ints[-4:] == [cpu_blocks.KINDS.index("norm"), -1, cpu_blocks.KINDS.index("head"), -1]
    for module in (model.norm, model.head):
        ran = []
        handle = module.register_forward_hook(lambda module, args, out: ran.append(out))
        assert torch.equal(step(planned), step(plain))
        assert len(ran) == 2 and not used(planned)  # both engines ran the module's forward, and its hook
        handle.remove()
        assert torch.equal(step(planned), step(plain)) and used(planned)
    calls = []
    model.head.forward = lambda x: calls.append(1) or Linear.forward(model.head, x)  # on the instance: it runs
    assert torch.equal(step(planned), step(plain))
    assert len(calls) == 2 and {plan.ends_at for plan in plans_of(planned).values()} == {"norm"}
    del model.head.forward
    assert torch.equal(step(planned), step(plain)) and used(planned)
    head = torch.nn.Linear(model.config.d_model, model.config.vocab_size, bias=False)  # torch's: run after the plan
    head.weight = model.head.weight
    model.head = head
    torch.testing.assert_close(step(planned), step(plain))  # torch's GEMM: its sums may follow x's alignment
    assert used(planned)
    assert {plan.ends_at for plan in plans_of(planned).values()} == {"norm"}
    layer_norm = zoo.build("gqa", preset="tiny", norm="layernorm").eval()
    planned, plain = engine_pair(layer_norm)
    for _ in range(2):
        assert torch.equal(step(planned), step(plain))
    assert {plan.ends_at for plan in plans_of(planned).values()} <= {"blocks"}  # its blocks' norms: LayerNorms too


def test_a_traced_plan_has_the_shape_of_its_end():
    """decode_blocks' fake (what torch.compile sees): logits where the plan ends at the head, x's shape otherwise."""
    x = torch.zeros(2, 1, 8, device="meta")
    head = torch.zeros(50, 8, device="meta")
    ints = [cpu_blocks.KINDS.index("norm"), -1, cpu_blocks.KINDS.index("head"), -1]
    assert cpu_blocks.decode_blocks_fake(x, [None, head, None], [], [1e-5], ints).shape == (2, 1, 50)
    assert cpu_blocks.decode_blocks_fake(x, [None], [], [1e-5], ints[:2]).shape == (2, 1, 8)


def test_a_model_with_a_block_that_has_no_half_runs_its_blocks():
    torch.manual_seed(0)
    model = zoo.build("moe", preset="tiny").eval()
    planned, plain = engine_pair(model)
    for _ in range(2):
        assert torch.equal(step(planned), step(plain))
    assert plans_of(planned) and not used(planned)


def planned_call(arch: str, preset: str, batch: int):
    """A `preset` model's first plan at `batch` rows of 40 cached tokens, and a call of decode_blocks' form over it:
    call(fn) runs fn (the op or its Python reference) on a random x and its own copy of the states; (out, copies)."""
    torch.manual_seed(0)
    model = zoo.build(arch, preset=preset).eval()
    probe = decode_probe(model, batch, 40, "contiguous", 16, compile=False, cuda_graphs=False)
    step(probe)
    plan = next(iter(plans_of(probe).values()))
    rows = probe.engine.runner.cache_batch(probe.seqs, [[s.num_cached] for s in probe.seqs],
                                           [s.num_cached + 1 for s in probe.seqs], step="decode")
    weights, states, floats, ints = plan.lists
    found = [cache.decode_rows(rows) for cache in plan.row_caches]
    x = torch.randn(batch, 1, model.config.d_model)

    def call(fn):
        copies = [s.clone() for s in states]
        with torch.no_grad():
            return fn(x, weights, copies, floats, ints, rows.positions, rows.slots, [r for r, _ in found],
                      [n for _, n in found], plan.buffers), copies
    return call, states


@pytest.mark.parametrize("arch", ["hybrid-1in6", "mla", "swa"])
def test_decode_blocks_op_equals_its_python_reference(arch):
    """One plan's lists through the C++ op and through decode_blocks_eager, each on its own copy of the states."""
    call, states = planned_call(arch, "tiny", 2)
    results = [call(fn) for fn in (cpu_blocks.decode_blocks_op, cpu_blocks.decode_blocks_eager)]
    # MLA's folds sum in another order in C (kernels/cpu/mla_half.c), so x after a layer, and the cache row the next
    # layer writes from it, match to rounding
    close = arch == "mla"
    for got, want in zip((results[0][0], *results[0][1]), (results[1][0], *results[1][1])):
        if close:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want)
    assert not all(torch.equal(a, b) for a, b in zip(results[0][1], states))  # the op wrote its copies


@pytest.mark.parametrize("arch", ["gqa", "mamba2"])
def test_the_halves_write_the_plans_buffers_and_the_step_returns_a_fresh_tensor(arch):
    """A plan's halves write their outputs and hidden rows into its buffers, the same every step; the step's own
    result (the head's logits) is a new tensor each step, so logits an engine keeps are never written over. Steps with
    the buffers equal steps without them (each half allocating), bit for bit."""
    torch.manual_seed(0)
    model = zoo.build(arch, preset="tiny").eval()
    planned, plain = engine_pair(model)
    first = step(planned)
    plan = next(iter(plans_of(planned).values()))
    assert len(plan.buffers) == 4 and plan.buffers[2].shape[-1] > 0  # the feed-forward's rows
    kept = first.clone()
    marks = [buffer.fill_(float("nan")) for buffer in plan.buffers]  # a step must write over these
    second = step(planned)
    assert torch.equal(first, kept) and second.data_ptr() != first.data_ptr()
    assert all(not buffer.isnan().any() for buffer in marks)
    assert torch.equal(first, step(plain)) and torch.equal(second, step(plain))


def test_buffers_that_overlap_are_refused_and_ill_sized_ones_left_alone():
    call, _ = planned_call("gqa", "tiny", 2)
    want, _ = call(cpu_blocks.decode_blocks_op)
    torch.manual_seed(0)
    x, shared = torch.randn(2, 1, 64), torch.empty(2 * 64 + 8)
    overlapping = [shared[:128].view(2, 1, 64), shared[8:].view(2, 1, 64), torch.empty(2, 192), torch.empty(2, 192)]
    with pytest.raises(ValueError, match="buffers 0 and 1 overlap"):
        cpu_blocks.decode_blocks_op(x, [], [], [], [], x, x, [], [], overlapping)
    with pytest.raises(ValueError, match="none or four"):
        cpu_blocks.decode_blocks_op(x, [], [], [], [], x, x, [], [], overlapping[:2])
    wrong = [torch.empty(3, 1, 64), torch.empty(2, 1, 32), torch.empty(2, 7), torch.empty(2, 192, dtype=torch.bfloat16)]
    got, _ = call(lambda *args: cpu_blocks.decode_blocks_op(*args[:-1], wrong))
    assert torch.equal(got, want)
    assert not any(buffer.data_ptr() == got.data_ptr() for buffer in wrong)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="'ffn' half takes"):
        cpu_blocks.Half("ffn", (None,) * 6, floats=(1e-5,))
    with pytest.raises(ValueError, match="kinds: ffn, attention"):
        cpu_blocks.Half("moe", ())
    x = torch.zeros(1, 1, 8)
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ValueError, match="kind code 9"):
        cpu_blocks.decode_blocks_op(x, [], [], [], [9, -1], empty, empty, [], [], [])
    with pytest.raises(ValueError, match="the lists end inside half"):
        cpu_blocks.decode_blocks_op(x, [None] * 3, [], [1e-5], [0, -1], empty, empty, [], [], [])
    with pytest.raises(ValueError, match="left after the last half"):
        cpu_blocks.decode_blocks_op(x, [torch.zeros(8)], [], [], [], empty, empty, [], [], [])


@pytest.mark.parametrize("arch", ["gqa", "mla", "mamba", "mamba2", "hybrid-1in6"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_ops_outputs_do_not_depend_on_the_thread_count(arch, batch):
    """The halves hand each GEMV's rows to the threads as they are done (kernels/cpu/claims.h): whichever thread takes
    a row, every output and written state must be the one-thread op's, bit for bit (a row's sums are gemv_part's;
    these contexts are too short for decode attention to split its keys by thread count). `small`: 128 tiles of 4
    rows a projection, several per thread."""
    call, _ = planned_call(arch, "small", batch)
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 5, 5, 5):
            torch.set_num_threads(count)
            results.append(call(cpu_blocks.decode_blocks_op))
    finally:
        torch.set_num_threads(threads)
    for out, copies in results[1:]:
        assert torch.equal(out, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(copies, results[0][1]))
