"""Everything that runs a model: the engine, sampling, metrics, comparisons, charts and the CLI."""
from harness.diffusion import DiffusionSampler
from harness.beam_search import BeamOutput, BeamSearchParams
from harness.engine import Engine
from harness.metrics import RequestMetrics, measure_copy_bandwidth, summarize
from harness.sampling import SamplingParams
from harness.sequence import RequestOutput
from harness.speculative import PROMPT_LOOKUP, SpeculativeConfig, SpeculativeStats

__all__ = ["BeamOutput", "BeamSearchParams", "DiffusionSampler", "Engine", "PROMPT_LOOKUP", "RequestMetrics", "RequestOutput",
           "SamplingParams", "SpeculativeConfig", "SpeculativeStats", "measure_copy_bandwidth", "summarize"]
