"""Everything that runs a model: the runtime (harness.engine), and above it the comparisons, recall and quality
suites, training, the server, charts and the CLI."""
from harness.diffusion import DiffusionSampler
from harness.engine import (PROMPT_LOOKUP, BeamOutput, BeamSearchParams, Engine, RequestMetrics, RequestOutput,
                            SamplingParams, SpeculativeConfig, SpeculativeStats)
from harness.metrics import measure_copy_bandwidth, summarize

__all__ = ["BeamOutput", "BeamSearchParams", "DiffusionSampler", "Engine", "PROMPT_LOOKUP", "RequestMetrics",
           "RequestOutput", "SamplingParams", "SpeculativeConfig", "SpeculativeStats", "measure_copy_bandwidth",
           "summarize"]
