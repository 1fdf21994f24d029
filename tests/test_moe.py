"""The MoE feed-forward (zoo/ffn/moe.py): its grouped and gathered paths equal the dense float64 reference and each
other over random configs, its routing is Mixtral's, Qwen2-MoE's and DeepSeek-V3's (transformers' own blocks with the
same weights), its parameters and routed experts are reported, and bad settings fail by name before any work.
The registry entry "moe" runs through conformance, the oracle, compile, quantization and CUDA-graph suites by name
(`-k moe`)."""
import random
from types import SimpleNamespace

import pytest
import torch

import zoo
from harness import Engine
from kernels import FORCE_TRITON_ENV
from tests.test_model_size_bounds import Allocations
from zoo.ffn.moe import MoE
from zoo.model import model_bytes
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model

CAPTURED = SimpleNamespace(captured=True, is_decode=True)  # what a graph-captured decode step's CacheBatch says
FEW_MB = 4 * 2**20


@torch.no_grad()
def spread(moe: MoE, seed: int) -> MoE:
    """Unit-scale weights (randn / sqrt(fan in)) and a random DeepSeek-V3 bias, so routing is decisive and outputs
    are of order one."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in [*moe.named_parameters(), *moe.named_buffers()]:
        if not tensor.is_floating_point():  # the routing counters
            continue
        fan_in = tensor.shape[-1] if tensor.dim() > 1 else 1
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * fan_in**-0.5)
    return moe


def random_configs(count: int, seed: int = 0) -> list[dict]:
    """MoE settings drawn at random: every top_k from 1 to n_experts, renormalising or not, shared experts or not,
    both routers."""
    rng = random.Random(seed)
    configs = []
    for _ in range(count):
        n_experts = rng.randint(1, 8)
        configs.append({
            "d_model": rng.choice([8, 16, 32]), "hidden": rng.randint(4, 40), "n_experts": n_experts,
            "top_k": rng.randint(1, n_experts), "n_shared_experts": rng.choice([0, 0, 1, 2]),
            "router": rng.choice(["softmax", "sigmoid"]), "norm_topk_prob": rng.choice([True, False]),
            "tokens": rng.choice([1, 2, 5, 17, 40]),
        })
    return configs


def config_id(config: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in config.items() if k not in ("d_model", "hidden"))


CONFIGS = random_configs(24)


@pytest.mark.parametrize("settings", CONFIGS, ids=config_id)
def test_grouped_and_gathered_paths_equal_the_dense_reference(settings):
    settings = dict(settings)
    tokens = settings.pop("tokens")
    torch.manual_seed(0)
    moe = spread(MoE(**settings), seed=len(CONFIGS)).eval()
    x = torch.randn(tokens, settings["d_model"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        grouped, gathered, want = moe(x), moe(x, CAPTURED), moe.reference(x)
    assert want.dtype == torch.float64
    assert (grouped.double() - want).abs().max() <= 1e-5, "grouped path vs dense float64 reference"
    assert (gathered - grouped).abs().max() <= 1e-5, "gathered path vs grouped path"
    assert want.abs().max() > 0.1  # outputs of order one: the tolerance means something


def test_the_paths_are_the_two_the_docs_name(monkeypatch):
    """Eagerly the tokens are grouped by expert; a captured step gathers (no host read there)."""
    moe = spread(MoE(16, 24, n_experts=4, top_k=2), seed=3).eval()
    x = torch.randn(6, 16)
    taken = []
    monkeypatch.setattr(MoE, "grouped", lambda self, *a: taken.append("grouped") or torch.zeros_like(a[0]))
    monkeypatch.setattr(MoE, "gathered", lambda self, *a: taken.append("gathered") or torch.zeros_like(a[0]))
    moe(x), moe(x, CAPTURED)
    assert taken == ["grouped", "gathered"]


@pytest.mark.parametrize("router,family", [("softmax", "mixtral"), ("softmax", "qwen2_moe"),
                                           ("sigmoid", "deepseek_v3")])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_is_transformers_own(router, family, norm_topk_prob):
    """The same weights in transformers' MoE blocks give the same outputs: Mixtral (softmax top-k, always
    renormalised), Qwen2-MoE (norm_topk_prob, a sigmoid-gated shared expert) and DeepSeek-V3 (sigmoid scores,
    bias-corrected top-k, ungated shared experts; one group, routed scaling 1)."""
    if family == "mixtral" and not norm_topk_prob:
        pytest.skip("Mixtral always renormalises")
    transformers = pytest.importorskip("transformers")
    d_model, width, n_experts, top_k = 32, 24, 6, 2
    shared = 0 if family == "mixtral" else 2
    moe = spread(MoE(d_model, width, n_experts=n_experts, top_k=top_k, n_shared_experts=shared, router=router,
                     norm_topk_prob=norm_topk_prob), seed=7).eval()
    hf = hf_block(transformers, family, d_model, width, n_experts, top_k, shared, norm_topk_prob)
    experts = moe.experts
    with torch.no_grad():
        hf.gate.weight.copy_(moe.gate.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([experts.gate_proj.weight, experts.up_proj.weight], dim=1))
        hf.experts.down_proj.copy_(experts.down_proj.weight)
        if family == "deepseek_v3":
            hf.gate.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
        if shared:
            names = "shared_experts" if family == "deepseek_v3" else "shared_expert"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(getattr(hf, names), proj).weight.copy_(getattr(moe.shared_experts, proj).weight)
        if family == "qwen2_moe":
            hf.shared_expert_gate.weight.copy_(moe.shared_expert_gate.weight)
        x = torch.randn(2, 9, d_model, generator=torch.Generator().manual_seed(2))
        want = hf(x)
        want = want[0] if isinstance(want, tuple) else want
        assert (moe(x) - want).abs().max() <= 1e-5
        assert (moe(x, CAPTURED) - want).abs().max() <= 1e-5


def hf_block(transformers, family, d_model, width, n_experts, top_k, shared, norm_topk_prob):
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=d_model, intermediate_size=width, num_local_experts=n_experts,
                                            num_experts_per_tok=top_k)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(hidden_size=d_model, moe_intermediate_size=width, num_experts=n_experts,
                                             num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                                             shared_expert_intermediate_size=shared * width)
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
    else:
        config = transformers.DeepseekV3Config(hidden_size=d_model, moe_intermediate_size=width,
                                               n_routed_experts=n_experts, num_experts_per_tok=top_k,
                                               n_shared_experts=shared, n_group=1, topk_group=1,
                                               routed_scaling_factor=1.0, norm_topk_prob=norm_topk_prob)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    return Block(config).eval()


def test_the_bias_chooses_experts_but_does_not_weight_them():
    """DeepSeek-V3's correction bias: a large bias on expert 3 puts it in every token's top-k, and its weight is its
    unbiased sigmoid score, renormalised over the chosen."""
    moe = spread(MoE(16, 8, n_experts=5, top_k=2, router="sigmoid"), seed=4).eval()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0, 0.0]))
        x = torch.randn(7, 16)
        ids, weights = moe.route(x)
        scores = moe.gate(x).sigmoid()
    assert (ids == 3).any(-1).all()
    chosen = scores.gather(-1, ids)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True))


def test_mutated_routing_in_both_paths_escapes_self_consistency_but_not_the_oracle():
    """Routing weights scaled by 1.25 in route() (which both fast paths read) still pass cached = uncached; the
    float64 reference, which routes on its own, catches it."""
    from tests.test_reference_oracle import RTOL, cached_decode_error, oracle_error, tokens_for
    model = random_model("moe")
    tokens = tokens_for(model)
    assert oracle_error(model, tokens) <= RTOL
    for block in model.blocks:
        def route(x, original=block.mlp.route):
            ids, weights = original(x)
            return ids, 1.25 * weights
        block.mlp.route = route
    assert cached_decode_error(model) <= 1e-4
    assert oracle_error(model, tokens) > RTOL


# ---- the per-layer FFN: spelling, config, checkpoints ---------------------------------------------------------------

def ffn_kinds(model) -> list[str]:
    return [type(block.mlp).__name__ if block.mlp is not None else "none" for block in model.blocks]


def test_a_hybrid_names_each_layers_ffn_after_a_slash():
    model = zoo.build("hybrid", preset="tiny", layers="gqa/moe,gqa/swiglu,mla/moe,mamba/none", n_layers=4,
                      n_experts=4, top_k=1)
    assert ffn_kinds(model) == ["MoE", "SwiGLU", "MoE", "none"]
    assert [type(block.mixer).__name__ for block in model.blocks] == ["Attention", "Attention", "MLAttention", "Mamba"]
    assert model.config.ffns[0] == zoo.FFNSpec("moe", {"n_experts": 4, "top_k": 1})
    assert model.blocks[0].mlp.n_experts == 4 and model.blocks[0].mlp.top_k == 1
    # a layer without a slash takes its entry's FFN: moe's own, or the model-wide mlp
    assert ffn_kinds(zoo.build("hybrid", preset="tiny", layers="moe,swa", mlp="gelu")) == ["MoE", "GeluMLP"]
    assert zoo.build("hybrid", preset="tiny", layers="swa,gqa").config.ffns is None  # as before per-layer FFNs


def test_the_moe_entry_is_mixtral_shaped():
    model = zoo.build("moe", preset="tiny")
    assert ffn_kinds(model) == ["MoE", "MoE"]
    moe = model.blocks[0].mlp
    settings = (moe.n_experts, moe.top_k, moe.expert_hidden, moe.scoring, moe.norm_topk_prob)
    assert settings == (8, 2, 192, "softmax", True)
    assert moe.shared_experts is None
    deepseek = zoo.build("moe", preset="tiny", router="sigmoid", n_shared_experts=1, expert_hidden=32).blocks[1].mlp
    assert deepseek.shared_experts.gate_proj.out_features == 32 and deepseek.shared_expert_gate is None
    assert "n_experts" in zoo.details("moe")["settings"] and zoo.details("moe")["ffn"] == "MoE"


def test_config_json_keeps_its_old_form_and_loads_per_layer_ffns(tmp_path):
    from zoo.checkpoint import config_from_json, config_to_json
    dense = zoo.make_config("gqa", "tiny")
    assert "ffns" not in config_to_json(dense)  # a model without per-layer FFNs saves as before
    assert config_from_json(config_to_json(dense)) == dense
    mixed = zoo.make_config("hybrid", "tiny", layers="gqa/moe,swa", router="sigmoid", n_shared_experts=1)
    assert config_from_json(config_to_json(mixed)) == mixed
    model = random_model("hybrid", layers="gqa/moe,swa", router="sigmoid", n_shared_experts=1)
    loaded = zoo.load(zoo.save(model, tmp_path / "moe"))
    tokens = torch.tensor([make_prompts([12], 512)[0]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert "blocks.0.mlp.experts.gate_proj.weight" in loaded.state_dict()
    assert "blocks.1.mlp.gate_proj.weight" in loaded.state_dict()  # a dense FFN's weights where they always were


def test_a_config_saved_before_per_layer_ffns_loads():
    """A config.json as zoo.save wrote it before this change (no ffns field) loads with every layer the model-wide
    mlp, and weights named blocks.i.mlp.* fit it."""
    from zoo.checkpoint import config_from_json
    text = ('{"vocab_size": 64, "d_model": 16, "layers": [{"kind": "attention", "params": {"n_heads": 2}}], '
            '"mlp": "gelu", "mlp_hidden": 32, "norm": "rmsnorm", "norm_eps": 1e-05, "rope_base": 10000.0, '
            '"tie_embeddings": true, "max_seq_len": 64, "name": "old", "causal": true, "mask_token_id": null}')
    config = config_from_json(text)
    assert config.ffns is None and config.ffn(0) == zoo.FFNSpec("gelu")
    assert set(zoo.build(config).blocks[0].mlp.state_dict()) == {"up_proj.weight", "down_proj.weight"}


def test_first_layers_keeps_each_layers_ffn():
    model = random_model("hybrid", layers="gqa/moe,gqa/gelu,swa", n_layers=3)
    draft = model.first_layers(2)
    assert ffn_kinds(draft) == ["MoE", "GeluMLP"] and draft.blocks[0].mlp is model.blocks[0].mlp


class ReluSquared(torch.nn.Module):
    """docs/adding-an-architecture.md's example FFN kind (Primer's squared ReLU), as its one file holds it."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up_proj = torch.nn.Linear(d_model, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, d_model, bias=False)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, hidden: int) -> int:
        return 2 * d_model * hidden * dtype.itemsize

    def forward(self, x, batch=None):
        return self.down_proj(torch.relu(self.up_proj(x)) ** 2)

    def reference(self, x):
        h = (x.double() @ self.up_proj.weight.double().T).clamp_min(0)
        return (h * h) @ self.down_proj.weight.double().T


