"""kernels/cpu/dense_gemv.c (cpu_decode.dense_gemv) equals F.linear, and Linear takes it for decode-sized fp32 and bf16
batches only: fp32 to rounding, bf16 to one bf16 rounding of the fp32 product of the same bf16 inputs."""
import platform
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import Linear, cpu_decode, cpu_kernels_available
from kernels.linear import GEMV_ROWS
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model  # tests/ on sys.path

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels did not build")


def operands(rows, k, n, dtype, bias, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x, weight, b = (torch.randn(*shape, generator=generator) for shape in ((*rows, k), (n, k), (n,)))
    return x.to(dtype), weight.to(dtype), b.to(dtype) if bias else None


def assert_linear(got, x, weight, bias):
    """got against fp32 F.linear of the same inputs: fp32 sums differ in order only (1e-5 of the output's scale); a
    bf16 output is also rounded once (half a bf16 unit, 2^-9 of the value)."""
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == want.shape
    rtol = 0 if x.dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=1e-5 * want.abs().max().item())


@contextmanager
def kernels_off(monkeypatch):
    """ARCHZOO_CPU_KERNELS=0 as a fresh process sees it: no library, so every dispatch takes the references."""
    with monkeypatch.context() as patch:
        patch.setenv(cpu_decode.DISABLE_ENV, "0")
        cpu_decode._library.cache_clear()
        try:
            yield
        finally:
            patch.undo()
            cpu_decode._library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("k,n", [(100, 37), (256, 64), (1030, 9)])  # ragged K and N; whole lines; several K blocks
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear(dtype, rows, k, n, bias):
    x, weight, b = operands((rows,), k, n, dtype, bias, seed=rows + k)
    assert_linear(cpu_decode.dense_gemv(x, weight, b), x, weight, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_and_batched_x(dtype):
    """x as a view of a wider tensor (rows apart by more than K), with a column stride (copied), and [B, T, K]."""
    _, weight, b = operands((), 100, 37, dtype, True)
    shapes = ((5, 131), (5, 200), (100, 5), (3, 5, 100))
    wide, strided, tall, batched = (torch.randn(*shape).to(dtype) for shape in shapes)
    for x in (wide[:, 7:107], strided[:, ::2], tall.t(), batched):
        assert_linear(cpu_decode.dense_gemv(x, weight, b), x, weight, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_layers_in_one_call_equal_f_linear(dtype, rows):
    """dense_gemv_layers (a step's bare layers called one after another in C) gives each layer's F.linear."""
    shapes = [(64, 96), (13, 37), (130, 64), (7, 5)]  # (n, k): tails of tiles and of vectors too
    pairs = [operands((rows,), k, n, dtype, False, seed=i)[:2] for i, (n, k) in enumerate(shapes)]
    got = cpu_decode.dense_gemv_layers([x for x, _ in pairs], [w for _, w in pairs])
    for out, (x, w) in zip(got, pairs):
        assert_linear(out, x, w, None)
        # a step this small prefetches as from cache, the op on its own as from memory: the same sums either way
        assert torch.equal(out, cpu_decode.dense_gemv(x, w, None))
    with pytest.raises(ValueError, match="the same m"):  # refused before any work
        cpu_decode.dense_gemv_layers([pairs[0][0], torch.randn(rows + 1, 37).to(dtype)], [pairs[0][1], pairs[1][1]])


def last_level_cache_bytes() -> int | None:
    """The largest unified cache the kernel lists for CPU 0 (Linux's sysfs), or None where it lists none."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Unified":
                size = (index / "size").read_text().strip()
                sizes.append(int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]])
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=None)


def test_row_prefetch_distance_by_where_the_step_lies():
    """A step whose weights fit in a quarter of the last-level cache prefetches further ahead than one from memory
    (twice that cache, or bytes not known); the rule reads the cache's size from the C library, the test from sysfs."""
    memory = cpu_decode.row_prefetch_bytes(-1)
    assert memory >= 64 and cpu_decode.row_prefetch_bytes(1 << 50) == memory
    cache = last_level_cache_bytes()
    if cache is not None and platform.machine() in ("x86_64", "AMD64"):  # where glibc reads the cache's size
        assert cpu_decode.row_prefetch_bytes(cache // 4) > memory
        assert cpu_decode.row_prefetch_bytes(2 * cache) == memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_rows_walked_in_order_sum_as_the_tiles(dtype):
    """Two rows of x walk each weight row in address order; three take the tiles: the same sums in the same order,
    bit for bit, tails of lines and of tiles included."""
    x, weight, b = operands((3,), 1030, 37, dtype, True, seed=5)
    assert torch.equal(cpu_decode.dense_gemv(x[:2], weight, b), cpu_decode.dense_gemv(x, weight, b)[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_rows_than_a_pass_holds(dtype):
    """Past 16 rows the kernel passes over the weights again: still exact (Linear does not send such batches)."""
    x, weight, b = operands((40,), 100, 37, dtype, True)
    assert_linear(cpu_decode.dense_gemv(x, weight, b), x, weight, b)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("target", [["-mno-avx512bf16"], ["-march=haswell"], ["-march=x86-64"]],
                         ids=["no dpbf16", "avx2", "generic vectors"])
def test_the_paths_other_cpus_take(monkeypatch, target):
    """The machines vary: bf16 by widening (no AVX512-BF16), the AVX2 tiles (8 lanes, 2 x rows) and GCC's generic
    vectors (no AVX: int8 converted without x86 intrinsics) built here too; int8 on the same tiles."""
    flags = [flag for flag in cpu_decode.FLAGS if not (target[0].startswith("-march") and flag.startswith("-march"))]
    monkeypatch.setattr(cpu_decode, "FLAGS", flags + target)
    cpu_decode._library.cache_clear()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 2, 3, 16):  # the plain functions: the ops' C++ glue holds the first build's kernels
                x, weight, b = operands((rows,), 1030, 37, dtype, True, seed=rows)
                assert_linear(cpu_decode.dense_gemv_eager(x, weight, b), x, weight, b)
                q8 = torch.randint(-127, 128, weight.shape, dtype=torch.int8)
                scales = torch.rand(37).to(dtype)
                assert_linear(cpu_decode.quantized_gemv_eager(x, q8, scales, None, 0), x, q8 * scales.float()[:, None],
                              None)
    finally:
        monkeypatch.undo()
        cpu_decode._library.cache_clear()


def linear_calls(monkeypatch) -> list:
    """The shapes of x that Linear hands to the C GEMV from now on (the op compiled, the plain function eagerly)."""
    calls = []
    for name in ("dense_gemv", "dense_gemv_eager"):
        real = getattr(cpu_decode, name)
        monkeypatch.setattr(cpu_decode, name, lambda x, *args, real=real: calls.append(tuple(x.shape)) or real(x, *args))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_dispatch(monkeypatch, dtype):
    """fp32 batches of 1..16 rows and bf16 ones of 1..8 take the C GEMV when no gradient is recorded (where it measured
    fastest, kernels/linear.py); other sizes, fp16, a gradient to record, and ARCHZOO_CPU_KERNELS=0 take torch's
    paths. All equal F.linear."""
    calls = linear_calls(monkeypatch)
    layer = Linear(100, 37).to(dtype)
    taken = GEMV_ROWS.get(dtype, ())
    for shape in ((1, 100), (2, 1, 100), (3, 100), (4, 100), (8, 100), (9, 100), (16, 100), (17, 100), (0, 100)):
        calls.clear()
        x = torch.randn(shape).to(dtype)
        with torch.no_grad():
            got = layer(x)
        rows = x.numel() // 100
        assert calls == ([shape] if rows in taken else []), shape
        if rows and dtype != torch.float16:
            assert_linear(got, x, layer.weight, layer.bias)
    assert list(GEMV_ROWS[torch.float32]) == list(range(1, 17)) and list(GEMV_ROWS[torch.bfloat16]) == list(range(1, 9))
    x = torch.randn(3, 100).to(dtype)
    calls.clear()
    layer(x).sum().backward()  # weights that require grad, grad mode on: autograd's path
    assert calls == [] and layer.weight.grad is not None
    with kernels_off(monkeypatch), torch.no_grad():
        layer(x)
    assert calls == []


def test_compiled_op_equals_eager():
    """A custom op: torch.compile(fullgraph=True) keeps Linear's C GEMV in the graph, and the result is eager's."""
    layer = Linear(100, 37).to(torch.bfloat16)
    x = torch.randn(2, 2, 100).to(torch.bfloat16)  # 4 rows: the C GEMV's
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), cpu_decode.dense_gemv(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_engine_decodes_as_without_the_kernels(monkeypatch):
    """A tiny fp32 model's greedy decode through the C GEMV gives the tokens (and logits) of the references."""
    from harness import Engine

    model = random_model("gqa")
    prompts = make_prompts([5, 19, 11], model.config.vocab_size)  # 3 rows a decode step: fp32's C GEMV takes 1..16
    calls = linear_calls(monkeypatch)
    fast = Engine(model, max_batch=3, max_seq_len=40).generate(prompts, greedy(8))
    assert calls, "the engine's linear layers never took the C GEMV"
    with kernels_off(monkeypatch):
        plain = Engine(model, max_batch=3, max_seq_len=40).generate(prompts, greedy(8))
    for got, want in zip(fast, plain):
        assert_not_constant(want.token_ids)
        assert_same_output(got, want, context="dense_gemv vs references")


def test_transposed_path_takes_only_the_rows_above_the_c_gemv():
    """W @ x^T is for fp32 batches of 17..64 rows, above the C GEMV's 1..16: at 1-16 rows it streams at half the C
    GEMV's rate or less."""
    from kernels.linear import transposed_path

    x32, x16 = torch.zeros(1, 8), torch.zeros(1, 8, dtype=torch.bfloat16)
    assert [rows for rows in range(1, 70) if transposed_path(x32, rows)] == list(range(17, 65))
    assert not any(transposed_path(x16, rows) for rows in range(1, 70))
