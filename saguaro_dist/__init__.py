"""saguaro-dist: distributed Speculative Speculative Decoding with the Saguaro optimisations."""
from __future__ import annotations

from saguaro_dist.config import BonusDraw, Config, DraftExecutor, FallbackPolicy, FanOut, HitGlue, Mode, TreePolicy
from saguaro_dist.lora_request import LoRARequest
from saguaro_dist.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "CompletionOutput", "Logprob", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "Config", "Mode", "FanOut", "FallbackPolicy", "DraftExecutor", "TreePolicy", "HitGlue", "BonusDraw"]


def __getattr__(name):
    # The engine pulls in torch, transformers and (for clusters) ray: import it only when asked for,
    # so `import saguaro_dist.client` stays light.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from saguaro_dist.engine import llm
        return getattr(llm, name)
    if name == "Logprob":  # vLLM's Logprob of RequestOutput.logprobs: without loading the engine
        from saguaro_dist.engine.logprob_objects import Logprob
        return Logprob
    raise AttributeError(f"module 'saguaro_dist' has no attribute {name!r}")