def test_a_new_ffn_kind_is_one_class_and_one_declaration(monkeypatch):
    from tests.test_reference_oracle import RTOL, oracle_error, tokens_for
    from zoo import registry
    monkeypatch.setitem(registry.FFNS, "relu2", registry.FFN("relu2", ReluSquared))
    model = random_model("hybrid", layers="gqa/relu2,swa")
    assert ffn_kinds(model) == ["ReluSquared", "SwiGLU"]
    assert sum(t.nbytes for t in [*model.parameters(), *model.buffers()]) == model_bytes(model.config)
    assert oracle_error(model, tokens_for(model)) <= RTOL


# ---- sizes: bytes, total and active parameters, routed experts -------------------------------------------------------

@pytest.mark.parametrize("settings", [{}, {"router": "sigmoid", "n_shared_experts": 2},
                                      {"n_shared_experts": 1, "expert_hidden": 40, "top_k": 8}])
def test_model_bytes_equal_the_built_moe_model(settings):
    config = zoo.make_config("moe", "tiny", **settings)
    model = zoo.build(config)
    assert sum(t.nbytes for t in [*model.parameters(), *model.buffers()]) == model_bytes(config)


def test_total_and_active_parameters():
    """Active = total less (n_experts - top_k) experts of 3 x d_model x expert_hidden per MoE layer (Mixtral's
    accounting); a dense model's active parameters are all of them."""
    model = zoo.build("moe", preset="tiny", n_shared_experts=1)
    counts = zoo.parameter_counts(model)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.total - counts.active == 2 * (8 - 2) * 3 * 64 * 192
    dense = zoo.parameter_counts(zoo.build("gqa", preset="tiny"))
    assert dense.active == dense.total
    with torch.device("meta"):
        large = zoo.build("moe", preset="large")
    per_layer = 8 * 3 * 2560 * 6912
    assert zoo.parameter_counts(large).total - zoo.parameter_counts(large).active == 32 * per_layer * 6 // 8
    quantized = zoo.parameter_counts(zoo.quantize(model, weights="int8"))
    assert quantized == counts  # counted as the weights they stand for, whatever their bits


