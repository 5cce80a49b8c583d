"""The Qwen3 family (dense): Llama's decoder layer with an RMSNorm over each head of q and of k (q_norm, k_norm)
before the rotary embedding, and no biases (unless its config says attention_bias). Its norms stay unfolded: q and k
are normalized after the product, which the folded layers' streamed path has no place for."""

from __future__ import annotations

import torch
import torch.nn as nn

from tinyvllm import ops
from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.layers import RMSNorm
from tinyvllm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tinyvllm.model.qwen2 import sliding_window_of
from tinyvllm.ops import AttentionMetadata


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, tp: TensorParallel, sliding_window: int | None = None) -> None:
        super().__init__(config, tp, sliding_window=sliding_window)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def norm_heads(self, qkv: torch.Tensor) -> None:
        """Normalize each head of q and of k in the qkv product, in place (each head a row of head_dim)."""
        attn = self.attn
        q_end = attn.q_size
        k_end = q_end + attn.num_kv_heads * attn.head_dim
        for norm, cols in ((self.q_norm, slice(0, q_end)), (self.k_norm, slice(q_end, k_end))):
            heads = qkv[:, cols].reshape(-1, attn.head_dim)
            qkv[:, cols] = norm(heads)[0].view(qkv.shape[0], -1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def attention(self, config: ModelConfig, tp: TensorParallel, index: int) -> nn.Module:
        return Qwen3Attention(config, tp, sliding_window_of(config, index))  # (Qwen2's rule, which Qwen3 keeps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        normed, residual = self.input_layernorm(x, residual)
        qkv = attn.qkv_proj(normed)
        attn.norm_heads(qkv)
        qkv = ops.rope_store(qkv, attn.attn.rope_store(positions, cos_sin, meta))
        x = attn(qkv, meta)
        gated, residual = self.post_attention_layernorm.project(x, residual, self.mlp.gate_up_proj, silu_and_mul=True)
        return self.mlp.down_proj(gated), residual


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3DecoderLayer

    def fold_norms(self) -> None:
        """Nothing to fold: the layers run forward() (see the module's docstring)."""
