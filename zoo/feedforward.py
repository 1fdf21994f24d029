"""How a layer's feed-forward is constructed from its FFNSpec (the kinds and their classes come from the registry's
FFNS; "none" is a layer without one). The contract an FFN class meets is in zoo/ffn/__init__.py."""
import inspect

import torch
from torch import nn

from zoo.config import FFN_PARAM_BOUNDS, FFNSpec, ModelConfig
from zoo.mixers import check_param_bounds, check_param_types
from zoo.registry import ffns

NONE = "none"  # a layer without a feed-forward (and without its norm)
DUTIES = ("module_bytes", "forward", "reference")


def ffn_class(kind: str, layer_idx: int | None = None) -> type[nn.Module] | None:
    """The class an FFNSpec kind builds (None for "none"); layer_idx only names the layer in the error."""
    classes = ffns()
    if kind != NONE and kind not in classes:
        where = "" if layer_idx is None else f" in layer {layer_idx}"
        raise ValueError(f"unknown FFN kind {kind!r}{where}; allowed: {', '.join([*classes, NONE])}")
    return classes.get(kind)


def ffn_arguments(spec: FFNSpec, config: ModelConfig, layer_idx: int) -> dict:
    """The keyword arguments a layer's FFN is constructed with, each checked by name, type and bound; `hidden` not
    given is the model's mlp_hidden."""
    cls = ffn_class(spec.kind, layer_idx)
    accepted = inspect.signature(cls).parameters
    unknown = sorted((set(spec.params) - set(accepted)) | ({"d_model"} & set(spec.params)))
    if unknown:
        allowed = sorted(set(accepted) - {"d_model"})
        raise ValueError(f"ffn {spec.kind!r} (layer {layer_idx}) got unknown parameters {unknown}; allowed: {allowed}")
    check_param_types(spec, cls, layer_idx, part="ffn")
    check_param_bounds(spec, cls, layer_idx, FFN_PARAM_BOUNDS, part="ffn")
    return {"d_model": config.d_model, "hidden": config.mlp_hidden, **spec.params}


def check_contract(cls: type, kind: str) -> None:
    """A new FFN kind learns here what the contract (zoo/ffn/__init__.py) asks of it."""
    missing = [name for name in DUTIES if not callable(getattr(cls, name, None))]
    if missing:
        raise TypeError(f"FFN {cls.__name__} (kind {kind!r}) does not meet the FFN contract (zoo/ffn/__init__.py): "
                        f"missing {missing}")


def built_class(spec: FFNSpec, layer_idx: int) -> type[nn.Module] | None:
    """The class the layer builds, meeting the contract; None for "none", which takes no parameters."""
    cls = ffn_class(spec.kind, layer_idx)
    if cls is None and spec.params:
        raise ValueError(f"ffn 'none' (layer {layer_idx}) is no feed-forward and takes no parameters, got "
                         f"{sorted(spec.params)}")
    if cls is not None:
        check_contract(cls, spec.kind)
    return cls


def bound_arguments(spec: FFNSpec, config: ModelConfig, layer_idx: int) -> dict:
    """ffn_arguments with the constructor's defaults filled in, so a size is read from one place."""
    arguments = inspect.signature(ffn_class(spec.kind, layer_idx)).bind(**ffn_arguments(spec, config, layer_idx))
    arguments.apply_defaults()
    return arguments.arguments


def ffn_bytes(spec: FFNSpec, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> int:
    """Bytes of the parameters and buffers the layer's FFN will hold (0 for none), from its class's module_bytes."""
    cls = built_class(spec, layer_idx)
    return 0 if cls is None else cls.module_bytes(dtype, **bound_arguments(spec, config, layer_idx))


def make_ffn(spec: FFNSpec, config: ModelConfig, layer_idx: int) -> nn.Module | None:
    cls = built_class(spec, layer_idx)
    return None if cls is None else cls(**ffn_arguments(spec, config, layer_idx))
