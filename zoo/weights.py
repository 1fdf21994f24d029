"""Weights from a file into a built model: .safetensors, or a tensors-only .pt state dict. Every way the file can be
wrong (missing, a folder, damaged, pickled code, names, shapes or dtypes that do not fit) is one ValueError naming
it."""
import pickle
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

LISTED = 5  # names an error shows per kind of mismatch; the rest are counted


def check_weights_file(path) -> Path:
    """The path names an existing file (checked before a model is built for it)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"weights file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"weights file {str(path)!r} is not a file")
    return path


def load_weights(model, path, target: str) -> None:
    """target says what the model is (e.g. "gqa (preset tiny)") in an error. A tied head may be stored once, as
    safetensors' save_model writes it, or under both names, as torch.save(model.state_dict()) does."""
    path = check_weights_file(path)
    state = read_state_dict(path)
    model.load_state_dict(fitted_state(model, state, f"weights file {str(path)!r} does not fit {target}"))


def read_state_dict(path: Path) -> Mapping:
    try:
        state = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu",
                                                                                       weights_only=True)
    except Exception as error:  # a damaged file fails inside torch or safetensors with errors of any type
        raise ValueError(unreadable(path, error)) from None
    if not isinstance(state, Mapping):
        raise ValueError(f"weights file {str(path)!r} holds a {type(state).__name__}, not a state dict (a mapping "
                         f"of parameter names to tensors)")
    not_tensors = [str(name) for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise ValueError(f"weights file {str(path)!r} is not a state dict of tensors: "
                         f"{listing('not tensors', not_tensors)}")
    return state


def unreadable(path: Path, error: Exception) -> str:
    """Why the file could not be read, on one line; never torch's advice to unpickle with weights_only=False."""
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if refused:
        return (f"weights file {str(path)!r} holds pickled Python objects ({refused.group(1)}), not only tensors, "
                f"and zoo never unpickles code: save a state dict of tensors (torch.save(model.state_dict(), path)) "
                f"or a .safetensors file")
    kind = "safetensors" if path.suffix == ".safetensors" else "PyTorch (torch.save)"
    # an UnpicklingError's text is torch's weights_only advice, not a reason
    reason = "" if isinstance(error, pickle.UnpicklingError) else f" ({first_sentence(error)})"
    return f"weights file {str(path)!r} is damaged or not a {kind} file{reason}"


def first_sentence(error: Exception) -> str:
    text = str(error).strip().split("\n")[0].split(". ")[0]
    return text or type(error).__name__


def fitted_state(model, state: Mapping, problem: str) -> dict:
    """The file's tensors under every name of the model's state dict (a tied name filled from its twin), or a
    ValueError starting with `problem` listing the names missing, unexpected, of the wrong shape or dtype, or tied
    in the model but different in the file (an untied model's weights)."""
    expected = model.state_dict()
    twins = tied_names(model)
    fitted = {name: next((state[t] for t in twins[name] if t in state), None) for name in expected}
    missing = [name for name, tensor in fitted.items() if tensor is None]
    unexpected = [str(name) for name in state if name not in expected]
    wrong_shape = [f"{name} {shape(tensor)} (the model's: {shape(expected[name])})"
                   for name, tensor in state.items() if name in expected and tensor.shape != expected[name].shape]
    wrong_dtype = [f"{name} {dtype_name(tensor.dtype)} (the model's: {expected_dtype(expected[name])})"
                   for name, tensor in state.items() if name in expected and not dtype_fits(tensor, expected[name])]
    untied = [" = ".join(names) for names in tied_groups(twins, state)
              if any(not torch.equal(state[names[0]], state[n]) for n in names[1:])]
    mismatches = [listing(label, names) for label, names in (
                  ("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape),
                  ("wrong dtype", wrong_dtype), ("one tensor in the model (tied), different in the file", untied))
                  if names]
    if mismatches:
        raise ValueError(f"{problem}: {'; '.join(mismatches)}")
    return fitted


def dtype_fits(tensor: torch.Tensor, expected: torch.Tensor) -> bool:
    """A floating parameter or buffer takes any floating dtype (load_state_dict casts it exactly or rounds it); any
    other (a quantized payload) only its own: load_state_dict would cast an int32 or bool tensor silently."""
    return tensor.is_floating_point() if expected.is_floating_point() else tensor.dtype == expected.dtype


def expected_dtype(tensor: torch.Tensor) -> str:
    return "a floating dtype" if tensor.is_floating_point() else dtype_name(tensor.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tied_names(model) -> dict[str, list[str]]:
    """Each state-dict name -> the names that share its tensor, itself first (a tied head and embedding)."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: [name, *(n for n in names if n != name)] for names in by_tensor.values() for name in names}


def tied_groups(twins: dict[str, list[str]], state: Mapping) -> list[list[str]]:
    """The groups of tied names the file holds more than one of, each sorted (its values must agree)."""
    groups = {tuple(sorted(n for n in names if n in state)) for names in twins.values()}
    return [list(group) for group in sorted(groups) if len(group) > 1]


def shape(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "scalar"


def listing(label: str, names: list[str]) -> str:
    more = f", and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return f"{label} ({len(names)}): {', '.join(names[:LISTED])}{more}"
