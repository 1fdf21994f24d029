"""harness.roofline: step costs against numbers worked out by hand from the tiny preset's sizes, the floor, the
machine measurement.

tiny preset: vocab 512, d_model 64, 2 layers, 4 query heads of 16, gqa 2 KV heads, swiglu hidden 192, window 16,
tied embeddings. fp32 unless said. Per layer: q 64x64 + k, v 64x(heads*16) + o 64x64, mlp 3x64x192 = 36864,
two norms 128; plus the 512x64 embedding/head (32768) and the final norm (64).
"""
import dataclasses
import math

import pytest
import torch

import zoo
from harness import roofline
from harness.roofline import MachineRates, StepCost

GQA_PARAMS = 32768 + 2 * (4096 + 2048 + 2048 + 4096 + 36864 + 128) + 64  # 131392
MHA_PARAMS = 32768 + 2 * (4 * 4096 + 36864 + 128) + 64  # 139584
MQA_PARAMS = 32768 + 2 * (4096 + 1024 + 1024 + 4096 + 36864 + 128) + 64  # 127296
GQA_KV_BYTES_PER_TOKEN = 2 * (2 * (16 + 16)) * 4  # 2 layers x 2 KV heads x (key 16 + value 16) x fp32 = 512
GQA_FLOPS_PER_KEY = 2 * (2 * 4 * (16 + 16))  # 2 layers x 2 FLOPs x 4 query heads x (q.k 16 + p.v 16) = 512


def tiny(arch, **overrides):
    return zoo.build(arch, preset="tiny", **overrides)


def test_gqa_decode_step_cost_by_hand():
    batch, context = 2, 100
    cost = roofline.decode_step_cost(tiny("gqa"), batch=batch, context=context)
    assert cost.weight_bytes == GQA_PARAMS * 4 == 525568
    assert cost.cache_read_bytes == batch * GQA_KV_BYTES_PER_TOKEN * (context + 1) == 103424  # the new token too
    assert cost.cache_write_bytes == batch * GQA_KV_BYTES_PER_TOKEN == 1024
    assert cost.flops == batch * (2 * GQA_PARAMS + GQA_FLOPS_PER_KEY * (context + 1)) == 628992
    assert cost.bytes == 525568 + 103424 + 1024


def test_dtype_override_scales_weights_and_cache():
    half = roofline.decode_step_cost(tiny("gqa"), batch=1, context=10, dtype=torch.bfloat16)
    assert half.weight_bytes == GQA_PARAMS * 2
    assert half.cache_read_bytes == GQA_KV_BYTES_PER_TOKEN // 2 * 11
    assert half.flops == 2 * GQA_PARAMS + GQA_FLOPS_PER_KEY * 11  # FLOPs do not depend on the dtype


def test_mha_reads_more_than_gqa_than_mqa():
    costs = {a: roofline.decode_step_cost(tiny(a), batch=4, context=255) for a in ("mha", "gqa", "mqa")}
    assert costs["mha"].cache_read_bytes == 4 * 256 * 2 * (4 * 32) * 4  # batch x keys x layers x 4 KV heads x 32 x fp32
    assert costs["mqa"].cache_read_bytes == 4 * 256 * 2 * (1 * 32) * 4
    assert costs["mha"].cache_read_bytes == 2 * costs["gqa"].cache_read_bytes == 4 * costs["mqa"].cache_read_bytes
    assert costs["mha"].weight_bytes == MHA_PARAMS * 4 and costs["mqa"].weight_bytes == MQA_PARAMS * 4
    assert costs["mha"].bytes > costs["gqa"].bytes > costs["mqa"].bytes
    # every query head reads every key whatever the KV heads: attention FLOPs are equal, only weights differ
    for a, params in (("mha", MHA_PARAMS), ("gqa", GQA_PARAMS), ("mqa", MQA_PARAMS)):
        assert costs[a].flops == 4 * (2 * params + GQA_FLOPS_PER_KEY * 256)


def test_mla_reads_latent_rows_and_counts_absorbed_attention():
    # tiny MLA: kv_lora_rank d_model/4 = 16, rope key 8, nope 16, value 16
    params = 32768 + 2 * (64 * 4 * 24 + 64 * 24 + 16 + 16 * 4 * 32 + 4 * 16 * 64 + 36864 + 128) + 64
    cost = roofline.decode_step_cost(tiny("mla"), batch=1, context=63)
    row = 16 + 8  # one latent + rope key per token, shared by all heads
    assert cost.cache_read_bytes == 2 * row * 4 * 64 == 12288
    assert cost.cache_write_bytes == 2 * row * 4
    heads, rank, rope = 4, 16, 8
    assert cost.flops == 2 * params + 2 * heads * (2 * rank + rope) * 2 * 64  # 2 layers, 64 keys
    assert cost.flops == 309952


