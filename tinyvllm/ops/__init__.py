"""The engine's non-matmul ops, and decode-sized matrix products with the ops around them fused (fused_linear.py,
gemv.py; linear.py holds the tiling and split-K rules they share; fp8.py: products of float8 weights with a scale
per output channel, fp8_linear at any size, the decode kernels through their weight_scale). Each op has a
plain-PyTorch reference (`*_ref`) and, where Triton is available, a Triton kernel (`*_triton`) with the same
signature. The names exported here pick the Triton kernel for CUDA tensors and the reference otherwise; the test hook
TINYVLLM_REFERENCE_OPS=1 forces the references everywhere (to check the kernels against them on a GPU).
token_logprobs (logprobs.py): per row of logits, a token's logprob and rank and the top k, reading the logits once.
use_decode_kernel says when the model runs a product on the fused kernels instead of cuBLAS. kv_pool allocates a
layer's K or V pool, head-major."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import torch

from tinyvllm.ops.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from tinyvllm.ops.attention import AttentionMetadata, paged_attention_ref
from tinyvllm.ops.bitmask import apply_token_bitmask_ref
from tinyvllm.ops.cascade_attention import cascade_attention_ref, window_allows_cascade
from tinyvllm.ops.decode_inputs import unpack_decode_inputs_ref
from tinyvllm.ops.embedding import embedding_ref
from tinyvllm.ops.fp8 import fp8_linear_ref, per_channel_scale, quantize_fp8_per_token, quantize_fp8_weight
from tinyvllm.ops.fused_linear import fused_linear_ref, fused_norm_linear_ref, linear_argmax_ref
from tinyvllm.ops.layernorm import RowNorm, fused_add_rms_norm_ref, rms_norm_ref
from tinyvllm.ops.logprobs import token_logprobs_ref
from tinyvllm.ops.rotary import RopeStore, build_cos_sin_cache, rope_store_ref
from tinyvllm.ops.sampling import sample_ref
from tinyvllm.ops.triton_import import triton

__all__ = [
    "AttentionMetadata",
    "apply_token_bitmask",
    "RopeStore",
    "RowNorm",
    "build_cos_sin_cache",
    "embedding",
    "fp8_linear",
    "fused_linear",
    "fused_norm_linear",
    "linear_argmax",
    "use_decode_kernel",
    "decode_kernel_on",
    "DECODE_KERNEL_MAX_ROWS",
    "rms_norm",
    "fused_add_rms_norm",
    "rope_store",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "paged_attention",
    "per_channel_scale",
    "kv_pool",
    "quantize_fp8_per_token",
    "quantize_fp8_weight",
    "sample",
    "token_logprobs",
    "triton_available",
    "unpack_decode_inputs",
]

_FORCE_REFERENCE = os.environ.get("TINYVLLM_REFERENCE_OPS", "0") == "1"

# Each product runs on our decode kernels (fused_linear.py) for up to this many rows (tokens), on cuBLAS above:
# the crossovers that benchmarks/bench_fused.py measures against what the model runs otherwise
# (cuBLAS with the separate norm and SiLU kernels); figures in benchmarks/RESULTS.md. 0: never.
#   qkv:     RMSNorm (input_layernorm, with the residual add) + the QKV product (+ RoPE and the KV store, on the GEMV)
#   o:       the attention output projection
#   gate_up: RMSNorm (post_attention_layernorm, with the residual add) + gate/up + SiLU·mul
#   down:    the MLP's down projection
#   lm_head: the LM head with greedy argmax, for steps that sample greedily and need no logits
# The layers' products run on the GEMV of gemv.py (output-major weights, fetched before the kernel before them ends)
# at one row, where it beats cuBLAS with the separate norm and SiLU kernels; above it a step's products all run on
# cuBLAS, which lets the folded norms run no norm kernel (forward_stream). The LM head's argmax kernel wins up to
# 64 rows.
DECODE_KERNEL_MAX_ROWS: dict[str, int] = {"qkv": 1, "o": 1, "gate_up": 1, "down": 1, "lm_head": 64}


def triton_available() -> bool:
    """True when the Triton kernels can run on this machine's GPU."""
    return not _FORCE_REFERENCE and torch.cuda.is_available() and triton is not None


def _triton_kernels() -> dict[str, Callable[..., Any]]:
    """The Triton implementations, imported only when a GPU will run them."""
    if not triton_available():
        return {}
    try:
        from tinyvllm.ops import triton_kernels
        from tinyvllm.ops.fp8 import fp8_linear_cuda, quantize_fp8_per_token_triton
        from tinyvllm.ops.fused_linear import fused_linear_triton, fused_norm_linear_triton, linear_argmax_triton
    except ImportError:
        return {}
    return {**triton_kernels.KERNELS, "fused_linear": fused_linear_triton,
            "fused_norm_linear": fused_norm_linear_triton, "linear_argmax": linear_argmax_triton,
            "fp8_linear": fp8_linear_cuda, "quantize_fp8_per_token": quantize_fp8_per_token_triton}


