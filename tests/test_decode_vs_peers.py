"""benchmarks/decode_vs_peers.py on the tiny preset: archzoo and transformers always measured, llama.cpp where
llama-cpp-python is installed (CI: its rows are skipped with the reason), bad arguments refused; and llama.cpp's
greedy tokens on a `small` f32 export equal to the engine's (skipped without llama-cpp-python, so in CI)."""
import ctypes
import importlib.util
import re
import sys

import numpy as np
import pytest
import torch

import zoo
from harness import Engine
from helpers import assert_not_constant, greedy, spread_weights  # tests/ is on sys.path under pytest
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports decode_vs_hf.py beside it, as a script run there would
spec = importlib.util.spec_from_file_location("decode_vs_peers", REPO_ROOT / "benchmarks" / "decode_vs_peers.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

SMOKE = ["--preset", "tiny", "--prompt-len", "16", "--new-tokens", "4", "--repeats", "1"]


def rows(out: str) -> dict[tuple[str, str], list[str]]:
    """(dtype, side) -> the table row's cells."""
    lines = [line for line in out.splitlines() if re.match(r"\| (f32|bf16|q8_0) \|", line)]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {(c[0], c[1]): c for c in cells}


def test_smoke_measures_every_side_it_can(capsys):
    assert bench.main(SMOKE) == 0
    out = capsys.readouterr().out
    table = rows(out)
    for dtype in ("f32", "bf16"):
        for side in ("archzoo", "transformers"):
            assert float(table[(dtype, side)][3]) > 0, (dtype, side)
    assert float(table[("q8_0", "archzoo int8")][3]) > 0  # Q8_0's counterpart, measured with or without llama.cpp
    assert table[("q8_0", "archzoo int8")][7].startswith("vs archzoo f32: ")
    assert "read rate" in out
    if isinstance(bench.llama_cpp_module(), str):
        assert "llama.cpp rows skipped" in out
        assert not any(side == "llama.cpp" for _, side in table)
    else:
        for dtype in ("f32", "bf16", "q8_0"):
            assert float(table[(dtype, "llama.cpp")][3]) > 0, dtype
        assert table[("f32", "llama.cpp")][7] == "vs archzoo f32: identical (4/4)"


def test_without_llama_cpp_the_other_sides_are_still_measured(monkeypatch, capsys):
    monkeypatch.setattr(bench, "llama_cpp_module", lambda: "No module named 'llama_cpp' (pip install -e '.[peers]')")
    assert bench.main(SMOKE + ["--dtypes", "f32,q8_0"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp rows skipped: No module named 'llama_cpp'" in out
    assert set(rows(out)) == {("f32", "archzoo"), ("f32", "transformers"), ("q8_0", "archzoo int8")}


@pytest.mark.parametrize("extra, message", [
    (["--dtypes", "int4"], "int4"), (["--new-tokens", "1"], "must be >= 2"), (["--repeats", "0"], "must be >= 1"),
    (["--prompt-len", "600"], "max_seq_len"),
])
def test_bad_arguments_are_refused_before_any_work(monkeypatch, capsys, extra, message):
    monkeypatch.setattr(bench, "build_model", lambda preset: pytest.fail("built a model before refusing"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(SMOKE + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_llama_cpp_greedy_equals_the_engine_on_the_f32_export(tmp_path):
    """Runs only with llama-cpp-python installed (the peers extra): CI skips it. llama.cpp's KV cache in f32, so the
    two differ only in kernels and summation order."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from zoo.gguf_export import export_gguf

    model = spread_weights(zoo.build("gqa", preset="small", tie_embeddings=False), seed=0)
    prompt = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = Engine(model, max_batch=1, max_seq_len=80).generate([prompt], greedy(32))[0].token_ids
    llm = llama_cpp.Llama(str(export_gguf(model, tmp_path / "m.gguf", "f32")), n_ctx=80, n_batch=48, n_threads=2,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    assert_not_constant(ours, "engine")
    assert bench.llama_greedy(llm, prompt, 32) == ours


def test_q8_0_export_equals_llama_cpp_quantizing_the_f32_export(tmp_path):
    """Runs only with llama-cpp-python installed: llama.cpp's own quantizer on the f32 file gives the same bytes."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import gguf

    from zoo.gguf_export import export_gguf

    model = spread_weights(zoo.build("gqa", preset="tiny", tie_embeddings=False), seed=0)
    f32, ours, theirs = export_gguf(model, tmp_path / "f32.gguf", "f32"), tmp_path / "q8.gguf", tmp_path / "llama.gguf"
    export_gguf(model, ours, "q8_0")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = gguf.LlamaFileType.MOSTLY_Q8_0
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    mine = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    for t in gguf.GGUFReader(theirs).tensors:
        assert mine[t.name].tensor_type == t.tensor_type, t.name
        assert np.array_equal(mine[t.name].data, t.data), t.name