def test_cla_consumer_rereads_its_producers_cache():
    model, batch, context = tiny("cla"), 3, 40  # share 2: layer 1 reads layer 0's KV
    cost = roofline.decode_step_cost(model, batch=batch, context=context)
    per_layer_token = 2 * 32 * 4  # 2 KV heads x (16 + 16) x fp32
    assert cost.cache_read_bytes == batch * 2 * per_layer_token * (context + 1)  # both layers read it
    assert cost.cache_write_bytes == batch * per_layer_token  # only the producer writes
    owned = zoo.cache_bytes(model, seq_len=context + 1, batch=batch)
    assert owned == batch * per_layer_token * (context + 1) and cost.cache_read_bytes == 2 * owned
    params = 32768 + 2 * (4096 + 4096 + 36864 + 128) + 2 * 2048 + 64  # the consumer has no k/v projections
    assert cost.flops == batch * (2 * params + GQA_FLOPS_PER_KEY * (context + 1))


def test_swa_cache_read_stops_growing_at_the_window():
    model = tiny("swa")  # window 16
    read = {c: roofline.decode_step_cost(model, batch=1, context=c) for c in (10, 15, 100, 400)}
    assert read[10].cache_read_bytes == GQA_KV_BYTES_PER_TOKEN * 11
    assert read[15].cache_read_bytes == read[100].cache_read_bytes == read[400].cache_read_bytes == GQA_KV_BYTES_PER_TOKEN * 16
    assert read[100].flops == read[400].flops == 2 * GQA_PARAMS + GQA_FLOPS_PER_KEY * 16


@pytest.mark.parametrize("arch, state_bytes", [
    ("mamba", 2 * (128 * 4 + 128 * 16) * 4),  # d_inner 128: conv 128x4 + ssm 128x16 per layer, fp32
    ("linear", 2 * (4 * 16 * 16 + 4 * 16) * 4),  # 4 heads: S 16x16 + z 16 per layer, fp32 state
])
def test_state_models_read_and_write_their_whole_state(arch, state_bytes):
    model = tiny(arch)
    costs = [roofline.decode_step_cost(model, batch=2, context=c) for c in (0, 50, 400)]
    for cost in costs:
        assert cost.cache_read_bytes == cost.cache_write_bytes == 2 * state_bytes
    assert costs[0].flops == costs[1].flops == costs[2].flops  # constant in context


def test_linear_state_stays_fp32_in_a_bf16_model():
    cost = roofline.decode_step_cost(tiny("linear").to(torch.bfloat16), batch=1, context=9)
    assert cost.cache_read_bytes == 2 * (4 * 16 * 16 + 4 * 16) * 4
    state_elements = 2 * (4 * 16 * 16 + 4 * 16)
    assert cost.flops == 2 * MHA_PARAMS + roofline.STATE_FLOPS_PER_ELEMENT * state_elements  # same shapes as mha


def test_untied_embedding_is_not_read_by_decode():
    tied, untied = tiny("gqa"), tiny("gqa", tie_embeddings=False)
    assert zoo.parameter_bytes(untied) == (GQA_PARAMS + 512 * 64) * 4  # one more 512x64 table
    # untied: the head is read, the embedding table only for one row; tied: the one table is the head
    assert roofline.decode_step_cost(untied, 1, 8).weight_bytes == roofline.decode_step_cost(tied, 1, 8).weight_bytes == GQA_PARAMS * 4


