"""The engine's non-matmul ops, and decode-sized matrix products with the ops around them fused (fused_linear.py;
linear.py: the plain skinny matmul it grew from, measured in benchmarks/RESULTS.md). Each op has a
plain-PyTorch reference (`*_ref`) and, where Triton is available, a Triton kernel (`*_triton`) with the
same signature. The names exported here pick the Triton kernel for CUDA tensors and the reference
otherwise; TINYVLLM_REFERENCE_OPS=1 forces the references everywhere (to check the kernels against them
on a GPU). use_decode_kernel says when the model runs a product on the fused kernels instead of cuBLAS;
TINYVLLM_SKINNY=0 turns them off. kv_pool allocates a layer's K or V pool, head-major
(TINYVLLM_KV_HEAD_MAJOR=0: token-major)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from tinyvllm.ops.activation import silu_and_mul_ref
from tinyvllm.ops.attention import AttentionMetadata, paged_attention_ref
from tinyvllm.ops.cascade_attention import cascade_attention_ref
from tinyvllm.ops.decode_inputs import unpack_decode_inputs_ref
from tinyvllm.ops.embedding import embedding_ref
from tinyvllm.ops.fused_linear import fused_linear_ref, fused_norm_linear_ref, linear_argmax_ref
from tinyvllm.ops.layernorm import RowNorm, fused_add_rms_norm_ref, rms_norm_ref
from tinyvllm.ops.linear import skinny_matmul_ref
from tinyvllm.ops.rotary import RopeStore, build_cos_sin_cache, rope_store_ref
from tinyvllm.ops.sampling import sample_ref

__all__ = [
    "AttentionMetadata",
    "RopeStore",
    "RowNorm",
    "build_cos_sin_cache",
    "embedding",
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
    "skinny_matmul",
    "paged_attention",
    "kv_pool",
    "sample",
    "triton_available",
    "unpack_decode_inputs",
]

_FORCE_REFERENCE = os.environ.get("TINYVLLM_REFERENCE_OPS", "0") == "1"
_DECODE_KERNELS_OFF = os.environ.get("TINYVLLM_SKINNY", "1") == "0"
_KV_HEAD_MAJOR = os.environ.get("TINYVLLM_KV_HEAD_MAJOR", "1") == "1"

# Each product runs on our decode kernels (fused_linear.py) for up to this many rows (tokens), on cuBLAS above:
# the crossovers that benchmarks/bench_kernels.py --fused measures against what the model runs otherwise
# (cuBLAS with the separate norm and SiLU kernels); figures in benchmarks/RESULTS.md. 0: never.
#   qkv:     RMSNorm (input_layernorm, with the residual add) + the QKV product (+ RoPE and the KV store, on the GEMV)
#   o:       the attention output projection
#   gate_up: RMSNorm (post_attention_layernorm, with the residual add) + gate/up + SiLU·mul
#   down:    the MLP's down projection
#   lm_head: the LM head with greedy argmax, for steps that sample greedily and need no logits
# The layers' products run on the GEMV of gemv.py (output-major weights, fetched before the kernel before them ends)
# where it beat cuBLAS with the separate norm and SiLU kernels: at one row (the tiled kernels of fused_linear.py lost
# at every M they were measured at). o's GEMV had also won at 4 rows against cuBLAS and a separate residual add, but a
# step with any product on our kernels runs the norm kernels (forward_stream needs every product on cuBLAS, where
# o_proj adds the residual itself), and the whole step at 4 rows was faster with o on cuBLAS.
# The LM head's argmax kernel wins up to 64 rows. TINYVLLM_DECODE_KERNEL_ROWS overrides entries, to measure another
# crossover.
DECODE_KERNEL_MAX_ROWS: dict[str, int] = {"qkv": 1, "o": 1, "gate_up": 1, "down": 1, "lm_head": 64}


def _override_decode_kernel_rows(table: dict[str, int], spec: str) -> dict[str, int]:
    """TINYVLLM_DECODE_KERNEL_ROWS="qkv=8,o=8" sets entries of the table (to measure a crossover end to end)."""
    table = dict(table)
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rows = item.partition("=")
        if name not in table or not rows.isdigit():
            raise ValueError(f"TINYVLLM_DECODE_KERNEL_ROWS: {item!r} is not <product>=<rows> with a product of "
                             f"{sorted(table)}")
        table[name] = int(rows)
    return table


DECODE_KERNEL_MAX_ROWS = _override_decode_kernel_rows(DECODE_KERNEL_MAX_ROWS,
                                                      os.environ.get("TINYVLLM_DECODE_KERNEL_ROWS", ""))


def triton_available() -> bool:
    """True when the Triton kernels can run on this machine's GPU."""
    if _FORCE_REFERENCE or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_kernels() -> dict[str, Callable[..., Any]]:
    """The Triton implementations, imported only when a GPU will run them."""
    if not triton_available():
        return {}
    try:
        from tinyvllm.ops import triton_kernels
        from tinyvllm.ops.fused_linear import fused_linear_triton, fused_norm_linear_triton, linear_argmax_triton
        from tinyvllm.ops.linear import skinny_matmul_triton
    except ImportError:
        return {}
    return {**triton_kernels.KERNELS, "skinny_matmul": skinny_matmul_triton, "fused_linear": fused_linear_triton,
            "fused_norm_linear": fused_norm_linear_triton, "linear_argmax": linear_argmax_triton}


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
    return (device.type == "cuda" and not _DECODE_KERNELS_OFF and "fused_linear" in _TRITON
            and DECODE_KERNEL_MAX_ROWS[product] > 0)


