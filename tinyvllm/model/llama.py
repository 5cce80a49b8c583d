"""The Llama family (Llama 2/3/3.1/3.2, SmolLM2, ...) on a flat batch of tokens and a paged KV cache.

Every op but the matrix products goes through `tinyvllm.ops` (Triton on CUDA, PyTorch on the CPU).
Q/K/V and gate/up are merged into one matrix product each; the loader writes the checkpoint's
separate tensors into their slices (see `packed_modules`). At decode sizes on CUDA the products run on our
own kernels instead of cuBLAS (ops.use_decode_kernel), each norm inside the product after it
(RMSNorm.project), the MLP's SiLU·mul inside gate/up and the rotary embedding with the KV-cache store inside qkv.
Elsewhere the norms' weights are folded into those products (fold_norms), so the layers run no norm kernel
(LlamaDecoderLayer.forward_stream); unfolded (tensor parallelism, biases, float16) each op is its own kernel.

Tensor parallelism (Megatron-style, as vLLM): Q/K/V and gate/up are split by output columns (whole heads),
O and down by input rows followed by an all-reduce, the embedding and LM head over the vocabulary. Each
split parameter carries `tp_dim`, the dimension the loader cuts the checkpoint tensor along. With the
default TensorParallel() (size 1) the shapes, names and forward pass are those of the plain model."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinyvllm import ops
from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel, all_reduce, gather_last_dim
from tinyvllm.ops import AttentionMetadata


class Linear(nn.Module):
    """y = x W^T (+ b) through cuBLAS, or at decode sizes our kernel (ops.fused_linear). Parameters start
    uninitialized: the checkpoint fills them. `product` names the layer in ops.DECODE_KERNEL_MAX_ROWS; None
    (a bias, or a weight split over ranks) keeps it on cuBLAS."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, product: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.product = None if bias else product

    def uses_decode_kernel(self, x: torch.Tensor) -> bool:
        return self.product is not None and ops.use_decode_kernel(self.product, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_decode_kernel(x):
            return ops.fused_linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def _split_along(param: nn.Parameter, dim: int, padded: bool = False) -> None:
    """Mark a parameter as this rank's slice of the checkpoint tensor along `dim`; `padded`: the last
    rank's slice runs past the checkpoint's end (the vocabulary), and the loader zeroes the tail."""
    param.tp_dim, param.tp_padded = dim, padded


class ColumnParallelLinear(Linear):
    """Each rank holds a slice of the output features and computes that slice of y: no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 product: str | None = None) -> None:
        super().__init__(in_features, tp.split(out_features), bias, product if tp.size == 1 else None)
        _split_along(self.weight, 0)
        if self.bias is not None:
            _split_along(self.bias, 0)


class RowParallelLinear(Linear):
    """Each rank holds a slice of the input features (matching the column-parallel layer before it); the
    partial products are summed over the ranks. Only rank 0 adds the bias, so the sum has it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 product: str | None = None) -> None:
        super().__init__(tp.split(in_features), out_features, bias, product if tp.size == 1 else None)
        _split_along(self.weight, 1)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        return all_reduce(F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None), self.tp)


def vocab_rows_per_rank(vocab_size: int, tp: TensorParallel) -> int:
    """The vocabulary padded to a multiple of the ranks, split evenly: rank r holds ids [r * n, (r + 1) * n)."""
    return -(-vocab_size // tp.size)


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the tokens of its vocabulary range and zeroes the others; the all-reduce then
    holds every token's embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_rows = vocab_rows_per_rank(num_embeddings, tp)
        self.weight = nn.Parameter(torch.empty(self.num_rows, embedding_dim), requires_grad=False)
        _split_along(self.weight, 0, padded=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return ops.embedding(input_ids, self.weight)
        local_ids = input_ids - self.tp.rank * self.num_rows
        outside = (local_ids < 0) | (local_ids >= self.num_rows)
        x = ops.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0), self.tp)


