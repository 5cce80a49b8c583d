"""The Gemma 2 family on the shared layers (model/layers.py), with Llama's attention and MLP blocks (model/llama.py)
and a decoder layer of its own, since the skeleton differs:
- four RMSNorms a layer: before attention (input_layernorm), on the attention's output before the residual add
  (post_attention_layernorm), before the MLP (pre_feedforward_layernorm) and on the MLP's output before the add
  (post_feedforward_layernorm);
- each RMSNorm scales by 1 + w (GemmaRMSNorm stores 1 + w, so the shared norm ops and kernels apply it);
- the embeddings times sqrt(hidden_size), rounded to the model's dtype as transformers does;
- attention scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped (attn_logit_softcapping), every other
  layer within a sliding window (`layer_types` where the config lists them, else the even layers: transformers'
  rule);
- the MLP's gate is GELU with the tanh approximation (ops.gelu_tanh_and_mul), after the gate/up product;
- the final logits soft-capped (final_logit_softcapping), in compute_logits, which every logits path goes through.

The norms stay unfolded (fold_norms is CausalLM's, which folds nothing): the post-norms sit between o_proj and down_proj
and the residual add, where the folded stream of Llama's forward_stream adds the products inside cuBLAS, and folding
only the pre-norms would trade their fused residual add for an add of its own, no kernel fewer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tinyvllm import ops
from tinyvllm.config import ConfigError, ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.interface import CausalLM
from tinyvllm.model.layers import (
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    default_weight_loader,
)
from tinyvllm.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from tinyvllm.ops import AttentionMetadata

# transformers' Gemma2Config defaults, for the fields a config.json may leave out
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
DEFAULT_ATTN_LOGIT_SOFTCAPPING = 50.0
DEFAULT_FINAL_LOGIT_SOFTCAPPING = 30.0
GELU_TANH = "gelu_pytorch_tanh"


def _positive_or_none(hf: dict[str, Any], key: str, default: float | None) -> float | None:
    """hf[key] (default where absent; null turns it off) as a positive number, or None."""
    value = hf.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ConfigError(f"field {key!r} must be a positive number or null, not {value!r}")
    return value


def sliding_window_of(config: ModelConfig, index: int) -> int | None:
    """Layer `index`'s window, or None where it attends to its whole context."""
    hf = config.hf_config
    window = _positive_or_none(hf, "sliding_window", DEFAULT_SLIDING_WINDOW)
    if window is None:
        return None
    if not isinstance(window, int):
        raise ConfigError(f"field 'sliding_window' must be a whole number of tokens, not {window!r}")
    layer_types = hf.get("layer_types")
    if layer_types:
        if len(layer_types) != config.num_layers:
            raise ConfigError(f"field 'layer_types' lists {len(layer_types)} layers; the model has "
                              f"{config.num_layers}")
        return window if layer_types[index] == "sliding_attention" else None
    return window if index % 2 == 0 else None


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x / rms(x) * (1 + w): the weight is loaded as 1 + w, so RMSNorm's ops (and project's fused
    kernels) apply it as they apply Llama's w. It is kept in float32 whatever the model's dtype, as transformers
    computes 1 + w: rounded to bfloat16, each channel's scale would move by up to 2^-8."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data = self.weight.data.float()
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        default_weight_loader(param, tensor)
        param.data += 1.0


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int = 0) -> None:
        super().__init__()
        hf = config.hf_config
        scalar = _positive_or_none(hf, "query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR)
        if scalar is None:
            raise ConfigError("field 'query_pre_attn_scalar' must be a positive number, not null")
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, tp, sliding_window=sliding_window_of(config, index), scale=scalar**-0.5,
            logit_softcap=_positive_or_none(hf, "attn_logit_softcapping", DEFAULT_ATTN_LOGIT_SOFTCAPPING))
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)  # (its gate_up and down products; the gate is GELU here, in forward)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layers, the residual stream is x + residual (x alone in the first layer), each add left to the
        norm after it (fused): here, to input_layernorm and pre_feedforward_layernorm, whose inputs are the
        post-norms' outputs. The gate/up product runs with the norm before it (RMSNorm.project, one kernel where
        the decode kernels apply), the GELU gate after it."""
        attn, mlp = self.self_attn, self.mlp
        rope = attn.attn.rope_store(positions, cos_sin, meta)
        qkv, residual = self.input_layernorm.project(x, residual, attn.qkv_proj, rope=rope)
        x = self.post_attention_layernorm(attn(qkv, meta))[0]
        gate_up, residual = self.pre_feedforward_layernorm.project(x, residual, mlp.gate_up_proj)
        x = mlp.down_proj(ops.gelu_tanh_and_mul(gate_up))
        return self.post_feedforward_layernorm(x)[0], residual


class Gemma2Model(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, tp, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # sqrt(hidden_size) in the model's dtype (48.0 at 2,304 in bfloat16), the factor transformers multiplies by
        weight = self.embed_tokens.weight
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, dtype=weight.dtype,
                                                         device=weight.device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, cos_sin, meta)
        return self.norm(x, residual)[0]


class Gemma2ForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping  # (Llama's merged products, Llama's names)

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__(config, max_positions, tp)
        hf = config.hf_config
        activation = hf.get("hidden_activation", GELU_TANH)
        if activation != GELU_TANH:
            raise ConfigError(f"field 'hidden_activation' is {activation!r}; tinyvllm runs Gemma 2 with "
                              f"{GELU_TANH!r} only (its checkpoints' activation)")
        self.final_logit_softcap = _positive_or_none(hf, "final_logit_softcapping", DEFAULT_FINAL_LOGIT_SOFTCAPPING)
        self.model = Gemma2Model(config, tp)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.rotary.cos_sin_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """CausalLM's logits, soft-capped: cap * tanh(logits / cap), in place in the logits' dtype, each step
        rounded as transformers rounds it. greedy_tokens stays CausalLM's (the fused LM head, which writes no
        logits): the cap is monotonic, so the raw logits' argmax is the capped ones', save where rounding the capped
        values ties the top two, and then it picks the larger raw logit where argmax of the capped takes the lower
        id."""
        logits = super().compute_logits(hidden)
        if logits is not None and self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits.div_(cap).tanh_().mul_(cap)
        return logits
