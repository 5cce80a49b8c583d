"""Architecture name (config.json's `architectures`, GGUF's `general.architecture`) -> model class."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

# Names of the Llama family that share one implementation.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "llama": "LlamaForCausalLM",
}


class UnsupportedArchitectureError(ValueError):
    pass


def check_architecture(name: str) -> str:
    """The canonical architecture name, or an error that lists the ones we support."""
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {name!r} is not supported; tinyvllm runs: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return SUPPORTED_ARCHITECTURES[name]


def model_class(name: str) -> type[nn.Module]:
    from tinyvllm.model.llama import LlamaForCausalLM

    return {"LlamaForCausalLM": LlamaForCausalLM}[check_architecture(name)]
