"""tinyvllm: a small, fast LLM inference engine with vLLM's interface."""

from tinyvllm.llm import LLM
from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
