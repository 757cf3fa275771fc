"""pagedserve: a paged-attention, continuous-batching LLM serving engine.

Offline use: `from pagedserve import LLM, SamplingParams`; asyncio programs: `AsyncLLMEngine`.
"""
from common.lora import LoRARequest
from common.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from common.structured_output import GuidedDecodingParams, StructuredOutputsParams
from pagedserve.async_engine import AsyncLLM, AsyncLLMEngine, EngineDeadError
from pagedserve.llm import LLM, BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLMEngine", "AsyncLLM", "EngineDeadError", "SamplingParams", "RequestOutputKind", "LoRARequest",
           "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams", "GuidedDecodingParams"]
__version__ = "0.1.0"
