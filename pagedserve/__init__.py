"""pagedserve: a paged-attention, continuous-batching LLM serving engine.

Offline use: `from pagedserve import LLM, SamplingParams`.
"""
from common.sampling_params import SamplingParams
from pagedserve.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