def test_prefill_flops_grow_quadratically_through_attention():
    model, head = tiny("gqa"), 512 * 64  # the engine applies the head at the last position only

    def expected(t):
        return 2 * (GQA_PARAMS - head) * t + 2 * head + GQA_FLOPS_PER_KEY * t * (t + 1) // 2

    for t in (64, 128, 256):
        assert roofline.prefill_cost(model, batch=1, prompt_len=t).flops == expected(t)
    assert roofline.prefill_cost(model, batch=1, prompt_len=64).flops == 13754368
    assert roofline.prefill_cost(model, batch=3, prompt_len=64).flops == 3 * 13754368
    linear = 2 * (GQA_PARAMS - head)
    attention = [roofline.prefill_cost(model, 1, t).flops - linear * t - 2 * head for t in (128, 256)]
    assert attention[1] / attention[0] == pytest.approx(4, rel=0.01)
    cost = roofline.prefill_cost(model, batch=2, prompt_len=64)
    assert cost.cache_write_bytes == 2 * 64 * GQA_KV_BYTES_PER_TOKEN and cost.cache_read_bytes == 0
    # sliding window 16: 16*17/2 pairs for the first 16 queries, 16 for each of the other 48
    swa = roofline.prefill_cost(tiny("swa"), batch=1, prompt_len=64)
    assert swa.flops == 2 * (GQA_PARAMS - head) * 64 + 2 * head + GQA_FLOPS_PER_KEY * (136 + 48 * 16)
    assert swa.cache_write_bytes == 16 * GQA_KV_BYTES_PER_TOKEN


