"""Compiles every Triton kernel for real GPUs (A100: sm_80, H100: sm_90) on a CPU-only machine, at the sizes the
models use, in fp32, fp16 and bf16, and reports each cubin's registers, shared and local memory (spills).

Run as a script, without TRITON_INTERPRET: in a process where the interpreter has run, triton's language functions
stay patched for it and a real compile fails. It prints one JSON line per compiled kernel.
tests/kernels/test_gpu_compile.py runs it twice and checks the lines: with the triton installed here (CI's) and
with the GPU machines' triton (3.6.0, torch 2.11's), pip-installed into a cache folder and put first on sys.path,
the torch staying the installed one. By hand:

    python3 tests/kernels/gpu_compile.py
    PYTHONPATH=$HOME/.cache/archzoo/triton-3.6.0:. python3 tests/kernels/gpu_compile.py --triton 3.6.0

--triton VERSION refuses to compile (exit 2) unless the triton imported is that release: importing torch may import
triton itself, so where it came from is checked, not assumed.

Each case calls a kernel's launch wrapper with tensors of the wanted dtype while the wrapper's jitted kernels are
swapped for recorders, so the exact arguments, constexprs and num_warps of every launch are captured without running
anything. Each captured launch is then compiled with `triton.compile` for a `GPUTarget`, and the bundled cuobjdump
reads the cubin's resource usage.
"""
import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from kernels import (gated_delta, grouped_matmul, linear_attention, mla_attention, paged_attention, paged_write,
                     quantized_matmul, retention_decay)
from kernels import rwkv7

ssu = importlib.import_module("kernels.selective_state_update")  # the package exports a function of that name

TARGETS = {"sm_80": 80, "sm_90": 90}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
                 torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")


class Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` is logged, not run."""

    def __init__(self, jitted, launches: list):
        self.fn, self.launches = jitted.fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def record(module, call) -> list:
    """The launches `call` makes through `module`'s jitted kernels (mla's tuple holds paged_attention's merge)."""
    launches = []
    name = "_jitted_kernels" if hasattr(module, "_jitted_kernels") else "_jitted_kernel"
    real = getattr(module, name)
    recorded = real()
    wrapped = (tuple(Recorder(k, launches) for k in recorded) if isinstance(recorded, tuple)
               else Recorder(recorded, launches))
    setattr(module, name, lambda: wrapped)
    try:
        call()
    finally:
        setattr(module, name, real)
    if not launches:
        raise RuntimeError(f"{module.__name__}: the wrapper launched nothing")
    return launches


def signature(fn: JITFunction, args, kwargs) -> tuple[dict, dict, dict]:
    bound = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    types, constants = {}, {}
    for param in fn.params:
        value = bound[param.name]
        if param.is_constexpr:
            types[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            types[param.name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            types[param.name] = "i1"
        elif isinstance(value, int):
            types[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            types[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return types, constants, {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}


def resource_usage(cubin: bytes, folder: Path) -> dict[str, int]:
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    report = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", report))
    if not usage:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{report}")
    return {k: int(v) for k, v in usage.items()}


def compile_launches(launches, cc: int, folder: Path) -> list[tuple[str, dict]]:
    results = []
    for fn, args, kwargs in launches:
        jitted = JITFunction(fn)
        types, constants, options = signature(jitted, args, kwargs)
        source = triton.compiler.ASTSource(fn=jitted, signature=types, constexprs=constants)
        target = GPUTarget("cuda", cc, 32)
        backend = triton.compiler.make_backend(target)
        compiled = triton.compile(source, target=target, options=backend.parse_options(options).__dict__)
        results.append((fn.__name__, resource_usage(compiled.asm["cubin"], folder)))
    return results


def paged_case(dtype, span=False, head_dim=128, heads=(32, 8), stride=1):
    """span: the bounded-retention launch (per-sequence span starts, 4 sinks, 128 keys at most); stride > 1: a
    dilated window's (no sinks)."""
    def call():
        blocks, block_size = 64, 16
        q = torch.empty(4, heads[0], head_dim, dtype=dtype)
        pool = torch.empty(blocks, heads[1], block_size, head_dim, dtype=dtype).transpose(1, 2)  # the engine's layout
        table = torch.zeros(4, 16, dtype=torch.int32)
        lengths = torch.full((4,), 200, dtype=torch.int32)
        bounds = dict(starts=lengths - 124, sinks=4 if stride == 1 else 0, max_keys=128, stride=stride) if span else {}
        paged_attention.paged_decode_attention_triton(q, pool, pool, table, lengths, 0.1, **bounds)
    return paged_attention, call


def paged_int8_case(dtype, element=torch.int8):
    """A one-byte KV pool (kv_dtype "int8", or "fp8" with element float8_e4m3fn): a scale per row in the model's dtype."""
    def call():
        blocks, block_size = 64, 16
        q = torch.empty(4, 32, 128, dtype=dtype)
        pool = torch.empty(blocks, 8, block_size, 128, dtype=element).transpose(1, 2)
        scales = torch.empty(blocks, 8, block_size, 1, dtype=dtype).transpose(1, 2)
        paged_attention.paged_decode_attention_triton(q, pool, pool, torch.zeros(4, 16, dtype=torch.int32),
                                                      torch.full((4,), 200, dtype=torch.int32), 0.1,
                                                      k_scales=scales, v_scales=scales)
    return paged_attention, call


def gemv_case(dtype, int4: bool):
    """A base-size weight (2048 x 768) at decode batch 4: int8 per channel, or int4 in groups of 128."""
    def call():
        x = torch.empty(4, 768, dtype=dtype)
        if int4:
            quantized_matmul.quantized_gemv_triton(x, torch.empty(2048, 384, dtype=torch.uint8),
                                                   torch.empty(2048, 6, dtype=dtype), torch.empty(2048, 6, dtype=dtype),
                                                   128)
        else:
            quantized_matmul.quantized_gemv_triton(x, torch.empty(2048, 768, dtype=torch.int8),
                                                   torch.empty(2048, dtype=dtype), None)
    return quantized_matmul, call


def mla_case(dtype, element=None):
    def call():  # DeepSeek-V2's latent: 512 + 64 rope columns, 128 heads; one-byte: a scale for each of the two
        q = torch.empty(2, 128, 576, dtype=dtype)
        pool = torch.empty(32, 16, 576, dtype=element or dtype)
        scales = None if element is None else torch.empty(32, 16, 2, dtype=dtype)
        mla_attention.mla_decode_attention_triton(q, pool, torch.zeros(2, 8, dtype=torch.int32),
                                                  torch.full((2,), 100, dtype=torch.int32), 0.1, 512,
                                                  latent_scales=scales)
    return mla_attention, call


def write_case(dtype, keys_only=False):
    def call():
        k = torch.empty(6, 8, 576 if keys_only else 128, dtype=dtype)
        pool = torch.empty(16, 8 if not keys_only else 1, 16, k.shape[-1], dtype=dtype).transpose(1, 2)
        if keys_only:
            paged_write.write_paged_kv_triton(k[:, :1], None, pool, None, torch.arange(6))
        else:
            paged_write.write_paged_kv_triton(k, k, pool, pool, torch.arange(6))
    return paged_write, call


def state_update_case(dtype, mamba2: bool):
    def call():
        if mamba2:  # 80 heads x 64, d_state 128, one group
            state = torch.empty(2, 80, 64, 128, dtype=dtype)
            x = torch.empty(2, 80, 64, dtype=dtype)
            A = torch.empty(80, 64, 128)
            B = C = torch.empty(2, 1, 128, dtype=dtype)
            D, bias = torch.empty(80, 64), torch.empty(80, 64)
        else:  # Mamba-1: d_inner 1536, d_state 16
            state = torch.empty(2, 1536, 16, dtype=dtype)
            x = torch.empty(2, 1536, dtype=dtype)
            A = torch.empty(1536, 16)
            B = C = torch.empty(2, 16, dtype=dtype)
            D, bias = torch.empty(1536), torch.empty(1536)
        ssu.selective_state_update_triton(state, x, x, A, B, C, D=D, z=x, dt_bias=bias, dt_softplus=True)
    return ssu, call


def linear_step_case(dtype):
    def call():
        q = torch.empty(4, 16, 128, dtype=dtype)
        state, normalizer = torch.empty(4, 16, 128, 128), torch.empty(4, 16, 128)
        linear_attention.linear_attention_step_triton(q, q, q, state, normalizer)
    return linear_attention, call


def linear_chunked_case(dtype):
    def call():
        q = torch.empty(2, 16, 256, 128, dtype=dtype)
        state, normalizer = torch.empty(2, 16, 128, 128), torch.empty(2, 16, 128)
        linear_attention.linear_attention_chunked_triton(q, q, q, state, normalizer)
    return linear_attention, call


def gated_delta_step_case(dtype):
    def call():  # Qwen3-Next's Gated DeltaNet layers: 32 value heads, dk = dv = 128, fp32 state
        q = torch.empty(4, 32, 128, dtype=dtype)
        g, beta = torch.empty(4, 32), torch.empty(4, 32)
        state = torch.empty(4, 32, 128, 128)
        gated_delta.gated_delta_step_triton(q, q, q, g, beta, state)
    return gated_delta, call


def retention_decay_step_case(dtype):
    def call():  # RetNet-1.3B's layers: 8 heads, dk 256, dv 512 (expand_v 2), fp32 state
        q, v = torch.empty(4, 8, 256, dtype=dtype), torch.empty(4, 8, 512, dtype=dtype)
        g = torch.empty(4, 8)
        state = torch.empty(4, 8, 256, 512)
        retention_decay.retention_decay_step_triton(q, q, v, g, state)
    return retention_decay, call


def rwkv7_step_case(dtype):
    def call():  # RWKV-7 World 2.9B's layers: 40 heads, dk = dv = 64, fp32 state
        key = torch.empty(4, 40, 64, dtype=dtype)
        state = torch.empty(4, 40, 64, 64)
        rwkv7.rwkv7_step_triton(key, key, key, key, key, key, state)
    return rwkv7, call


def grouped_matmul_case(dtype):
    def call():  # Mixtral-8x7B's experts' gate/up projection: 4096 -> 14336, 8 experts, 16 tokens routed top 2
        x = torch.empty(16, 4096, dtype=dtype)
        weight = torch.empty(1, 1, 1, dtype=dtype).expand(8, 14336, 4096)  # strides, not memory: nothing runs
        experts = torch.arange(32) % 8
        grouped_matmul.grouped_matmul_triton(x, weight, experts, torch.arange(16).repeat_interleave(2))
    return grouped_matmul, call


CASES = {
    "paged": lambda dtype: paged_case(dtype),
    "paged-span": lambda dtype: paged_case(dtype, span=True),
    "paged-dilated": lambda dtype: paged_case(dtype, span=True, stride=4),
    "paged-head64-mha": lambda dtype: paged_case(dtype, head_dim=64, heads=(12, 12)),
    "paged-int8-kv": paged_int8_case,
    "paged-fp8-kv": lambda dtype: paged_int8_case(dtype, torch.float8_e4m3fn),
    "gemv-int8": lambda dtype: gemv_case(dtype, int4=False),
    "gemv-int4": lambda dtype: gemv_case(dtype, int4=True),
    "mla": mla_case,
    "mla-int8": lambda dtype: mla_case(dtype, torch.int8),
    "mla-fp8": lambda dtype: mla_case(dtype, torch.float8_e4m3fn),
    "write": lambda dtype: write_case(dtype),
    "write-keys-only": lambda dtype: write_case(dtype, keys_only=True),
    "mamba-state": lambda dtype: state_update_case(dtype, mamba2=False),
    "mamba2-state": lambda dtype: state_update_case(dtype, mamba2=True),
    "linear-step": linear_step_case,
    "linear-chunked": linear_chunked_case,
    "gated-delta-step": gated_delta_step_case,
    "rwkv7-step": rwkv7_step_case,
    "retention-decay-step": retention_decay_step_case,
    "moe-grouped-matmul": grouped_matmul_case,
}
# float8 e4m3 is native from sm_89 (Ada, Hopper) on; Triton refuses it below, and the engine refuses kv_dtype="fp8" there
FP8_CASES = ("paged-fp8-kv", "mla-fp8")


def targets(case: str) -> dict[str, int]:
    """The GPU targets a case is built for."""
    return {t: cc for t, cc in TARGETS.items() if cc >= 89} if case in FP8_CASES else TARGETS


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton", metavar="VERSION", help="exit 2 unless the triton imported is this release")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    wanted = arguments(argv).triton
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_compile: run without TRITON_INTERPRET=1 (the interpreter's patches break a real compile)",
              file=sys.stderr)
        return 2
    if wanted and triton.__version__ != wanted:
        print(f"gpu_compile: triton {triton.__version__} was imported from {triton.__file__}, not {wanted}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        for case, make in CASES.items():
            for dtype_name, dtype in DTYPES.items():
                module, call = make(dtype)
                launches = record(module, call)
                for target, cc in targets(case).items():
                    try:
                        compiled = compile_launches(launches, cc, Path(folder))
                    except Exception as error:  # reported as a line: one broken kernel does not hide the others
                        compiled = [("(compile)", {"error": f"{type(error).__name__}: {str(error)[-400:]}"})]
                    for kernel, usage in compiled:
                        print(json.dumps({"case": case, "dtype": dtype_name, "target": target, "kernel": kernel,
                                          **usage}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
