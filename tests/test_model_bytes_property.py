"""The parameter-bytes estimate is the model: for random registry architectures and small sizes, either the estimate
refuses under the memory limit before any tensor is made, or the build succeeds and holds exactly the bytes estimated
(parameters and buffers, a tied head once) (issue 33)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import zoo
from tests.test_model_size_bounds import Allocations
from zoo.model import model_bytes


@st.composite
def configs(draw) -> zoo.ModelConfig:
    """A registry config at small sizes whose heads, widths and sharing fit together."""
    arch = draw(st.sampled_from(zoo.architectures()))
    n_heads = draw(st.sampled_from([1, 2, 4]))
    head_width = draw(st.sampled_from([8, 16, 32]))  # even halves for RoPE (MLA's rope key is half a head)
    n_layers = draw(st.integers(1, 4))
    overrides = {
        "d_model": n_heads * head_width, "n_heads": n_heads, "n_layers": n_layers,
        "gqa_kv_heads": draw(st.sampled_from([k for k in (1, 2, 4) if n_heads % k == 0])),
        "vocab_size": draw(st.integers(1, 600)), "tie_embeddings": draw(st.booleans()),
        "mlp": draw(st.sampled_from(["swiglu", "gelu", "none"])), "mlp_hidden": draw(st.integers(1, 200)),
        "norm": draw(st.sampled_from(["rmsnorm", "layernorm"])),
    }
    if any(spec.kind == "mamba2" for spec in zoo.make_config(arch, "tiny").layers):  # mamba2 or a hybrid with it:
        overrides["head_dim"] = head_width  # its default head_dim 64 need not divide expand * d_model
    if arch == "cla":  # the share factor must divide the layer count
        overrides["share"] = 2 if n_layers % 2 == 0 else 1
    return zoo.make_config(arch, "tiny", **overrides)


def measured_bytes(model) -> int:
    return sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())


@settings(max_examples=50, deadline=None)
@given(config=configs(), limit=st.sampled_from([50_000, 200_000, 1_000_000, 10_000_000]))
def test_the_estimate_refuses_before_work_or_equals_the_built_model(config, limit):
    estimate = model_bytes(config)
    with pytest.MonkeyPatch.context() as patch, Allocations() as allocations:
        patch.setenv("ZOO_MEMORY_LIMIT", str(limit))
        if estimate > limit:
            with pytest.raises(ValueError, match=f"would take {estimate:,} B, more than the ZOO_MEMORY_LIMIT"):
                zoo.build(config)
            assert allocations.nbytes == 0
            return
        model = zoo.build(config)
    assert measured_bytes(model) == estimate, config


@pytest.mark.parametrize("arch", zoo.architectures())
def test_the_estimate_equals_each_architecture_at_the_small_preset(arch):
    """Every mixer's default sizes (widths the property's small draws may miss), built on the meta device: shapes
    without memory."""
    config = zoo.make_config(arch, "small")
    with torch.device("meta"):
        model = zoo.build(config)
    assert measured_bytes(model) == model_bytes(config)
