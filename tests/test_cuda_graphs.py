"""What CUDA-graph decode needs, held on CPU for every causal architecture in both layouts: the "static" graph mode
(the captured step's padded batches on its static buffers, run eagerly) gives the plain step's tokens, feeds the
forward the same buffers every step, and never synchronises with the host; plus the option's checks."""
import pytest
import torch

from harness import Engine
from harness.engine.decode_graphs import batch_buckets
from kernels import FORCE_TRITON_ENV
from zoo.registry import architectures, is_causal
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model
from host_sync import host_syncs

CAUSAL = [name for name in architectures() if is_causal(name)]
# three prompts on five slots: batches of 3, 2 and 1 as requests finish (buckets 4, 2, 1: one padding row at 3)
LENGTHS, NEW_TOKENS = [5, 19, 11], [9, 4, 6]


def run(model, kv_cache, cuda_graphs, forward_wrapper=None, kv_dtype="auto"):
    engine = Engine(model, max_batch=5, max_seq_len=48, kv_cache=kv_cache, block_size=8, cuda_graphs=cuda_graphs,
                    kv_dtype=kv_dtype)
    if forward_wrapper is not None:
        engine.runner.graphs.forward = forward_wrapper(engine.runner.graphs.forward)
    prompts = make_prompts(LENGTHS, model.config.vocab_size)
    return engine, engine.generate(prompts, [greedy(n) for n in NEW_TOKENS])


# Triton's interpreter runs each grouped-matmul program in ~13 ms: the MoE entries' experts at 64 wide (tiny: 192) halve
# their triton runs; the kernel at other widths is tests/kernels/test_grouped_matmul.py's to check
NARROW_EXPERTS = {"moe": {"expert_hidden": 64}, "hybrid-moe": {"expert_hidden": 64}}
# one-byte caches: a float KV cache, a latent row with two scales, a ring, and a hybrid with recurrent state
ONE_BYTE = [(arch, kv_dtype) for arch in ("gqa", "mla", "swa", "hybrid-1in6") for kv_dtype in ("int8", "fp8")]
# Triton's interpreter takes 2-10 s an architecture and layout: it runs one architecture per set of kernels and
# launches. Left to the CPU kernels: mha and mqa (gqa's kernels, one and all heads a group), cla (gqa's, reading
# another layer's cache), the hybrids built of other entries' mixers (hybrid stays), gdn-neg (gdn's kernels) and
# hybrid-moe (moe's and mamba2's): 46 s a run. The one-byte caches run both formats on gqa's cache and one each on
# the others (the same kernels, another dequantisation): 11 s.
SAME_TRITON_KERNELS = {"mha", "mqa", "cla", "hybrid-1in6", "hybrid-3to1", "hybrid-chunked", "gdn-neg", "hybrid-moe"}
ONE_BYTE_TRITON = [("gqa", "int8"), ("gqa", "fp8"), ("mla", "int8"), ("swa", "fp8"), ("hybrid-1in6", "int8")]


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("arch,kv_dtype,kernels",
                         [(arch, "auto", "cpu") for arch in CAUSAL] + [(*entry, "cpu") for entry in ONE_BYTE]
                         + [(arch, "auto", "triton") for arch in CAUSAL if arch not in SAME_TRITON_KERNELS]
                         + [(*entry, "triton") for entry in ONE_BYTE_TRITON])
