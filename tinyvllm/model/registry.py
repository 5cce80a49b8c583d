"""Architecture name -> model class: a family's registry line. The names and their aliases live in tinyvllm.config
(`check_architecture`), which reads configs without importing any model; register_model adds to both."""

from __future__ import annotations

from tinyvllm.config import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, check_architecture
from tinyvllm.model.gemma2 import Gemma2ForCausalLM
from tinyvllm.model.interface import CausalLM
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.mistral import MistralForCausalLM
from tinyvllm.model.qwen2 import Qwen2ForCausalLM
from tinyvllm.model.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def register_model(architecture: str, model_class: type[CausalLM], aliases: tuple[str, ...] = ()) -> None:
    """Make the engine load `model_class` for configs naming `architecture` (config.json's `architectures`) or any
    of `aliases` (GGUF's general.architecture, say)."""
    MODEL_CLASSES[architecture] = model_class
    for name in (architecture, *aliases):
        SUPPORTED_ARCHITECTURES[name] = architecture


def model_class(name: str) -> type[CausalLM]:
    """The class that implements architecture `name` (any alias check_architecture accepts)."""
    return MODEL_CLASSES[check_architecture(name)]


__all__ = ["MODEL_CLASSES", "SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "check_architecture",
           "model_class", "register_model"]
