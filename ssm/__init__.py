"""State-space mixers: Mamba (selective scan) and Mamba-2 (SSD), with their recurrent state."""
from ssm.mamba import Mamba
from ssm.mamba2 import Mamba2

__all__ = ["Mamba", "Mamba2"]
