"""The Qwen2 family (Qwen2, Qwen2.5): Llama's decoder layer with biases on the q, k and v products (none on o, none
in the MLP), under its own config names. Sliding-window attention (use_sliding_window) is refused unless the context
fits the window (check_no_sliding_window)."""

from __future__ import annotations

import torch.nn as nn

from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.interface import check_no_sliding_window
from tinyvllm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def attention(self, config: ModelConfig, tp: TensorParallel) -> nn.Module:
        return LlamaAttention(config, tp, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen2DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()) -> None:
        hf = config.hf_config
        check_no_sliding_window(config, hf.get("sliding_window") if hf.get("use_sliding_window") else None,
                                max_positions)
        super().__init__(config, max_positions, tp)
