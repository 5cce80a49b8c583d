"""Canonical architecture name -> model class. The names and their aliases live in tinyvllm.config
(`check_architecture`), which reads configs without importing any model; they are re-exported here."""

from __future__ import annotations

import torch.nn as nn

from tinyvllm.config import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, check_architecture
from tinyvllm.model.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {"LlamaForCausalLM": LlamaForCausalLM}


def model_class(name: str) -> type[nn.Module]:
    """The class that implements architecture `name` (any alias check_architecture accepts)."""
    return MODEL_CLASSES[check_architecture(name)]


__all__ = ["MODEL_CLASSES", "SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "check_architecture",
           "model_class"]
