"""State-space mixers (Mamba, Mamba-2) and their recurrent state: arrives with the constant-state issue."""
