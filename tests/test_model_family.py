"""Adding a model family: one file of its own decoder over the shared layers (model/layers.py) and the model interface
(model/interface.py), plus its registry line, and the engine runs it. The toy family below is Llama with one field
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
from tinyvllm.model.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tinyvllm.model.registry import register_model
from tinyvllm.ops import AttentionMetadata


# ---- the family's file ----------------------------------------------------------------------------------------
class ToyAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_heads, config.num_kv_heads, False, tp)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, False, tp, "o")
        self.attn = Attention(tp.split(config.num_heads), tp.split(config.num_kv_heads), d, d**-0.5)


class ToyMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, False, tp,
                                                       "gate_up")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp, "down")


class ToyDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ToyAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ToyMLP(config, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        qkv, residual = self.input_layernorm.project(x, residual, attn.qkv_proj,
                                                     rope=attn.attn.rope_store(positions, cos_sin, meta))
        x = attn.o_proj(attn.attn(qkv, meta))
        gated, residual = self.post_attention_layernorm.project(x, residual, self.mlp.gate_up_proj, silu_and_mul=True)
        return self.mlp.down_proj(gated), residual


class ToyModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(ToyDecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = float(config.hf_config["toy_embedding_multiplier"])  # the family's own field


class ToyForCausalLM(CausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

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
