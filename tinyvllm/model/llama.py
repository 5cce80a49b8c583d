"""The Llama family (Llama 2/3/3.1/3.2, SmolLM2, ...) on a flat batch of tokens and a paged KV cache: its decoder
layer over the shared layers (model/layers.py) and the model interface (model/interface.py).

Q/K/V and gate/up are merged into one matrix product each (QKVParallelLinear, MergedColumnParallelLinear), which
load the checkpoint's separate tensors into their slices. At decode sizes on CUDA the products run on our own
kernels instead of cuBLAS (ops.use_decode_kernel), each norm inside the product after it (RMSNorm.project), the
MLP's SiLU·mul inside gate/up and the rotary embedding with the KV-cache store inside qkv. Elsewhere the norms'
weights are folded into those products (fold_norms), so the layers run no norm kernel
(LlamaDecoderLayer.forward_stream); unfolded (tensor parallelism, biases, float16) each op is its own kernel.

Tensor parallelism (Megatron-style, as vLLM): Q/K/V and gate/up are split by output columns (whole heads), O and
down by input rows followed by an all-reduce, the embedding and LM head over the vocabulary (model/layers.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from tinyvllm import ops
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
from tinyvllm.ops import AttentionMetadata


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, qkv_bias: bool | None = None,
                 o_bias: bool | None = None, sliding_window: int | None = None, scale: float | None = None,
                 logit_softcap: float | None = None) -> None:
        """qkv_bias, o_bias: whether the products have biases (default: config.attention_bias, as Llama's);
        sliding_window: the tokens each one attends to, itself included (None: its whole context); scale: of the
        scores (default head_dim ** -0.5); logit_softcap: the scores capped to cap * tanh(score / cap) (None: not)."""
        super().__init__()
        head_dim = config.head_dim
        qkv_bias = config.attention_bias if qkv_bias is None else qkv_bias
        o_bias = config.attention_bias if o_bias is None else o_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_heads, config.num_kv_heads,
                                          qkv_bias, tp)
        self.o_proj = RowParallelLinear(config.num_heads * head_dim, config.hidden_size, o_bias, tp, "o")
        # This rank's heads: num_heads / tp.size query heads and the num_kv_heads / tp.size KV heads they share.
        self.attn = Attention(tp.split(config.num_heads), tp.split(config.num_kv_heads), head_dim,
                              head_dim**-0.5 if scale is None else scale, sliding_window=sliding_window,
                              logit_softcap=logit_softcap)

    def forward(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """o_proj(attention(qkv)), for a qkv_proj output whose q is rotated and whose k and v are in the cache (the
        decoder layer runs qkv_proj with the norm before it and the rotary store after it)."""
        return self.o_proj(self.attn(qkv, meta))


class LlamaMLP(nn.Module):
    """down(silu(gate) * up). The decoder layer runs gate_up with the norm before it and the gate after it
    (RMSNorm.project), then down_proj."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       config.mlp_bias, tp, "gate_up")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp,
                                           "down")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention(config, tp, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        rope = attn.attn.rope_store(positions, cos_sin, meta)
        qkv, residual = self.input_layernorm.project(x, residual, attn.qkv_proj, rope=rope)
        x = attn(qkv, meta)
        gated, residual = self.post_attention_layernorm.project(x, residual, self.mlp.gate_up_proj, silu_and_mul=True)
        return self.mlp.down_proj(gated), residual

    def attention(self, config: ModelConfig, tp: TensorParallel, index: int) -> nn.Module:
        """The attention block of layer `index` (a family whose attention differs overrides this alone)."""
        return LlamaAttention(config, tp)

    def fold_norms(self) -> None:
        """Fold each RMSNorm's weight into the product after it (RMSNorm.fold_into): the norm's output feeds only
        that product, so forward() is unchanged and forward_stream() may run."""
        self.input_layernorm.fold_into(self.self_attn.qkv_proj)
        self.post_attention_layernorm.fold_into(self.mlp.gate_up_proj)

    def uses_decode_kernels(self, x: torch.Tensor) -> bool:
        """Whether any of the layer's products runs on our decode kernels at x's row count."""
        return any(linear.uses_decode_kernel(x) for linear in (self.self_attn.qkv_proj, self.self_attn.o_proj,
                                                               self.mlp.gate_up_proj, self.mlp.down_proj))

    def forward_stream(self, positions: torch.Tensor, h: torch.Tensor, cos_sin: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """forward() with the norms folded (fold_norms) and the products on cuBLAS, one weight whole (tensor
        parallel size 1), no biases: h is the residual stream itself, updated IN PLACE and returned. No norm
        kernel runs: qkv_proj and gate_up_proj read h, the op after each scales its rows by the norm's 1/rms
        (ops.RowNorm; a weight format may normalize first instead, Linear.normed), and o_proj and down_proj add
        their product to h in cuBLAS (addmm, beta = 1). Two fewer kernels a layer, and the residual add rounds once
        (in float32, then to h's dtype)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, norm = attn.qkv_proj.normed(h, self.input_layernorm.eps)
        qkv = ops.rope_store(qkv, attn.attn.rope_store(positions, cos_sin, meta), norm=norm)
        attn.o_proj.add_to(h, attn.attn(qkv, meta))
        gate_up, norm = mlp.gate_up_proj.normed(h, self.post_attention_layernorm.eps)
        return mlp.down_proj.add_to(h, ops.silu_and_mul(gate_up, norm=norm))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel,
                 decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(decoder_layer(config, tp, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norms_folded = False  # LlamaForCausalLM.fold_norms, once the weights are loaded

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.norms_folded and not self.layers[0].uses_decode_kernels(x):
            for layer in self.layers:
                x = layer.forward_stream(positions, x, cos_sin, meta)
            return self.norm(x)[0]
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, cos_sin, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer  # (a family of Llama's shape swaps its own in)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__(config, max_positions, tp)
        self.model = LlamaModel(config, tp, self.decoder_layer)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def fold_norms(self) -> None:
        """LlamaDecoderLayer.fold_norms in every layer, where forward_stream can then run: one rank, no biases,
        bfloat16 or float32 weights, and a weight format that takes the fold (not a float8 checkpoint's). A step of
        more rows than our decode kernels take then runs no norm kernel in the layers. (In float16 the products of
        the unnormalized stream, up to its rms times larger than the normalized one's, would come nearer the
        format's 65,504 ceiling; bfloat16 has float32's range.)"""
        layers = self.model.layers
        linears = [linear for layer in layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if (self.tp.size > 1 or any(linear.bias is not None or not linear.method.can_fold_norms for linear in linears)
                or linears[0].weight.dtype == torch.float16):
            return
        for layer in layers:
            layer.fold_norms()
        self.model.norms_folded = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.rotary.cos_sin_cache, meta)