def use_decode_kernel(product: str, x: torch.Tensor) -> bool:
    """Whether `product` on the input x [tokens, K] runs on the fused decode kernels: decode_kernel_on, up to the
    product's crossover. The model asks only where the weights are whole (tensor parallel size 1) and there is
    no bias; CUDA graphs capture the answer of each batch size."""
    return decode_kernel_on(product, x.device) and x.shape[0] <= DECODE_KERNEL_MAX_ROWS[product]


embedding = _dispatch("embedding", embedding_ref)
fused_linear = _dispatch("fused_linear", fused_linear_ref)
fused_norm_linear = _dispatch("fused_norm_linear", fused_norm_linear_ref)
linear_argmax = _dispatch("linear_argmax", linear_argmax_ref)
rms_norm = _dispatch("rms_norm", rms_norm_ref)
fused_add_rms_norm = _dispatch("fused_add_rms_norm", fused_add_rms_norm_ref)
rope_store = _dispatch("rope_store", rope_store_ref)
silu_and_mul = _dispatch("silu_and_mul", silu_and_mul_ref)
skinny_matmul = _dispatch("skinny_matmul", skinny_matmul_ref)
_plain_attention = _dispatch("paged_attention", paged_attention_ref)
_cascade_attention = _dispatch("cascade_attention", cascade_attention_ref)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the paged cache (paged_attention_ref's contract), into `out` if given; a decode step whose
    sequences share a prefix of blocks (meta.common_prefix_len) goes through cascade attention, which reads that
    prefix once."""
    if meta.common_prefix_len is not None and meta.is_decode:
        return _cascade_attention(q, k_cache, v_cache, meta, scale, out=out)
    return _plain_attention(q, k_cache, v_cache, meta, scale, out=out)


def kv_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A zeroed K or V pool, [num_blocks, block_size, num_kv_heads, head_dim] as every op indexes it, stored
    [num_blocks, num_kv_heads, block_size, head_dim] in memory (the ops address it through its strides): each head's
    block is one run of bytes, where token-major it would be block_size rows of one head_dim each (64 bytes in
    float8 at head_dim 64), num_kv_heads rows apart; decode attention reads the runs faster (benchmarks/RESULTS.md).
    TINYVLLM_KV_HEAD_MAJOR=0 stores it token-major, to compare."""
    if not _KV_HEAD_MAJOR:
        return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device).transpose(1, 2)


sample = _dispatch("sample", sample_ref)
unpack_decode_inputs = _dispatch("unpack_decode_inputs", unpack_decode_inputs_ref)