def test_routed_experts_are_each_steps_union():
    model = random_model("moe")
    with torch.no_grad():
        model(torch.tensor([[5]]))
        one = zoo.routed_experts(model)
        assert set(one) == {0, 1} and all(len(ids) == 2 for ids in one.values())  # top 2 of 8 for one token
        model(torch.randint(0, 512, (4, 30)))
    for block in model.blocks:
        assert int(block.mlp.routed_tokens.sum()) == 4 * 30 * 2
    assert all(len(ids) > 2 for ids in zoo.routed_experts(model).values())  # the union over the batch


def test_only_routed_experts_get_gradients():
    moe = spread(MoE(16, 8, n_experts=8, top_k=1, norm_topk_prob=False), seed=5)  # renormalised, one weight is 1
    x = torch.randn(1, 16)
    moe(x).sum().backward()
    used = moe.routed_tokens.nonzero().flatten().tolist()
    grads = moe.experts.gate_proj.weight.grad.abs().sum((1, 2))
    assert len(used) == 1 and grads.nonzero().flatten().tolist() == used
    assert moe.gate.weight.grad.abs().sum() > 0  # the router learns through the weights


# ---- the engine: compiled and graph-captured steps, quantization -----------------------------------------------------

@pytest.mark.parametrize("arch,settings", [("moe", {"router": "sigmoid", "n_shared_experts": 1}),
                                           ("hybrid", {"layers": "mamba/moe,gqa/moe", "top_k": 3})])
def test_compiled_decode_equals_eager(arch, settings):
    """The compiled step takes the gathered path (fixed shapes); fullgraph holds the step to one graph in
    tests/test_compiled_decode.py."""
    model = random_model(arch, **settings)
    prompts = make_prompts([5, 19], model.config.vocab_size)
    eager = Engine(model, max_batch=2, max_seq_len=40).generate(prompts, greedy(8))
    compiled = Engine(model, max_batch=2, max_seq_len=40, compile=True).generate(prompts, greedy(8))
    for got, want in zip(compiled, eager):
        assert_not_constant(want.token_ids)
        assert_same_output(got, want, context=f"compiled {arch}")


def test_fullgraph_compile_of_the_moe_forward():
    moe = spread(MoE(16, 24, n_experts=8, top_k=2, n_shared_experts=1), seed=6).eval()
    x = torch.randn(3, 16)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True)
    with torch.no_grad():
        assert (compiled(x) - moe(x)).abs().max() <= 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_experts_round_each_expert_and_keep_the_router(weights, tmp_path):
    model = random_model("moe", d_model=64, expert_hidden=64)
    quantized = zoo.quantize(model, weights=weights, group_size=32)
    moe = quantized.blocks[0].mlp
    assert type(moe.experts.gate_proj).__name__ == "QuantizedExpertLinear"
    assert moe.gate.weight.dtype == torch.float32  # the router stays in full precision
    x = torch.randn(9, 64)
    with torch.no_grad():
        assert (moe(x) - moe(x, CAPTURED)).abs().max() <= 1e-4  # the grouped kernels = the gathered dequantized
        assert (moe(x).double() - moe.reference(x)).abs().max() <= 1e-4
    stack = moe.experts.down_proj
    assert zoo.parameter_bytes(quantized) < zoo.parameter_bytes(model)
    assert stack.stored_bytes == sum(t.nbytes for t in stack.state_dict().values())
    loaded = zoo.load(zoo.save(quantized, tmp_path / weights))
    tokens = torch.tensor([make_prompts([10], 512)[0]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), quantized(tokens))


