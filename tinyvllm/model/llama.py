"""The Llama family (Llama 2/3/3.1/3.2, SmolLM2, ...) on a flat batch of tokens and a paged KV cache.

Every op but the matrix products goes through `tinyvllm.ops` (Triton on CUDA, PyTorch on the CPU).
Q/K/V and gate/up are merged into one matrix product each; the loader writes the checkpoint's
separate tensors into their slices (see `packed_modules`)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinyvllm import ops
from tinyvllm.config import ModelConfig
from tinyvllm.ops import AttentionMetadata


class Linear(nn.Module):
    """y = x W^T (+ b) through cuBLAS. Parameters start uninitialized: the checkpoint fills them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual stream): the residual add is fused into the norm."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.scale = self.head_dim**-0.5
        # Set by the ModelRunner once the KV pool is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = ops.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = ops.embedding(input_ids, self.embed_tokens.weight)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, cos_sin, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor name fragment -> (our merged parameter, index of its slice)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.max_positions = max_positions
        self.cos_sin_cache = torch.empty(0)  # float32 whatever the model's dtype: see init_rope_cache

    def init_rope_cache(self, device: torch.device) -> None:
        c = self.config
        self.cos_sin_cache = ops.build_cos_sin_cache(c.head_dim, self.max_positions, c.rope_theta,
                                                     c.rope_scaling, device)

    def packed_slice_sizes(self, merged: str) -> list[int]:
        """The sizes of the slices (in output rows) that make up a merged parameter."""
        c = self.config
        if merged == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for every token of the flat batch."""
        return self.model(input_ids, positions, self.cos_sin_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the rows given (only the positions that get sampled)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(hidden, weight.t()).float()
