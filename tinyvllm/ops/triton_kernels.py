"""The Triton implementation of every op, by the names tinyvllm.ops dispatches on. Imported only where
Triton and a GPU are present (tinyvllm/ops/__init__.py); each wrapper has its reference's signature."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton  # noqa: F401  (fail here, not at the first call, where Triton is missing)

from tinyvllm.ops.activation import gelu_tanh_and_mul_triton, silu_and_mul_triton
from tinyvllm.ops.attention import paged_attention_triton
from tinyvllm.ops.bitmask import apply_token_bitmask_triton
from tinyvllm.ops.cascade_attention import cascade_attention_triton
from tinyvllm.ops.decode_inputs import unpack_decode_inputs_triton
from tinyvllm.ops.embedding import embedding_triton
from tinyvllm.ops.layernorm import fused_add_rms_norm_triton, rms_norm_triton
from tinyvllm.ops.logprobs import token_logprobs_triton
from tinyvllm.ops.rotary import rope_store_triton
from tinyvllm.ops.sampling import sample_triton

KERNELS: dict[str, Callable[..., Any]] = {
    "apply_token_bitmask": apply_token_bitmask_triton,
    "embedding": embedding_triton,
    "rms_norm": rms_norm_triton,
    "fused_add_rms_norm": fused_add_rms_norm_triton,
    "rope_store": rope_store_triton,
    "silu_and_mul": silu_and_mul_triton,
    "gelu_tanh_and_mul": gelu_tanh_and_mul_triton,
    "paged_attention": paged_attention_triton,
    "cascade_attention": cascade_attention_triton,
    "sample": sample_triton,
    "token_logprobs": token_logprobs_triton,
    "unpack_decode_inputs": unpack_decode_inputs_triton,
}
