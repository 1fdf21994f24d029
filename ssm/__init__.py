"""Recurrent-state mixers: Mamba (selective scan), Mamba-2 (SSD), Gated DeltaNet, RetNet's multi-scale retention and
RWKV-7, each with its recurrent state."""
from ssm.gated_deltanet import GatedDeltaNet
from ssm.mamba import Mamba
from ssm.mamba2 import Mamba2
from ssm.retnet import MultiScaleRetention
from ssm.rwkv7 import RWKV7

__all__ = ["GatedDeltaNet", "Mamba", "Mamba2", "MultiScaleRetention", "RWKV7"]
