"""Catches what a CUDA graph cannot capture: a step that reads device values on the host or builds tensors from host
data. On CPU nothing synchronises, so the operations that would are recognised by name as they are dispatched."""
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# each reads a tensor's values on the host (.item(), int(), bool()) or sizes its output by them
HOST_READS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.masked_select, aten.unique_dim, aten._unique2,
              aten.unique_consecutive, aten.repeat_interleave, aten.lift_fresh}


class HostSyncs(TorchDispatchMode):
    """Records every operation dispatched inside it that would synchronise a CUDA step with the host."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS:
            self.seen.append(str(func))
        elif func.overloadpacket is aten.index and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"{func} with a boolean mask (its size is read on the host)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_syncs():
    """Yields the list of host synchronisations made inside; .tolist() and .numpy() (which dispatch nothing on CPU)
    are caught at the Python level."""
    mode = HostSyncs()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    own = {name for name in originals if name in vars(torch.Tensor)}  # else inherited from the C base class

    def recorder(name):
        def method(tensor, *args, **kwargs):
            mode.seen.append(f"Tensor.{name}")
            return originals[name](tensor, *args, **kwargs)
        return method

    for name in originals:
        setattr(torch.Tensor, name, recorder(name))
    try:
        with mode:
            yield mode.seen
    finally:
        for name, method in originals.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)