def test_floor_is_the_larger_term_and_bound_names_it():
    cost = StepCost(weight_bytes=6 * 10**8, cache_read_bytes=3 * 10**8, cache_write_bytes=10**8, flops=2 * 10**10)
    assert cost.bytes == 10**9
    memory_heavy = MachineRates(stream_bytes_per_s=1e10, matmul_flops_per_s=1e12, dtype="float32", device="cpu", how="")
    assert roofline.floor_seconds(cost, memory_heavy) == pytest.approx(0.1)  # 1e9 B / 1e10 > 2e10 / 1e12 = 0.02
    assert roofline.bound(cost, memory_heavy) == "memory"
    compute_heavy = MachineRates(stream_bytes_per_s=1e11, matmul_flops_per_s=1e11, dtype="float32", device="cpu", how="")
    assert roofline.floor_seconds(cost, compute_heavy) == pytest.approx(0.2)  # 2e10 / 1e11 > 1e9 / 1e11
    assert roofline.bound(cost, compute_heavy) == "compute"
    assert roofline.mbu(cost, 0.2, memory_heavy) == pytest.approx(0.5)
    assert roofline.mfu(cost, 0.4, compute_heavy) == pytest.approx(0.5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch=0"):
        roofline.decode_step_cost(tiny("gqa"), batch=0, context=4)
    with pytest.raises(ValueError, match="prompt_len=0"):
        roofline.prefill_cost(tiny("gqa"), batch=1, prompt_len=0)


def test_measure_machine_gives_finite_positive_rates_quickly():
    rates = roofline.measure_machine(tiny("gqa"), matmul_size=256, repeats=2)
    for rate in (rates.stream_bytes_per_s, rates.matmul_flops_per_s, rates.gemv_bytes_per_s, rates.copy_bytes_per_s):
        assert math.isfinite(rate) and rate > 0
    assert rates.dtype == "float32" and rates.device == "cpu" and "F.linear" in rates.how and "read" in rates.how
    # the compute ceiling is never below what the streaming GEMVs reached: 2 FLOPs per 4-byte weight
    assert rates.matmul_flops_per_s >= rates.gemv_bytes_per_s * 2 / 4 * (1 - 1e-9)
    # the read rate past any cache is the one measured over the largest buffer, of at least 1 GiB
    assert rates.read_rates.sizes[-1] >= 2**30 and rates.stream_bytes_per_s == rates.read_rates.rates[-1]
    fields = rates.row_fields()
    assert fields["stream_gb_s"] == fields["read_gb_s"] == pytest.approx(rates.stream_bytes_per_s / 1e9)
    assert fields["gemv_gb_s"] == pytest.approx(rates.gemv_bytes_per_s / 1e9)


def test_the_floor_is_priced_at_the_read_rate_never_the_gemv_rate():
    """bytes / the read rate measured for a working set of the step's size; torch's GEMV rate changes nothing."""
    read = roofline.ReadRates(sizes=(2**20, 2**21, 2**22, 2**23), rates=(80e9, 60e9, 40e9, 20e9))
    cost = roofline.StepCost(weight_bytes=3 * 2**20, cache_read_bytes=0, cache_write_bytes=0, flops=1)
    slow_gemv = MachineRates(20e9, 1e15, "float32", "cpu", "", read_rates=read, gemv_bytes_per_s=5e9)
    fast_gemv = dataclasses.replace(slow_gemv, gemv_bytes_per_s=500e9)
    # 3 MiB: the largest size within it is 2 MiB; 1 MiB's faster rate is a cache a 3 MiB working set does not fit
    assert roofline.floor_seconds(cost, slow_gemv) == roofline.floor_seconds(cost, fast_gemv) == 3 * 2**20 / 60e9
    assert roofline.mbu(cost, 3 * 2**20 / 60e9, slow_gemv) == pytest.approx(1.0)  # at the floor: 100%, never above
    assert read.at(2**23) == 20e9  # 8 MiB: its own size's rate
    assert read.at(2**30) == 20e9  # past the largest size: the memory's own rate
    assert read.at(1000) == 80e9  # below the smallest: the fastest measured
    no_curve = MachineRates(20e9, 1e15, "float32", "cuda", "")
    assert roofline.floor_seconds(cost, no_curve) == 3 * 2**20 / 20e9


def test_a_slow_pass_cannot_raise_the_floor():
    """Measured rates that rise with size (a noisy pass at a smaller one) are read as the larger size's: a working set
    reads at least as fast as any larger one did; past a cache cliff the floor takes the memory's rate, not the
    cache's."""
    noisy = roofline.ReadRates(sizes=(2**20, 2**21, 2**22, 2**23), rates=(80e9, 30e9, 50e9, 20e9))
    assert noisy.at(2**21) == noisy.at(3 * 2**20) == 50e9  # 2 MiB's slow pass: 4 MiB read faster
    assert noisy.at(2**22) == 50e9 and noisy.at(2**24) == 20e9
    cliff = roofline.ReadRates(sizes=(2**25, 2**26, 2**27), rates=(54e9, 31e9, 30e9))  # a 32 MiB L3, then memory
    assert cliff.at(91 * 10**6) == 31e9


def test_disturbance_says_when_the_read_rate_moved():
    assert "steady" in roofline.disturbance(30e9, 28e9)
    assert "DISTURBED" in roofline.disturbance(30e9, 20e9)
    assert "DISTURBED" in roofline.disturbance(20e9, 30e9)


def test_a_cell_is_priced_at_the_faster_of_the_sweeps_around_it():
    """Size by size the higher of two sweeps; the run's matmul and GEMV rates stay; sweeps of other sizes are refused;
    two readings more than 15% apart have moved."""
    before = roofline.ReadRates(sizes=(2**20, 2**21, 2**22), rates=(80e9, 30e9, 31e9))
    after = roofline.ReadRates(sizes=(2**20, 2**21, 2**22), rates=(70e9, 52e9, 29e9))
    both = before.higher(after)
    assert both.rates == (80e9, 52e9, 31e9)
    run = MachineRates(25e9, 1e12, "float32", "cpu", "run", read_rates=before, gemv_bytes_per_s=5e9)
    cell = run.priced_at(both)
    assert cell.stream_bytes_per_s == 31e9 and cell.read_rates is both
    assert (cell.matmul_flops_per_s, cell.gemv_bytes_per_s, cell.how) == (1e12, 5e9, "run")
    cost = roofline.StepCost(weight_bytes=3 * 2**20, cache_read_bytes=0, cache_write_bytes=0, flops=1)
    assert roofline.floor_seconds(cost, cell) == 3 * 2**20 / 52e9  # after's 2 MiB rate: the faster one
    with pytest.raises(ValueError, match="different sizes"):
        before.higher(roofline.ReadRates(sizes=(2**20,), rates=(1e9,)))
    assert roofline.moved(30e9, 36e9) and roofline.moved(36e9, 30e9) and not roofline.moved(30e9, 34e9)


def test_a_read_sweep_refuses_a_buffer_or_size_it_cannot_read():
    with pytest.raises(ValueError, match=f"{roofline.READ_BYTES} bytes"):
        roofline.measure_read_rates(buffer=torch.zeros(1024, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"64 to \d+ bytes, got \[0\]"):
        roofline.measure_read_rates(also=(0,))


def test_a_read_sweep_also_reads_at_a_steps_own_size():
    """Beside the powers of two, the step's bytes in whole lines: a 93 MB step priced at its own size's rate, not at
    64 MiB's (which a 32 MiB L3 can still speed up)."""
    sweep = roofline.measure_read_rates(repeats=1, also=(93_000_005,))
    assert 93_000_000 in sweep.sizes and sweep.sizes == tuple(sorted(sweep.sizes))
    assert sweep.at(93_000_005) == max(sweep.rates[sweep.sizes.index(93_000_000):])
    assert {2**20, 2**26, 2**27, 2**30} <= set(sweep.sizes)
