"""Our top-level `kernels` package must not pass for the Hugging Face Hub's `kernels` package.

transformers asks `is_kernels_available()` before routing layers to Hub kernels; it finds any importable
`kernels` by name, then requires distribution metadata with a version in its supported range. Ours has no
such metadata, so the check must say False, and transformers' Llama must keep working beside it.
"""
import os
import pathlib
import subprocess
import sys

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_our_kernels_package_is_the_one_imported():
    import kernels

    assert pathlib.Path(kernels.__file__).resolve().parent == REPO_ROOT / "kernels"
    assert hasattr(kernels, "paged_decode_attention")  # ours, not the Hub's (which exposes get_kernel)
    assert not hasattr(kernels, "get_kernel")


def test_transformers_does_not_see_hub_kernels():
    import kernels  # noqa: F401  (ours, importable under the Hub package's name)
    from transformers.utils import import_utils

    assert hasattr(import_utils, "is_kernels_available"), "transformers renamed its Hub-kernels check; update this test"
    import_utils.is_kernels_available.cache_clear()  # lru_cached: ask afresh now that ours is imported
    assert import_utils.is_kernels_available() is False
    # Why it is False: the import name resolves, but the version found is not a Hub kernels version. With
    # archzoo installed (pip install -e .), distribution metadata maps `kernels` to archzoo and its version.
    exists, version = import_utils._is_package_available("kernels", return_version=True)
    assert version in ("N/A", archzoo_version()), version


def archzoo_version() -> str:
    """pyproject's version: the one transformers reads for `kernels` once archzoo is installed."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    return next(line.split("=", 1)[1].strip().strip('"') for line in text.splitlines() if line.startswith("version"))


def test_archzoo_version_stays_outside_the_hub_kernels_range():
    """Installed, archzoo lends its version to `kernels`; inside transformers' range it would pass the check."""
    from packaging import version
    from transformers.utils import import_utils

    ours = version.parse(archzoo_version())
    low, high = version.parse(import_utils.KERNELS_MIN_VERSION), version.parse(import_utils.KERNELS_MAX_VERSION)
    assert not low <= ours < high, f"archzoo {ours} falls in transformers' Hub kernels range [{low}, {high})"


def test_llama_modeling_imports_and_runs_beside_our_kernels():
    import kernels  # noqa: F401
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = modeling_llama.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 64) and torch.isfinite(logits).all()


def test_fresh_interpreter_with_kernels_imported_first():
    """Import order and transformers' caches cannot hide the problem: a clean process, ours imported first."""
    code = (
        "import kernels, transformers\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert kernels.__file__.startswith(%r), kernels.__file__\n"
        "assert is_kernels_available() is False\n"
        "from transformers import LlamaForCausalLM, LlamaConfig\n"
        "import torch\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=4, num_key_value_heads=2))\n"
        "print(tuple(m(torch.tensor([[1, 2]])).logits.shape))\n"
    ) % str(REPO_ROOT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "(1, 2, 64)"
