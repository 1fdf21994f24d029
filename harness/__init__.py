"""Everything that runs a model: the engine, sampling, metrics, comparisons, charts and the CLI."""
from harness.diffusion import DiffusionSampler
from harness.beam_search import BeamOutput, BeamSearchParams
from harness.engine import Engine
from harness.metrics import RequestMetrics, measure_copy_bandwidth, summarize
from harness.sampling import SamplingParams
from harness.sequence import RequestOutput

__all__ = ["BeamOutput", "BeamSearchParams", "DiffusionSampler", "Engine", "RequestMetrics", "RequestOutput", "SamplingParams", "measure_copy_bandwidth", "summarize"]
