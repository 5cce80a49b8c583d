"""The Mistral family: Llama's architecture under its own name, every layer attending within the config's sliding
window when it sets one (Mistral 7B v0.1's 4,096 tokens; later ones set none)."""

from __future__ import annotations

import torch.nn as nn

from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class MistralDecoderLayer(LlamaDecoderLayer):
    def attention(self, config: ModelConfig, tp: TensorParallel, index: int) -> nn.Module:
        return LlamaAttention(config, tp, sliding_window=config.hf_config.get("sliding_window"))


class MistralForCausalLM(LlamaForCausalLM):
    decoder_layer = MistralDecoderLayer