def test_static_graph_step_equals_plain_step_on_stable_buffers_without_host_syncs(arch, kv_dtype, kv_cache, kernels,
                                                                                 monkeypatch):
    """kernels "triton": the kernels CUDA runs (here in Triton's interpreter), whose launch code is captured too."""
    if kernels == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    model = random_model(arch, **(NARROW_EXPERTS.get(arch, {}) if kernels == "triton" else {}))
    _, want = run(model, kv_cache, cuda_graphs=False, kv_dtype=kv_dtype)
    calls: list[tuple] = []  # (bucket, data pointers of every input tensor, host syncs inside the forward)

    def recording(forward):
        def step(tokens, positions, layers, batch):
            with host_syncs() as syncs:
                logits = forward(tokens, positions, layers, batch)
            inputs = [tokens, batch.positions, batch.lengths, batch.slots, *batch.block_tables, *batch.slot_mappings]
            calls.append((len(tokens), [t.data_ptr() for t in inputs], list(syncs)))
            return logits
        return step

    engine, got = run(model, kv_cache, cuda_graphs="static", forward_wrapper=recording, kv_dtype=kv_dtype)
    for g, w in zip(got, want):
        assert_not_constant(w.token_ids, arch)
        assert_same_output(g, w, context=f"{arch} {kv_cache} {kv_dtype} static graphs")
    assert {bucket for bucket, _, _ in calls} == {4, 2, 1}, "the batches 3, 2, 1 run in buckets 4, 2, 1"
    for bucket in (4, 2, 1):
        pointers = [p for b, p, _ in calls if b == bucket]
        assert all(p == pointers[0] for p in pointers), f"{arch}: bucket {bucket}'s inputs moved between steps"
    syncs = sorted({s for _, _, seen in calls for s in seen})
    assert not syncs, f"{arch} {kv_cache} {kv_dtype}: the decode step synchronises with the host: {syncs}"
    assert engine.graph_bytes > 0 and not engine.cuda_graphs


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_spare_slot_is_the_graphs_not_the_caches(kv_cache):
    """Padding rows write into a spare slot row and spare blocks: counted in graph_bytes, never in the measured cache
    bytes."""
    model = random_model("hybrid", layers="mamba,gqa")
    plain = Engine(model, max_batch=4, max_seq_len=32, kv_cache=kv_cache, cuda_graphs=False)
    static = Engine(model, max_batch=4, max_seq_len=32, kv_cache=kv_cache, cuda_graphs="static")
    assert static.cache_bytes_allocated == plain.cache_bytes_allocated
    spare = static.pool.allocated_bytes - plain.pool.allocated_bytes
    assert spare == static.pool.spare_bytes > 0
    assert static.graph_bytes == spare + static.runner.graphs.inputs.nbytes


def test_padding_rows_never_touch_a_running_sequences_state():
    """A sequence mid-way through a chunked prefill holds a slot but is not in the decode batch: the padding rows of
    the decode step beside it must leave its state alone (they write the spare slot)."""
    model = random_model("mamba")
    prompts = make_prompts([40, 6, 7], model.config.vocab_size)
    outs = {}
    for mode in (False, "static"):
        engine = Engine(model, max_batch=3, max_seq_len=64, max_num_batched_tokens=8, cuda_graphs=mode)
        outs[mode] = engine.generate(prompts, greedy(6))
    for got, want in zip(outs["static"], outs[False]):
        assert_same_output(got, want, context="chunked prefill beside padded decode")


def test_host_sync_detector_sees_what_capture_cannot_record():
    x = torch.arange(4)
    with torch.inference_mode():  # the engine's steps run in inference mode, where int() dispatches aten.item
        y = torch.arange(4)
        with host_syncs() as seen:
            int(y.max()), y.tolist(), y[y > 1], torch.tensor([1, 2]), y.nonzero()
    assert len(seen) == 5, seen
    with host_syncs() as seen:
        bool(x.any())
    assert seen, "outside inference mode too"


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_cuda_graph_option_checks():
    model = random_model("gqa")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        Engine(model, cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        Engine(model, cuda_graphs=1)
    with pytest.raises(ValueError, match="compile=True"):
        Engine(model, compile=True, cuda_graphs="static")
    engine = Engine(model)
    assert not engine.cuda_graphs and engine.graph_bytes == 0
    assert "cpu" in engine.cuda_graphs_off


def test_failed_capture_falls_back_to_the_eager_padded_step(monkeypatch):
    """A step CUDA cannot capture must not take the requests with it: a warning, the reason, the same tokens."""
    model = random_model("gqa")
    _, want = run(model, "paged", cuda_graphs=False)
    engine = Engine(model, max_batch=5, max_seq_len=48, kv_cache="paged", block_size=8, cuda_graphs="static")
    engine.runner.graphs.mode = "capture"  # as on CUDA, with a capture that fails

    def failing_capture(rows):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine.runner.graphs, "capture", failing_capture)
    with pytest.warns(RuntimeWarning, match="CUDA graphs off"):
        got = engine.generate(make_prompts(LENGTHS, model.config.vocab_size), [greedy(n) for n in NEW_TOKENS])
    for g, w in zip(got, want):
        assert_same_output(g, w, context="after a failed capture")
    assert "capture of the batch-4 decode step failed" in engine.cuda_graphs_off and not engine.cuda_graphs
