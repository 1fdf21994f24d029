"""Weight-only quantization of a model's linear layers: int8 per output channel, or int4 in groups of input columns
(kernels/quantized_matmul.py has the formats and the matrix multiplies). `zoo.quantize(model, QuantizeConfig(...))`
returns a copy the engine runs unchanged.

Two ways to round:
- "rtn", round to nearest: each weight to its nearest level.
- "awq", activation-aware (Lin et al. 2024, AWQ): the input channels that carry large activations matter most, so
  each layer's weight columns are scaled up by s = mean|x|^alpha before rounding and the input divided by s at run
  time (y = Q(W diag(s)) (x / s)). alpha in [0, 1] is searched on calibration tokens: per layer for the smallest
  output error (AWQ's search), and as one alpha for all layers. For int4 each candidate comes again with AWQ's clip
  search after its scales: each group's weights clipped to the bound (a share of its max |w|) whose quantized group
  gives that group's share of the output the smallest error; as in AWQ's own code, not in the layers whose outputs
  meet in a query-key product (a mixer's query_key_projections). The candidate whose outputs diverge least (KL)
  from the unquantized model's wins, among those that neither diverge more nor agree less often on the top token
  than plain rounding (itself a candidate) and, given a `score` (a caller's measure of a candidate model, e.g. how
  much of the float model's greedy output it reproduces: harness/quant_calibration.py), score no lower. AWQ folds 1/s into the
  op before; here it stays in the layer (one multiply per input value), which works for every mixer alike.

Which layers: every nn.Linear of the blocks (mixers and MLPs) at least one group wide, and the vocabulary head if
asked. A layer narrower than one group (Mamba's dt projection at small sizes) keeps its weights. The embedding stays.
An MoE layer's stacked experts (ExpertLinear) become QuantizedExpertLinear, each expert rounded to nearest as one
layer would be (AWQ's search covers the nn.Linear layers only); its router stays in full precision (zoo/ffn/router.py).

A quantized model saves and loads like a float one (zoo/checkpoint.py writes its QuantizeConfig beside it): loading
builds its layers empty (QuantizedLinear.empty, load_skeleton) and fills them with the stored tensors.
"""
import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kernels.quantized_matmul import (int4_cpu_layout, int4_cpu_layout_used, int4_dequantize, int4_matmul, int8_matmul,
                                      pack_int4)
from zoo import checks
from zoo.ffn.experts import ExpertLinear
from zoo.model import DecoderLM
from zoo.quantized_experts import QuantizedExpertLinear
from zoo.weights import listing

WEIGHT_SCHEMES = ("int8", "int4")
METHODS = ("rtn", "awq")
GROUP_SIZES = (32, 64, 128)
AWQ_ALPHAS = tuple(i / 10 for i in range(11))  # the grid AWQ searches (its paper uses 20 points on [0, 1])
AWQ_CLIP_RATIOS = tuple(1 - i / 20 for i in range(11))  # clip bounds AWQ tries, as a share of a group's max |w|
CLIP_TOKENS = 4096  # calibration rows the clip search measures output errors on
CLIP_CHANNELS = 256  # output channels the clip search holds at once (its [tokens, channels, groups] errors)


