"""The inference runtime: an engine that batches requests continuously over a paged (or contiguous) cache, with
its scheduler, block manager and prefix cache, model runner, sampling, beam search and speculative decoding.
It imports nothing from the experiments (compare, recall, training, serving, charts), which sit above it."""
from harness.engine.beam_search import BeamOutput, BeamSearchParams
from harness.engine.llm_engine import Engine
from harness.engine.request_metrics import RequestMetrics
from harness.engine.sampling import SamplingParams
from harness.engine.sequence import RequestOutput
from harness.engine.speculative import PROMPT_LOOKUP, SpeculativeConfig, SpeculativeStats

__all__ = ["BeamOutput", "BeamSearchParams", "Engine", "PROMPT_LOOKUP", "RequestMetrics", "RequestOutput",
           "SamplingParams", "SpeculativeConfig", "SpeculativeStats"]
