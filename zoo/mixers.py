"""How a layer's mixer is constructed from its MixerSpec (the kinds and their classes come from the registry)."""
import inspect
import math
import numbers
import typing

import torch
from torch import nn

from cache.mixer import Mixer
from zoo import checks
from zoo.config import MAX_SEQ_LEN, MIXER_PARAM_BOUNDS, MixerSpec, ModelConfig, at_most
from zoo.registry import mixers

# Model-wide settings a mixer receives when its constructor asks for them by name.
SHARED_SETTINGS = ("rope_base",)


def is_finite_real(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and (checks.is_integer(value) or math.isfinite(value)))  # an int too large for a float is still finite


# The value types a constructor's annotation may name: how a value passes, and how an error says it.
VALUE_TYPES = {
    int: (checks.is_integer, "an integer"),
    float: (is_finite_real, "a finite number"),
    bool: (lambda value: isinstance(value, bool), "True or False"),
    str: (lambda value: isinstance(value, str), "a string"),
}


def mixer_class(kind: str, layer_idx: int | None = None) -> type[nn.Module]:
    """The class a MixerSpec kind builds (the registry's entries); layer_idx only names the layer in the error."""
    classes = mixers()
    if kind not in classes:
        where = "" if layer_idx is None else f" in layer {layer_idx}"
        raise ValueError(f"unknown mixer kind {kind!r}{where}; allowed: {', '.join(classes)}")
    return classes[kind]


def mixer_arguments(spec: MixerSpec, config: ModelConfig, layer_idx: int) -> dict:
    """The keyword arguments a layer's mixer is constructed with, each checked by name, type and bound."""
    cls = mixer_class(spec.kind, layer_idx)
    accepted = inspect.signature(cls).parameters
    shared = {name: getattr(config, name) for name in SHARED_SETTINGS if name in accepted and name not in spec.params}
    unknown = sorted(set(spec.params) - set(accepted))
    if unknown:
        raise ValueError(f"mixer {spec.kind!r} (layer {layer_idx}) got unknown parameters {unknown}; allowed: {sorted(accepted)}")
    check_param_types(spec, cls, layer_idx)
    check_param_bounds(spec, cls, layer_idx)
    if "causal" in spec.params:  # one direction per model: the engine and the sampler read it from the config
        raise ValueError(f"layer {layer_idx} sets 'causal' in its mixer params; set ModelConfig.causal instead")
    if not config.causal:
        check_non_causal(spec, layer_idx)
        shared["causal"] = False  # the mixer refuses what ties it to causal order (a window, a borrowed cache)
    return {"d_model": config.d_model, "layer_idx": layer_idx, **shared, **spec.params}


def mixer_bytes(spec: MixerSpec, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> int:
    """Bytes of the parameters and buffers the layer's mixer will hold, from its class's module_bytes (the size
    every mixer states, so a model is priced before it is built)."""
    cls = mixer_class(spec.kind, layer_idx)
    if not callable(getattr(cls, "module_bytes", None)):
        raise TypeError(f"mixer {cls.__name__} (kind {spec.kind!r}) does not state its size: give it a static "
                        f"module_bytes(dtype, **its constructor's arguments) -> bytes of its parameters and buffers")
    arguments = inspect.signature(cls).bind(**mixer_arguments(spec, config, layer_idx))
    arguments.apply_defaults()  # the constructor's defaults, so a size is read from one place
    return cls.module_bytes(dtype, **arguments.arguments)


def make_mixer(spec: MixerSpec, config: ModelConfig, layer_idx: int) -> nn.Module:
    cls = mixer_class(spec.kind, layer_idx)
    mixer = cls(**mixer_arguments(spec, config, layer_idx))
    if not isinstance(mixer, Mixer):  # a new mixer learns here what the contract asks of it
        missing = [name for name in ("layer_idx", "cache_spec", "forward", "reference") if not hasattr(mixer, name)]
        raise TypeError(f"mixer {cls.__name__} (kind {spec.kind!r}) does not meet the mixer contract "
                        f"(cache/mixer.py): missing {missing}")
    return mixer


def check_param_types(spec, cls: type, layer_idx: int, part: str = "mixer") -> None:
    """Each parameter of a spec (a MixerSpec, or an FFNSpec: part "ffn") has the type its constructor declares (None
    only where it allows None), so a float size or a string fails here by name rather than inside torch; ranges are
    the constructor's to check."""
    hints = typing.get_type_hints(cls.__init__)
    for name, value in spec.params.items():
        declared = typing.get_args(hints.get(name)) or (hints.get(name),)
        if value is None and type(None) in declared:
            continue
        for kind, (fits, wanted) in VALUE_TYPES.items():
            if kind in declared and not fits(value):
                optional = " or None" if type(None) in declared else ""
                raise ValueError(f"{part} {spec.kind!r} (layer {layer_idx}): {name} must be {wanted}{optional}, "
                                 f"got {value!r} ({type(value).__name__})")


def check_param_bounds(spec, cls: type, layer_idx: int, bounds: dict = MIXER_PARAM_BOUNDS, part: str = "mixer") -> None:
    """Each parameter its constructor declares int within its bound (zoo.config.MIXER_PARAM_BOUNDS, or an FFN's
    FFN_PARAM_BOUNDS), so an absurd width or head count fails by name before anything is sized from it; lower bounds
    are the constructor's."""
    hints = typing.get_type_hints(cls.__init__)
    for name, value in spec.params.items():
        if int in (typing.get_args(hints.get(name)) or (hints.get(name),)) and checks.is_integer(value):
            at_most(f"{part} {spec.kind!r} (layer {layer_idx}): {name}", value, bounds.get(name, MAX_SEQ_LEN))


def check_non_causal(spec: MixerSpec, layer_idx: int) -> None:
    """A mixer can attend both ways when its constructor takes `causal`; recurrent mixers are causal by nature."""
    if "causal" not in inspect.signature(mixers()[spec.kind]).parameters:
        allowed = [kind for kind, cls in mixers().items() if "causal" in inspect.signature(cls).parameters]
        raise ValueError(f"mixer {spec.kind!r} (layer {layer_idx}) runs only causally, so it cannot be part of a "
                         f"non-causal model; allowed: {', '.join(allowed)}")