@dataclass(frozen=True)
class QuantizeConfig:
    weights: str = "int8"  # "int8" (per output channel) or "int4" (groups of input columns)
    group_size: int = 128  # int4: input columns sharing one scale and zero
    method: str = "rtn"  # "rtn" or "awq" (needs calibration tokens)
    head: bool = False  # quantize the vocabulary head too (a tied head shares the embedding: it stays)

    def __post_init__(self):
        checks.choice("weights (quantization scheme)", self.weights, WEIGHT_SCHEMES)
        checks.choice("method", self.method, METHODS)
        if self.weights == "int4" and (not checks.is_integer(self.group_size) or self.group_size not in GROUP_SIZES):
            raise ValueError(f"unknown group_size {self.group_size!r}; allowed: {', '.join(map(str, GROUP_SIZES))}")
        checks.boolean("head", self.head)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> q [N, K] int8, scales [N]: scale = max|w| / 127 per output channel."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def clip_groups(weight: torch.Tensor, bounds: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] weights clipped to [-bound, bound] per group of input columns; bounds [N, K / group_size]."""
    groups, bound = weight.unflatten(-1, (-1, group_size)), bounds[..., None]
    return torch.maximum(torch.minimum(groups, bound), -bound).flatten(-2)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> q4 [N, K / 2] uint8, scales and zeros [N, K / group]: the group's min to max in 15 steps."""
    groups = weight.unflatten(-1, (-1, group_size))
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).flatten(-2)
    return pack_int4(q), scales, low + 8 * scales


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is int8 or int4 (kernels/quantized_matmul.py), with an optional per-input-channel
    scale (AWQ) the input is divided by. `weight` gives the dequantized weight back, for code that reads it directly
    (MLA's absorbed decode, Mamba's dt projection)."""

    def __init__(self, linear: nn.Linear, scheme: str, group_size: int, input_scale: torch.Tensor | None = None,
                 clip: torch.Tensor | None = None):
        """clip (int4): [out, in / group_size] bounds each group's (scaled) weights are clipped to before rounding."""
        super().__init__()
        dtype = linear.weight.dtype
        weight = linear.weight.detach().float()
        if input_scale is not None:
            weight = weight * input_scale
        if clip is not None:
            weight = clip_groups(weight, clip, group_size)
        q, scales, *zeros = quantize_int8(weight) if scheme == "int8" else quantize_int4(weight, group_size)
        self.hold(scheme, group_size, q, scales.to(dtype), zeros[0].to(dtype) if zeros else None,
                  None if input_scale is None else input_scale.to(dtype),
                  None if linear.bias is None else linear.bias.detach().clone())
        self.set_cpu_layout()

    @classmethod
    def empty(cls, linear: nn.Linear, scheme: str, group_size: int, input_scaled: bool) -> "QuantizedLinear":
        """A layer of `linear`'s shape, bias, dtype and device whose stored tensors are left for load_state_dict to
        fill (zoo.load): no float weight is quantized. input_scaled: it holds an AWQ input scale."""
        layer = cls.__new__(cls)  # without __init__, which quantizes a float weight
        super(cls, layer).__init__()
        n, k = linear.out_features, linear.in_features

        def empty(*shape: int, dtype: torch.dtype = linear.weight.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=linear.weight.device)

        if scheme == "int8":
            q, scales, zeros = empty(n, k, dtype=torch.int8), empty(n), None
        else:
            q, scales, zeros = empty(n, k // 2, dtype=torch.uint8), empty(n, k // group_size), empty(n, k // group_size)
        layer.hold(scheme, group_size, q, scales, zeros, empty(k) if input_scaled else None,
                   None if linear.bias is None else empty(n))
        return layer

    def hold(self, scheme: str, group_size: int, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        """Keep the stored tensors as (saved) buffers, zeros None for int8; int4 also gets its CPU layout's unsaved
        buffers, rebuilt whenever load_state_dict refills the stored ones."""
        self.scheme, self.group_size = scheme, group_size
        self.out_features, self.in_features = q.shape[0], q.shape[1] * (2 if scheme == "int4" else 1)
        for name, tensor in (("input_scale", input_scale), ("bias", bias), ("q", q), ("scales", scales),
                             ("zeros", zeros)):
            self.register_buffer(name, tensor)
        if scheme == "int4":
            self.register_buffer("cpu_packed", None, persistent=False)
            self.register_buffer("cpu_scales_zeros", None, persistent=False)
            self.register_load_state_dict_post_hook(rebuild_cpu_layout)

    def set_cpu_layout(self) -> None:
        """int4: torch's packed CPU layout, made only where int4_matmul reads it (int4_cpu_layout_used: bf16 on the
        CPU); an fp32 or CUDA layer would hold it as a second, unused copy of its weight."""
        if self.scheme != "int4":
            return
        layout = int4_cpu_layout(self.q, self.scales, self.zeros) if int4_cpu_layout_used(self.q, self.scales) else None
        self.cpu_packed, self.cpu_scales_zeros = layout or (None, None)

    def _apply(self, fn, recurse=True):
        """A cast or a move (model.to, .bfloat16(), .cuda()) makes or drops the CPU layout for the new dtype, device."""
        before = (self.scales.dtype, self.scales.device)
        super()._apply(fn, recurse)
        if (self.scales.dtype, self.scales.device) != before:
            self.set_cpu_layout()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x / self.input_scale
        if self.scheme == "int8":
            y = int8_matmul(x, self.q, self.scales)
        else:
            layout = None if self.cpu_packed is None else (self.cpu_packed, self.cpu_scales_zeros)
            y = int4_matmul(x, self.q, self.scales, self.zeros, self.group_size, layout)
        return y if self.bias is None else y + self.bias

    def int8_operands(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(payload, per-channel scales) where a fused CPU decode half (kernels/cpu_blocks.py) may read this layer
        as its forward would, on the int8 GEMV: int8, no AWQ input scale, no bias, no forward hook; else None. Read
        from the buffers' dict (nn.Module.__getattr__ costs ~1 µs an attribute)."""
        buffers = self._buffers
        if (self.scheme != "int8" or buffers["input_scale"] is not None or buffers["bias"] is not None
                or self._forward_hooks or self._forward_pre_hooks):
            return None
        return buffers["q"], buffers["scales"]

    @property
    def stored_bytes(self) -> int:
        """The weight as stored: payload, scales, zeros, input scale, bias (not a layout a kernel derives from them)."""
        return sum(tensor.nbytes for tensor in self.state_dict().values())

    @property
    def weight_elements(self) -> int:
        """The weights it stands for, whatever its bits."""
        return self.in_features * self.out_features

    @property
    def weight(self) -> torch.Tensor:
        dtype = self.scales.dtype
        if self.scheme == "int8":
            weight = self.q.to(dtype) * self.scales[:, None]
        else:
            weight = int4_dequantize(self.q, self.scales, self.zeros, self.group_size, dtype)
        return weight if self.input_scale is None else weight / self.input_scale

    def extra_repr(self) -> str:
        group = f", group {self.group_size}" if self.scheme == "int4" else ""
        return f"{self.in_features} -> {self.out_features}, {self.scheme}{group}{', awq' if self.input_scale is not None else ''}"


def rebuild_cpu_layout(layer: QuantizedLinear, _incompatible_keys) -> None:
    """load_state_dict's post hook: the layout derives from the stored tensors just loaded."""
    layer.set_cpu_layout()


def quantize_layers(model: nn.Module, config: QuantizeConfig) -> dict[str, nn.Linear]:
    """The linear layers `quantize` replaces, by module name: the blocks' at least one group wide, and the head if
    asked and untied."""
    width = config.group_size if config.weights == "int4" else 1
    layers = {f"blocks.{name}": module for name, module in model.blocks.named_modules()
              if isinstance(module, nn.Linear) and module.in_features >= width}
    if config.head and not model.config.tie_embeddings:
        layers["head"] = model.head
    for name, layer in layers.items():
        if layer.in_features % width:
            raise ValueError(f"group_size={config.group_size} does not divide the input width {layer.in_features} of "
                             f"{name}; allowed group sizes: {[g for g in GROUP_SIZES if layer.in_features % g == 0]}")
    return layers


def quantize_experts(model: nn.Module, config: QuantizeConfig) -> dict[str, ExpertLinear]:
    """The expert stacks `quantize` replaces, by module name: those at least one group wide (as quantize_layers)."""
    width = config.group_size if config.weights == "int4" else 1
    stacks = {f"blocks.{name}": module for name, module in model.blocks.named_modules()
              if isinstance(module, ExpertLinear) and module.in_features >= width}
    for name, stack in stacks.items():
        if stack.in_features % width:
            raise ValueError(f"group_size={config.group_size} does not divide the input width {stack.in_features} of "
                             f"{name}; allowed group sizes: {[g for g in GROUP_SIZES if stack.in_features % g == 0]}")
    return stacks


def rounding(config: QuantizeConfig) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """One [out, in] weight -> its stored tensors, by the config's scheme."""
    return quantize_int8 if config.weights == "int8" else lambda weight: quantize_int4(weight, config.group_size)


@torch.no_grad()
def quantize(model: nn.Module, config: QuantizeConfig | None = None, calibration: torch.Tensor | None = None,
             score: Callable[[nn.Module], float] | None = None, **settings) -> nn.Module:
    """A copy of `model`, a float zoo model (a quantized one is refused), with its linear layers quantized (the
    original is untouched): by a QuantizeConfig, or by its fields as keywords (`zoo.quantize(model, weights="int4",
    group_size=64)`). calibration [B, T]: token ids whose activations the "awq" method searches its scales on (e.g.
    windows of the training corpus). score ("awq"): a further measure of a candidate quantized model, higher is
    better (e.g. how much of the unquantized model's greedy output it reproduces on calibration prompts,
    harness/quant_calibration.py); AWQ then keeps only candidates that score no lower than plain rounding."""
    check_float_model(model)
    if config is None:
        config = QuantizeConfig(**settings)
    elif settings:
        raise ValueError(f"give a QuantizeConfig or its fields as keywords, not both (got {', '.join(settings)} too)")
    if not isinstance(config, QuantizeConfig):
        raise ValueError(f"config must be a zoo.QuantizeConfig, got {type(config).__name__}")
    if config.method == "awq" and calibration is None:
        raise ValueError("method='awq' searches its scales on calibration text: pass calibration token ids [B, T]")
    if score is not None and config.method != "awq":
        raise ValueError(f"score ranks AWQ's candidates; method={config.method!r} has none (use method='awq')")
    if calibration is not None:
        check_calibration(calibration, model.config.vocab_size)
    quantize_layers(model, config)  # refuses a group size that does not divide a layer's width, before the copy
    quantize_experts(model, config)
    quantized = copy.deepcopy(model)
    replace_layers(quantized, {name: QuantizedExpertLinear(stack, config.weights, config.group_size, rounding(config))
                               for name, stack in quantize_experts(quantized, config).items()})  # before AWQ's search
    layers = quantize_layers(quantized, config)
    scales, clips = awq_scales(quantized, layers, config, calibration, score) if config.method == "awq" else ({}, {})
    replace_layers(quantized, {name: QuantizedLinear(layer, config.weights, config.group_size, scales.get(name),
                                                     clips.get(name))
                               for name, layer in layers.items()})
    quantized.quantization = config
    return quantized.eval()


def check_float_model(model) -> None:
    """A zoo model (DecoderLM) not yet quantized: quantizing int8 layers again would round rounded weights."""
    if not isinstance(model, DecoderLM):
        raise ValueError(f"zoo.quantize takes a zoo model (zoo.DecoderLM, from zoo.build or zoo.load), got "
                         f"{type(model).__name__}")
    done = next((m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedExpertLinear))), None)
    if done is not None:
        raise ValueError(f"model is already quantized ({done.scheme}): quantize the float model instead (zoo.quantize "
                         f"returns a quantized copy and leaves its input float)")


def check_calibration(calibration, vocab_size: int) -> None:
    """AWQ's calibration: a non-empty 2-D integer tensor of token ids [B, T] in the model's vocabulary."""
    tensor = isinstance(calibration, torch.Tensor)
    integer = tensor and not (calibration.is_floating_point() or calibration.is_complex()
                              or calibration.dtype == torch.bool)
    if not (integer and calibration.dim() == 2 and calibration.numel()):
        got = f"shape {tuple(calibration.shape)}, dtype {calibration.dtype}" if tensor else type(calibration).__name__
        raise ValueError(f"calibration must be a non-empty 2-D integer tensor of token ids [B, T], got {got}")
    checks.token_ids("calibration", calibration.flatten().tolist(), vocab_size)


def load_skeleton(model: nn.Module, config: QuantizeConfig, input_scaled: list[str]) -> None:
    """Make `model` (a float model of a saved quantized model's config) the shape `quantize` made it: the layers it
    quantizes become empty QuantizedLinear layers for load_state_dict to fill, those named in input_scaled holding
    an AWQ input scale, and `model.quantization` is set."""
    layers = quantize_layers(model, config)
    unknown = sorted(set(input_scaled) - set(layers))
    if unknown:
        raise ValueError(listing("input_scaled names layers that are not quantized", unknown))
    replace_layers(model, {name: QuantizedExpertLinear.empty(stack, config.weights, config.group_size)
                           for name, stack in quantize_experts(model, config).items()})
    replace_layers(model, {name: QuantizedLinear.empty(layer, config.weights, config.group_size, name in input_scaled)
                           for name, layer in layers.items()})
    model.quantization = config


def awq_scales(model: nn.Module, layers: dict[str, nn.Linear], config: QuantizeConfig, calibration: torch.Tensor,
               score: Callable[[nn.Module], float] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each layer's input-channel scale s = a^alpha / sqrt(max(a^alpha) min(a^alpha)), a = mean |x| per channel on the
    calibration tokens. Candidates: each layer's alpha from AWQ_ALPHAS with the smallest error of its own quantized
    output (AWQ's search), and one alpha for every layer, each of AWQ_ALPHAS; for int4 each of these again with
    AWQ's clip search after its scales (awq_clips; not on layers that feed a query-key product). A candidate
    qualifies if on the calibration tokens it diverges no more from the unquantized model than plain rounding (alpha
    0 everywhere, no clipping) and agrees with its top token no less often, and, given a score, scores no lower; of
    those the one that diverges least wins. Plain rounding itself always qualifies, so AWQ is never worse than round
    to nearest by any of these measures there.
    Returns the layers' input scales and clip bounds (absent: none)."""
    magnitudes, inputs = calibration_inputs(model, layers, calibration)
    per_layer = {}
    for name, layer in layers.items():
        x, weight = inputs[name], layer.weight.float()
        want = x @ weight.T
        errors = {alpha: float(((x @ QuantizedLinear(plain_linear(weight), config.weights, config.group_size,
                                                     input_scale(magnitudes[name], alpha)).weight.T) - want).pow(2).mean())
                  for alpha in AWQ_ALPHAS}
        per_layer[name] = min(errors, key=errors.get)
    alphas = [per_layer] + [dict.fromkeys(layers, alpha) for alpha in AWQ_ALPHAS]  # [1]: alpha 0, plain rounding
    candidates = [({name: input_scale(magnitudes[name], alpha) for name, alpha in each.items() if alpha}, {})
                  for each in alphas]
    if config.weights == "int4":  # each again with AWQ's clip search after its scales
        clipped = {name: layer for name, layer in layers.items() if not feeds_query_key(model, name)}
        candidates += [(scales, awq_clips(clipped, inputs, scales, config.group_size)) for scales, _ in candidates]
    reference = model(calibration.to(next(model.parameters()).device)).float().log_softmax(-1)  # under quantize's no_grad
    fits = [calibration_fit(model, layers, config, calibration, reference, *candidate) for candidate in candidates]
    (plain_kl, plain_agreement), plain_score = fits[1], None if score is None else scored(model, layers, config, score, {}, {})

    def qualifies(i: int) -> bool:
        kl, agreement = fits[i]
        return i == 1 or kl <= plain_kl and agreement >= plain_agreement and (
            score is None or scored(model, layers, config, score, *candidates[i]) >= plain_score)

    # least divergent first; the score (the costly measure) is taken only until one qualifies
    return candidates[next(i for i in sorted(range(len(fits)), key=lambda i: fits[i][0]) if qualifies(i))]


def scored(model: nn.Module, layers: dict[str, nn.Linear], config: QuantizeConfig, score: Callable[[nn.Module], float],
           scales: dict[str, torch.Tensor | None], clips: dict[str, torch.Tensor]) -> float:
    """score(model) with its layers quantized with these input scales and clip bounds."""
    with quantized_in_place(model, layers, config, scales, clips):
        return float(score(model))


def feeds_query_key(model: nn.Module, name: str) -> bool:
    """Whether layer `name`'s outputs meet in a query-key product (its mixer lists it in query_key_projections).
    AWQ's code leaves such layers unclipped: through the product, a clipped weight's effect on attention is not what
    the layer's own output error measures (on MQAR, clipped query and key weights cost recall of more keys than the
    calibration held: BENCHMARKS.md)."""
    parent, _, attribute = name.rpartition(".")
    return attribute in getattr(model.get_submodule(parent), "query_key_projections", ())


def awq_clips(layers: dict[str, nn.Linear], inputs: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
              group_size: int) -> dict[str, torch.Tensor]:
    """AWQ's clip search, per layer (after its input scale): for each output channel and group, the bound among
    AWQ_CLIP_RATIOS x the group's max |w| whose quantized group gives the smallest mean squared error of that
    group's share of the output on the calibration inputs (the first CLIP_TOKENS rows)."""
    clips = {}
    for name, layer in layers.items():
        scale = scales.get(name)
        weight = layer.weight.float() if scale is None else layer.weight.float() * scale
        x = inputs[name][:CLIP_TOKENS]
        x = (x if scale is None else x / scale).unflatten(-1, (-1, group_size))  # [T, G, group]
        bounds = []
        for block in weight.split(CLIP_CHANNELS):
            groups = block.unflatten(-1, (-1, group_size))  # [N, G, group]
            top = groups.abs().amax(dim=-1)
            best, best_error = top, torch.full_like(top, float("inf"))
            for ratio in AWQ_CLIP_RATIOS:
                q, q_scales, zeros = quantize_int4(clip_groups(block, top * ratio, group_size), group_size)
                error_w = int4_dequantize(q, q_scales, zeros, group_size, torch.float32).unflatten(-1, (-1, group_size))
                error = torch.einsum("tgk,ngk->tng", x, error_w - groups).pow(2).mean(dim=0)  # [N, G]
                better = error < best_error
                best, best_error = torch.where(better, top * ratio, best), torch.where(better, error, best_error)
            bounds.append(best)
        clips[name] = torch.cat(bounds)
    return clips


def calibration_inputs(model: nn.Module, layers: dict[str, nn.Linear], calibration: torch.Tensor):
    """Each layer's inputs on the calibration tokens [tokens, in], and their mean magnitude per input channel."""
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    hooks = [layer.register_forward_hook(lambda _, args, __, name=name: inputs[name].append(args[0].detach()))
             for name, layer in layers.items()]
    try:
        model(calibration.to(next(model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    flat = {name: torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).float() for name, xs in inputs.items()}
    return {name: x.abs().mean(dim=0).clamp_min(1e-8) for name, x in flat.items()}, flat


def input_scale(magnitude: torch.Tensor, alpha: float) -> torch.Tensor | None:
    """AWQ's s = a^alpha, normalised to a geometric mean of max and min of 1; None at alpha 0 (no scaling)."""
    if not alpha:
        return None
    s = magnitude ** alpha
    return s / (s.max() * s.min()).sqrt()


def calibration_fit(model: nn.Module, layers: dict[str, nn.Linear], config: QuantizeConfig,
                    calibration: torch.Tensor, reference: torch.Tensor, scales: dict[str, torch.Tensor | None],
                    clips: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(KL(unquantized || quantized) of the next-token distributions, share of positions where both pick the same top
    token) on the calibration tokens (reference: the unquantized model's log-probabilities there), for `model`
    with its layers quantized with these input scales and clip bounds.
    What quantization should keep small is the change in what the model says, not its loss on a sample."""
    with quantized_in_place(model, layers, config, scales, clips):
        logits = model(calibration.to(reference.device)).float().log_softmax(-1)
    kl = float(nn.functional.kl_div(logits, reference, log_target=True, reduction="batchmean"))
    return kl, float((logits.argmax(-1) == reference.argmax(-1)).float().mean())


@contextmanager
def quantized_in_place(model: nn.Module, layers: dict[str, nn.Linear], config: QuantizeConfig,
                       scales: dict[str, torch.Tensor | None], clips: dict[str, torch.Tensor]):
    """`model` (quantize's own copy) with its layers quantized with these input scales and clip bounds, for the
    duration of the block; the float layers are put back afterwards."""
    replace_layers(model, {name: QuantizedLinear(layer, config.weights, config.group_size, scales.get(name),
                                                 clips.get(name)) for name, layer in layers.items()})
    try:
        yield model
    finally:
        replace_layers(model, layers)


def replace_layers(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Put each module at its name in the model."""
    for name, module in modules.items():
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, module)


def plain_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear holding `weight` (what an AWQ trial quantizes)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer
