"""Speculative decoding (the algorithm lever): a cheap proposer, an exact verification by the target."""
from harness.engine.speculative.config import PROMPT_LOOKUP, SpeculativeConfig
from harness.engine.speculative.decoder import SpeculativeDecoder, SpeculativeStats

__all__ = ["PROMPT_LOOKUP", "SpeculativeConfig", "SpeculativeDecoder", "SpeculativeStats"]