# ---- bad input: named before any work --------------------------------------------------------------------------------

@pytest.mark.parametrize("settings,match", [
    ({"top_k": 9}, r"top_k \(experts each token is routed to\) must be an integer in \[1, n_experts=8\], got 9"),
    ({"n_experts": 0}, r"n_experts must be >= 1, got 0"),
    ({"router": "relu"}, r"router.*'relu'.*softmax, sigmoid"),
    ({"n_shared_experts": -1}, r"n_shared_experts must be >= 0, got -1"),
    ({"top_k": 1.5}, r"top_k must be an integer"),
    ({"norm_topk_prob": "yes"}, r"ffn 'moe' \(layer 0\): norm_topk_prob must be True or False, got 'yes'"),
    ({"n_experts": 10**6}, r"n_experts must be <= 4,096"),
    ({"expert_hidden": 10**7}, r"expert_hidden must be <= 1,048,576"),
])
def test_bad_moe_settings_fail_by_name_before_work(settings, match):
    with Allocations() as allocations, pytest.raises(ValueError, match=match):
        zoo.build("moe", preset="tiny", **settings)
    assert allocations.nbytes < FEW_MB


@pytest.mark.parametrize("ffns,match", [
    ([zoo.FFNSpec("moe", {"top_k": 3, "n_experts": 2})], r"top_k .* must be an integer in \[1, n_experts=2\], got 3"),
    ([zoo.FFNSpec("experts")], r"unknown FFN kind 'experts' in layer 0; allowed: swiglu, gelu, moe, none"),
    ([zoo.FFNSpec("moe", {"n_expert": 4})], r"ffn 'moe' \(layer 0\) got unknown parameters \['n_expert'\]"),
    ([zoo.FFNSpec("none", {"hidden": 4})], r"ffn 'none' \(layer 0\) is no feed-forward and takes no parameters"),
    ([zoo.FFNSpec("moe", {"router": "tanh"})], r"router.*'tanh'.*softmax, sigmoid"),
    ([zoo.FFNSpec("moe", {"n_experts": 0, "top_k": 1})], r"n_experts \(routed experts per layer\) must be >= 1, got 0"),
])
def test_bad_ffn_specs_fail_by_name_before_work(ffns, match):
    config = zoo.ModelConfig(vocab_size=64, d_model=16, layers=[zoo.MixerSpec("attention", {"n_heads": 2})], ffns=ffns)
    with Allocations() as allocations, pytest.raises(ValueError, match=match):
        zoo.build(config)
    assert allocations.nbytes < FEW_MB


def test_bad_per_layer_spellings_are_named():
    with pytest.raises(ValueError, match=r"ffns must give one FFNSpec per layer: 1 layers, got 2"):
        zoo.ModelConfig(vocab_size=64, d_model=16, layers=[zoo.MixerSpec("attention", {"n_heads": 2})],
                        ffns=[zoo.FFNSpec("swiglu")] * 2)
    with pytest.raises(ValueError, match=r"unknown FFN kind\(s\) \['moes'\] after a slash; allowed: swiglu, gelu, moe"):
        zoo.build("hybrid", preset="tiny", layers="gqa/moes")
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['n_experts'\] for 'gqa'"):
        zoo.build("gqa", preset="tiny", n_experts=4)


@pytest.mark.parametrize("settings", CONFIGS[:8], ids=config_id)
def test_the_tiled_cuda_path_equals_the_dense_reference(monkeypatch, settings):
    """ARCHZOO_FORCE_TRITON=1 runs the CUDA path here (the Triton interpreter): eager and captured steps both tile."""
    pytest.importorskip("triton")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    settings = dict(settings)
    tokens = settings.pop("tokens")
    torch.manual_seed(0)
    moe = spread(MoE(**settings), seed=len(CONFIGS)).eval()
    x = torch.randn(tokens, settings["d_model"], generator=torch.Generator().manual_seed(1))
    taken = []
    tiled = MoE.tiled
    monkeypatch.setattr(MoE, "tiled", lambda self, *a: taken.append("tiled") or tiled(self, *a))
    with torch.no_grad():
        eager, captured, want = moe(x), moe(x, CAPTURED), moe.reference(x)
    assert taken == ["tiled", "tiled"]
    assert (eager.double() - want).abs().max() <= 1e-5, "tiled path vs dense float64 reference"
    assert torch.equal(eager, captured)