class ParallelLMHead(Linear):
    """The output projection, split over the vocabulary as VocabParallelEmbedding is (so a tied head is
    the embedding's own shard); LlamaForCausalLM.compute_logits gathers the slices."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, vocab_rows_per_rank(vocab_size, tp), bias=False)
        _split_along(self.weight, 0, padded=True)


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

    def project(self, x: torch.Tensor, residual: torch.Tensor | None, linear: Linear, silu_and_mul: bool = False,
                rope: ops.RopeStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), residual stream), with silu_and_mul the MLP's gate applied to the product,
        with rope (qkv_proj) q rotated in it and k, v stored in the cache: one kernel where the decode kernel
        applies to `linear`, else the norm, the product and the gate or the rotary op in turn."""
        if linear.uses_decode_kernel(x):
            return ops.fused_norm_linear(x, residual, self.weight, self.eps, linear.weight, silu_and_mul, rope=rope)
        normed, residual = self(x, residual)
        y = linear(normed)
        if silu_and_mul:
            y = ops.silu_and_mul(y)
        if rope is not None:
            y = ops.rope_store(y, rope)
        return y, residual


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        # This rank's heads: num_heads / tp.size query heads and the num_kv_heads / tp.size KV heads they share.
        self.num_heads, self.num_kv_heads = tp.split(config.num_heads), tp.split(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, qkv_size, config.attention_bias, tp, "qkv")
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size,
                                        config.attention_bias, tp, "o")
        self.scale = self.head_dim**-0.5
        # Set by the ModelRunner once the KV pool is allocated: [num_blocks, block_size, kv_heads, head_dim]
        # (this rank's num_kv_heads).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """o_proj(attend(qkv))."""
        return self.o_proj(self.attend(qkv, meta))

    def attend(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention [T, q_size] of the tokens whose qkv_proj output, q rotated, is `qkv` (their k and v in the
        cache: the decoder layer runs qkv_proj with the norm before it and ops.rope_store after it, see `rope`)."""
        num_tokens = qkv.shape[0]
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        out = (meta.attention or ops.paged_attention)(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(num_tokens, self.q_size)

    def rope(self, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata) -> ops.RopeStore:
        """What follows qkv_proj: q and k rotated at `positions`, k and v stored at the step's cache slots."""
        return ops.RopeStore(positions, cos_sin, self.k_cache, self.v_cache, meta.slot_mapping, self.num_heads,
                             self.num_kv_heads)


class LlamaMLP(nn.Module):
    """down(silu(gate) * up). The decoder layer runs gate_up with the norm before it and the gate after it
    (RMSNorm.project), then down_proj."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * config.intermediate_size,
                                                 config.mlp_bias, tp, "gate_up")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp,
                                           "down")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        rope = attn.rope(positions, cos_sin, meta)
        qkv, residual = self.input_layernorm.project(x, residual, attn.qkv_proj, rope=rope)
        x = attn(qkv, meta)
        gated, residual = self.post_attention_layernorm.project(x, residual, self.mlp.gate_up_proj, silu_and_mul=True)
        return self.mlp.down_proj(gated), residual

    def fold_norms(self) -> None:
        """Fold each RMSNorm's weight into the product after it: W[:, k] *= g[k] (rounded once, from float32), and
        g = 1. Exact in exact arithmetic (the norm's output feeds only that product), so forward() is unchanged
        and forward_stream() may run. In slices of rows, so that the float32 copy stays small."""
        pairs = ((self.input_layernorm, self.self_attn.qkv_proj), (self.post_attention_layernorm,
                                                                  self.mlp.gate_up_proj))
        for norm, linear in pairs:
            g = norm.weight.data.float()[None, :]
            for rows in linear.weight.data.split(1024):
                rows.copy_(rows.float() * g)
            norm.weight.data.fill_(1.0)

    def uses_decode_kernels(self, x: torch.Tensor) -> bool:
        """Whether any of the layer's products runs on our decode kernels at x's row count."""
        return any(linear.uses_decode_kernel(x) for linear in (self.self_attn.qkv_proj, self.self_attn.o_proj,
                                                               self.mlp.gate_up_proj, self.mlp.down_proj))

    def forward_stream(self, positions: torch.Tensor, h: torch.Tensor, cos_sin: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """forward() with the norms folded (fold_norms) and the products on cuBLAS, one weight whole (tensor
        parallel size 1), no biases: h is the residual stream itself, updated IN PLACE and returned. No norm
        kernel runs: qkv_proj and gate_up_proj read h, the op after each scales its rows by the norm's 1/rms
        (ops.RowNorm), and o_proj and down_proj add their product to h in cuBLAS (addmm, beta = 1). Two fewer
        kernels a layer, and the residual add rounds once (in float32, then to h's dtype)."""
        attn, mlp = self.self_attn, self.mlp
        qkv = ops.rope_store(attn.qkv_proj(h), attn.rope(positions, cos_sin, meta),
                             norm=ops.RowNorm(h, self.input_layernorm.eps))
        h.addmm_(attn.attend(qkv, meta), attn.o_proj.weight.t())
        gated = ops.silu_and_mul(mlp.gate_up_proj(h), norm=ops.RowNorm(h, self.post_attention_layernorm.eps))
        return h.addmm_(gated, mlp.down_proj.weight.t())


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_layers))
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


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor name fragment -> (our merged parameter, index of its slice)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.max_positions = max_positions
        self.cos_sin_cache = torch.empty(0)  # float32 whatever the model's dtype: see init_rope_cache

    def init_rope_cache(self, device: torch.device) -> None:
        c = self.config
        self.cos_sin_cache = ops.build_cos_sin_cache(c.head_dim, self.max_positions, c.rope_theta,
                                                     c.rope_scaling, device)

    def packed_slice_sizes(self, merged: str) -> list[int]:
        """The sizes of the slices (in output rows) that make up a merged parameter on this rank."""
        c, split = self.config, self.tp.split
        if merged == "qkv_proj":
            kv_size = split(c.num_kv_heads) * c.head_dim
            return [split(c.num_heads) * c.head_dim, kv_size, kv_size]
        return [split(c.intermediate_size)] * 2

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """K and V of every layer for one block of tokens, on this rank (its share of the KV heads), in the cache's
        dtype (float8 e4m3 for kv_cache_dtype="fp8": a byte an element)."""
        attn = self.model.layers[0].self_attn
        return 2 * len(self.model.layers) * block_size * attn.num_kv_heads * attn.head_dim * dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Give every layer its K and V pools, [num_blocks, block_size, kv_heads, head_dim] each (ops.kv_pool), in
        `dtype` (the model's, or float8 e4m3: the ops convert on store and load); num_blocks=0: drop them, to
        measure memory without them."""
        for layer in self.model.layers:
            attn = layer.self_attn
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = ops.kv_pool(*shape, dtype, device) if num_blocks else torch.empty(0)
            attn.v_cache = ops.kv_pool(*shape, dtype, device) if num_blocks else torch.empty(0)

    def fold_norms(self) -> None:
        """After loading, LlamaDecoderLayer.fold_norms in every layer, where forward_stream can then run: one rank, no
        biases, and bfloat16 or float32 weights. A step of more rows than our decode kernels take then runs no norm
        kernel in the layers. (In float16 the products of the unnormalized stream, up to its rms times larger than
        the normalized one's, would come nearer the format's 65,504 ceiling; bfloat16 has float32's range.)"""
        layers = self.model.layers
        linears = (layers[0].self_attn.qkv_proj, layers[0].self_attn.o_proj, layers[0].mlp.gate_up_proj,
                   layers[0].mlp.down_proj)
        if (self.tp.size > 1 or any(linear.bias is not None for linear in linears)
                or linears[0].weight.dtype == torch.float16):
            return
        for layer in layers:
            layer.fold_norms()
        self.model.norms_folded = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for every token of the flat batch."""
        return self.model(input_ids, positions, self.cos_sin_cache, meta)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row's logits (int64 [rows]) from the fused LM-head kernel, which writes no logits;
        None where it does not apply (the CPU, more rows than its crossover, a vocabulary split over ranks): then
        the caller computes the logits."""
        if self.tp.size > 1 or not ops.use_decode_kernel("lm_head", hidden):
            return None
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return ops.linear_argmax(hidden, weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab_size] for the rows given (only the positions that get sampled), in the model's
        dtype: the sampling kernel and argmax read them as they are (no float32 copy of the rows x 128k
        vocabulary). Split over ranks, every rank must call it; rank 0 gets the logits, the others None."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.matmul(hidden, weight.t())
        if self.tp.size > 1:
            logits = gather_last_dim(logits, self.tp)
            if logits is None:
                return None
            return logits[:, : self.config.vocab_size].contiguous()  # the padding is never sampled
        return logits
