"""Checks for every public knob, one rule per kind of value; each error names the parameter, the bad value and
what is allowed. Integers must be integers (not bool, float or str); reals must be finite."""
import math
import numbers
import reprlib

import torch

SHORT = reprlib.Repr()  # a bad value as an error message shows it: long strings and containers cut short
SHORT.maxstring = SHORT.maxother = 80
SHOWN = 5  # bad values an error message lists before it only counts the rest


def short(value) -> str:
    """repr(value), at most about 80 characters: a message quoting a ten-million-entry list stays short."""
    return SHORT.repr(value)


def first_few(values: list) -> str:
    """The first SHOWN of the values, and how many there are when that is more."""
    more = f" ({SHOWN} of {len(values):,})" if len(values) > SHOWN else ""
    return f"{values[:SHOWN]}{more}"


def describe_range(minimum=None, maximum=None, open_min: bool = False, open_max: bool = False) -> str:
    if minimum is not None and maximum is not None:
        return f"in {'(' if open_min else '['}{minimum}, {maximum}{')' if open_max else ']'}"
    if minimum is not None:
        return f"{'>' if open_min else '>='} {minimum}"
    if maximum is not None:
        return f"{'<' if open_max else '<='} {maximum}"
    return ""


def is_integer(value) -> bool:
    # a plain int first: the ABC check runs Python frames, and the engine asks several times a decode step
    return type(value) is int or isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int (numpy ints too) within [minimum, maximum]."""
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer {describe_range(minimum, maximum)}".rstrip()
                         + f", got {short(value)} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {describe_range(minimum, maximum)}, got {value}")
    return int(value)


def power_of_two(name: str, value) -> int:
    value = integer(name, value, minimum=1)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 1, got {value}")
    return value


def optional_integer(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int | None:
    return None if value is None else integer(name, value, minimum, maximum)


def real(name: str, value, minimum: float | None = None, maximum: float | None = None,
         open_min: bool = False, open_max: bool = False) -> float:
    """A finite real number within the range (open or closed at each end)."""
    allowed = describe_range(minimum, maximum, open_min, open_max)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number {allowed}".rstrip()
                         + f", got {short(value)} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{name} must be a finite number {allowed}".rstrip() + f", got {value}") from None
    too_low = minimum is not None and (value <= minimum if open_min else value < minimum)
    too_high = maximum is not None and (value >= maximum if open_max else value > maximum)
    if not math.isfinite(value) or too_low or too_high:
        raise ValueError(f"{name} must be a finite number {allowed}".rstrip() + f", got {value}")
    return value


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {short(value)} ({type(value).__name__})")
    return value


def choice(name: str, value, allowed) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"unknown {name} {short(value)}; allowed: {', '.join(map(str, allowed))}")
    return value


def token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """A non-empty sequence of integer ids in [0, vocab_size): a list, tuple, range or 1-D integer tensor."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{name} as a tensor must be 1-D with an integer dtype, got shape {tuple(ids.shape)} "
                             f"and dtype {ids.dtype}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise ValueError(f"{name} must be a list of integer token ids, got {type(ids).__name__}")
    if not ids:
        raise ValueError(f"empty {name}: it needs at least one token")
    not_ints = [t for t in ids if not is_integer(t)]
    if not_ints:
        raise ValueError(f"{name} must hold integer token ids; got {short(not_ints[:SHOWN])} "
                         f"({', '.join(sorted({type(t).__name__ for t in not_ints}))})")
    in_vocabulary(f"{name} token id(s)", ids, vocab_size)
    return [int(t) for t in ids]


def in_vocabulary(name: str, ids, vocab_size: int, why: str = "") -> None:
    """Every id lies in [0, vocab_size); the refusal lists the first few that do not and counts them. why: what an
    out-of-vocabulary id would mean, for the message."""
    out_of_vocab = [t for t in ids if not 0 <= t < vocab_size]
    if out_of_vocab:
        raise ValueError(f"{name} {first_few(out_of_vocab)} out of vocabulary{why}: ids must lie in [0, {vocab_size})")


def id_tuple(name: str, ids, max_length: int) -> tuple[int, ...]:
    """At most max_length integer ids >= 0 (a list, tuple, set or range), as a tuple of ints; the length is checked
    before any entry, so range(10**9) is refused at once."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset, range)):
        raise ValueError(f"{name} must be a list or tuple of integer token ids, got {short(ids)} "
                         f"({type(ids).__name__})")
    if len(ids) > max_length:
        raise ValueError(f"{name} holds {len(ids):,} ids; at most {max_length:,} are allowed")
    return tuple(integer(f"{name}[]", t, minimum=0) for t in ids)


def integer_list(name: str, values, minimum: int | None = None, maximum: int | None = None,
                 may_be_empty: bool = False) -> list[int]:
    """A list or tuple of integers (non-empty unless may_be_empty), each within [minimum, maximum]."""
    if not isinstance(values, (list, tuple)) or not (values or may_be_empty):
        kind = "list" if may_be_empty else "non-empty list"
        raise ValueError(f"{name} must be a {kind} of integers {describe_range(minimum, maximum)}, got {short(values)}")
    return [integer(name, value, minimum, maximum) for value in values]


def device(name: str, value) -> str:
    """'cpu', 'cuda' or 'cuda:N' naming a device this machine has."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = f"this machine has {gpus} CUDA device(s)" if gpus else "CUDA is not available on this machine"
    try:
        parsed = torch.device(value) if isinstance(value, str) else None
    except RuntimeError:  # torch's word for a string that names no device
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown {name} {short(value)}; allowed: cpu, cuda, cuda:N ({here})")
    if parsed.type == "cuda" and (parsed.index or 0) >= gpus:
        raise ValueError(f"{name} {short(value)} is not available: {here}")
    return value
