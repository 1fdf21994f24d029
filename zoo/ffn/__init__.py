"""Feed-forward kinds, one file each, declared in zoo/registry.py's FFNS. The contract an FFN class meets:

- built as `cls(d_model=..., hidden=..., **params)` (hidden: the FFNSpec's, else the model's mlp_hidden), with
  annotated int, float, bool and str parameters (zoo/feedforward.py checks them by those annotations);
- `module_bytes(dtype, **constructor_args)`, a static method: its parameter and buffer bytes from the arguments
  alone, with the range checks `__init__` makes, so a model is priced and refused before it is built;
- `forward(x, batch=None)`: x [..., d_model] -> [..., d_model], position-wise. batch is the engine's CacheBatch
  (None without a cache): a step with `batch.captured` is replayed from a graph, so its shapes and control flow
  must not depend on tensor values (a routed FFN reads no device value on the host there);
- `reference(x)`: the float64 oracle, written from the definition without the fast path's code.
"""
from zoo.ffn.gelu import GeluMLP
from zoo.ffn.moe import MoE
from zoo.ffn.swiglu import SwiGLU

__all__ = ["GeluMLP", "MoE", "SwiGLU"]