_TRITON = _triton_kernels()


def _dispatch(name: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    kernel = _TRITON.get(name)
    if kernel is None:
        return reference

    def op(first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (kernel if first.is_cuda else reference)(first, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = reference.__doc__
    return op


def decode_kernel_on(product: str, device: torch.device) -> bool:
    """Whether `product` (a key of DECODE_KERNEL_MAX_ROWS) runs on the fused decode kernels at some row counts on
    `device`: on CUDA with Triton, and a crossover above 0. The loader then keeps its weight output-major, the
    layout of the GEMV (gemv.py) that takes the fewest rows."""
    return device.type == "cuda" and "fused_linear" in _TRITON and DECODE_KERNEL_MAX_ROWS[product] > 0


def use_decode_kernel(product: str, x: torch.Tensor) -> bool:
    """Whether `product` on the input x [tokens, K] runs on the fused decode kernels: decode_kernel_on, up to the
    product's crossover. The model asks only where the weights are whole (tensor parallel size 1) and there is
    no bias; CUDA graphs capture the answer of each batch size."""
    return decode_kernel_on(product, x.device) and x.shape[0] <= DECODE_KERNEL_MAX_ROWS[product]


apply_token_bitmask = _dispatch("apply_token_bitmask", apply_token_bitmask_ref)
embedding = _dispatch("embedding", embedding_ref)
fp8_linear = _dispatch("fp8_linear", fp8_linear_ref)
fused_linear = _dispatch("fused_linear", fused_linear_ref)
fused_norm_linear = _dispatch("fused_norm_linear", fused_norm_linear_ref)
linear_argmax = _dispatch("linear_argmax", linear_argmax_ref)
rms_norm = _dispatch("rms_norm", rms_norm_ref)
fused_add_rms_norm = _dispatch("fused_add_rms_norm", fused_add_rms_norm_ref)
quantize_fp8_per_token = _dispatch("quantize_fp8_per_token", quantize_fp8_per_token)
rope_store = _dispatch("rope_store", rope_store_ref)
silu_and_mul = _dispatch("silu_and_mul", silu_and_mul_ref)
gelu_tanh_and_mul = _dispatch("gelu_tanh_and_mul", gelu_tanh_and_mul_ref)
_plain_attention = _dispatch("paged_attention", paged_attention_ref)
_cascade_attention = _dispatch("cascade_attention", cascade_attention_ref)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor | None = None, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None) -> torch.Tensor:
    """Attention over the paged cache (paged_attention_ref's contract, its sliding_window and logit_softcap
    included), into `out` if given; a decode step whose sequences share a prefix of blocks (meta.common_prefix_len)
    goes through cascade attention, which reads that prefix once, unless a sliding window could hide part of it
    from some query (window_allows_cascade): then through the plain kernels."""
    if meta.common_prefix_len is not None and meta.is_decode and window_allows_cascade(meta.max_context_len,
                                                                                       sliding_window):
        return _cascade_attention(q, k_cache, v_cache, meta, scale, out=out, logit_softcap=logit_softcap)
    return _plain_attention(q, k_cache, v_cache, meta, scale, out=out, sliding_window=sliding_window,
                            logit_softcap=logit_softcap)


def kv_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A zeroed K or V pool, [num_blocks, block_size, num_kv_heads, head_dim] as every op indexes it, stored
    [num_blocks, num_kv_heads, block_size, head_dim] in memory (the ops address it through its strides): each head's
    block is one run of bytes, where token-major it would be block_size rows of one head_dim each (64 bytes in
    float8 at head_dim 64), num_kv_heads rows apart; decode attention reads the runs faster."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if torch.device(device).type == "cpu":
        # Anonymous memory: zero pages that the OS backs as they are first written (calloc's way), so that the
        # process holds the tokens cached, not the whole pool. The tensor keeps the mapping alive.
        size = num_blocks * num_kv_heads * block_size * head_dim * dtype.itemsize
        return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape).transpose(1, 2)
    return torch.zeros(shape, dtype=dtype, device=device).transpose(1, 2)


sample = _dispatch("sample", sample_ref)
token_logprobs = _dispatch("token_logprobs", token_logprobs_ref)
unpack_decode_inputs = _dispatch("unpack_decode_inputs", unpack_decode_inputs_ref)
