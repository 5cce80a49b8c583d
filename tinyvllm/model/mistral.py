"""The Mistral family: Llama's architecture under its own name, with a sliding window over the context when its
config sets one (refused unless the context fits the window: check_no_sliding_window)."""

from __future__ import annotations

from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.interface import check_no_sliding_window
from tinyvllm.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()) -> None:
        check_no_sliding_window(config, config.hf_config.get("sliding_window"), max_positions)
        super().__init__(config, max_positions, tp)
