"""Adding a model family: one file over the shared layers (model/layers.py), the model interface
(model/interface.py) and what it shares with another family (here Llama's decoder layer), plus its registry line,
and the engine runs it. The toy family below is Llama with one field
of its own read from its config.json (its embeddings are scaled, as Gemma's are); its reference is transformers'
Llama fed the scaled embeddings. Its model code here is the whole of what a new family writes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from tests.utils import hf_model, save_tiny_llama
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.interface import CausalLM
from tinyvllm.model.layers import ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from tinyvllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from tinyvllm.model.registry import register_model
from tinyvllm.ops import AttentionMetadata


# ---- the family's file -------------------------------------------------------------------------------------
# Its decoder layer is Llama's (a family reuses what it shares with another, as vLLM's do); what it adds is the
# scaled embedding, read from its own config field, and the model around the layers.
class ToyModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = float(config.hf_config["toy_embedding_multiplier"])  # the family's own field


class ToyForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping  # (Llama's layers, Llama's checkpoint names)

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__(config, max_positions, tp)
        self.model = ToyModel(config, tp)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids) * self.model.embedding_multiplier, None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, self.rotary.cos_sin_cache, meta)
        return self.model.norm(x, residual)[0]


# ---- the registry line ---------------------------------------------------------------------------------------
register_model("ToyForCausalLM", ToyForCausalLM)


# ---- the checks ----------------------------------------------------------------------------------------------
MULTIPLIER = 2.5


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory) -> str:
    path = save_tiny_llama(str(tmp_path_factory.mktemp("toy")), seed=11, tie_word_embeddings=False)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(architectures=["ToyForCausalLM"], toy_embedding_multiplier=MULTIPLIER)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


@torch.inference_mode()
def _reference_greedy(path: str, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' Llama on the same weights, fed the embeddings scaled: full forward passes, no cache."""
    model = hf_model(path)
    ids = list(prompt)
    for _ in range(num_tokens):
        embeds = model.model.embed_tokens(torch.tensor([ids])) * MULTIPLIER
        ids.append(int(model(inputs_embeds=embeds).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_family_from_one_file_and_a_registry_line_runs(toy_checkpoint):
    llm = LLM(toy_checkpoint, skip_tokenizer_init=True, device="cpu", num_kv_blocks=32)
    assert type(llm.llm_engine.engine_core.model_runner.model) is ToyForCausalLM
    prompts = [[3, 17, 42, 99, 5], [7, 8, 9]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == _reference_greedy(toy_checkpoint, prompt, 12)
