"""The Qwen2 family (Qwen2, Qwen2.5): Llama's decoder layer with biases on the q, k and v products (none on o, none
in the MLP), under its own config names. With use_sliding_window, the layers its config marks as sliding attend
within the window: `layer_types` where the config lists them, else those from max_window_layers on (transformers'
rule)."""

from __future__ import annotations

import torch.nn as nn

from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def sliding_window_of(config: ModelConfig, index: int) -> int | None:
    """Layer `index`'s window, or None where it attends to its whole context."""
    hf = config.hf_config
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types:
        return hf["sliding_window"] if layer_types[index] == "sliding_attention" else None
    return hf["sliding_window"] if index >= hf.get("max_window_layers", config.num_layers) else None


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def attention(self, config: ModelConfig, tp: TensorParallel, index: int) -> nn.Module:
        return LlamaAttention(config, tp, qkv_bias=True, o_bias=False, sliding_window=sliding_window_of(config, index))


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen2DecoderLayer
