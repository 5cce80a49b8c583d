"""The attention, sampling, decode-input and GEMV kernels compile for Hopper (sm_90) with Triton's own compiler, which
needs no GPU, in a process without the interpreter: the interpreter runs kernels as Python, so what only the
compiler refuses (a branch that is not static, mismatched types between branches, a shape it cannot lay out) would
first show on the device. The arguments carry the alignment the JIT finds at the engine's launches, so the code
compiled is the code that runs. Each compiled kernel must wait for the kernel before it (programmatic dependent
launch); decode attention must prefetch its first keys into L2 before that wait, and copy its K and V tiles in
16-byte pieces (without the alignment it would load a float8 tile a byte at a time)."""

from __future__ import annotations

from tests.utils import compile_for_hopper
from tinyvllm.ops.fp8 import MIN_TOKEN_SCALE

# Prints "compiled N". Arguments: (module, kernel, constexprs, pointer types, num_warps) per kernel; pointers not
# named are bf16, qk_scale is a float, every other argument an int32.
COMPILE_FOR_HOPPER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

count = 0
for module, name, constants, pointers, num_warps in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    signature, attrs = {}, {}
    for index, param in enumerate(kernel.params):
        arg = param.name
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = pointers.get(arg, "*bf16")
        else:
            signature[arg] = "fp32" if arg in ("qk_scale", "eps") else "i32"
        # As the JIT specializes the engine's launches: tensors 16-byte aligned, strides (and a product's N, K and
        # split) multiples of 16.
        aligned = arg.endswith("_ptr") or arg.startswith("stride") or arg in ("N", "K", "k_per_split")
        if aligned and arg not in constants and not param.do_not_specialize:
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 3})
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx or "USE_PDL" not in constants, f"{name} {constants}: no PDL wait"
    if name == "_paged_decode_kernel":  # its first keys are asked of L2 while the kernel before finishes
        assert -1 < ptx.find("prefetch.global.L2") < ptx.index("griddepcontrol.wait"), f"{constants}: no prefetch"
    if pointers.get("w_ptr") == "*fp8e4nv":  # (a float8 weight tile loaded a byte at a time halves the bandwidth)
        assert "ld.global.b8" not in ptx, f"{name} {constants}: a float8 tile loaded a byte at a time"
    if pointers.get("v_cache_ptr") == "*fp8e4nv":  # (attention._values_as: else sm_90 reads V a byte at a time)
        assert "ld.shared.b8" not in ptx, f"{name}: a float8 tile read from shared memory a byte at a time"
    if name == "_paged_decode_kernel":  # K and V tiles in 16-byte asynchronous copies, never element by element
        assert "cp.async.cg.shared.global" in ptx and "ld.global.b8" not in ptx and "ld.global.b16" not in ptx, \
            f"{constants} {pointers.get('k_cache_ptr', '*bf16')}: K/V tiles not copied in 16-byte pieces"
    count += 1
print("compiled", count)
"""
_ATTENTION = "tinyvllm.ops.attention"
_PARTIALS = {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "block_tables_ptr": "*i32",
             "cu_query_lens_ptr": "*i32", "context_lens_ptr": "*i32", "prefix_len_ptr": "*i32"}
_SAMPLING = {"value_ptr": "*fp32", "index_ptr": "*i32", "cutoff_ptr": "*fp32", "temperature_ptr": "*fp32",
             "min_p_ptr": "*fp32", "seeds_ptr": "*i64"}
_ROPE = {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64"}
# SLIDING_WINDOW and SOFTCAP off (0: Llama's layers) unless a case turns them on (Mistral's window, Gemma 2's cap)
_OFF = dict(SLIDING_WINDOW=0, SOFTCAP=0.0)
_WINDOW_SOFTCAP = dict(SLIDING_WINDOW=4096, SOFTCAP=50.0 * 1.4426950408889634)
_DECODE = dict(GROUP=4, BLOCK_G=16, BLOCK_N=64, BLOCK_SIZE=16, HEAD_DIM=64, USE_PDL=True, **_OFF)
# kv_cache_dtype="fp8": the caches in float8 e4m3 (Triton's fp8e4nv, which needs sm_89+), every other pointer as above
_FP8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
_PREFILL = dict(GROUP=4, BLOCK_M=128, BLOCK_N=64, BLOCK_SIZE=16, HEAD_DIM=64, USE_PDL=True, **_OFF)
_CASCADE_PREFIX = dict(GROUP=4, BLOCK_M=64, BLOCK_N=64, BLOCK_SIZE=16, HEAD_DIM=64, USE_PDL=True, SOFTCAP=0.0)


def _gemv(block_n: int, block_k: int, norm: bool, silu: bool, rope: bool) -> dict:
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, HAS_RESIDUAL=norm, SILU_MUL=silu, ROPE=rope, HALF=32,
                EVEN_K=True, W_SCALED=False, USE_PDL=True)


CASES = [
    # Every kernel that reads or writes the KV cache also with a float8 cache (_FP8): decode (one split, several,
    # the cascade suffix pass), the cascade prefix pass, prefill, and the stores (rotary.py's kernel, the qkv GEMV).
    # (MERGE_PREFIX: cascade's suffix pass in one piece, merging the prefix's; a float8 cache at large batches reads
    # 128 keys per step: attention.decode_config; a float8 cache's programs take 4 query rows: attention.decode_rows)
    *[(_ATTENTION, "_paged_decode_kernel", {**_DECODE, "BLOCK_G": 4 if caches else 16, "SINGLE_SPLIT": single,
                                            "SKIP_PREFIX": skip, "MERGE_PREFIX": merge}, {**_PARTIALS, **caches}, 4)
      for caches in ({}, _FP8)
      for single, skip, merge in ((True, False, False), (False, False, False), (False, True, False),
                                  (False, True, True))],
    (_ATTENTION, "_paged_decode_kernel", {**_DECODE, "BLOCK_G": 4, "BLOCK_N": 128, "SINGLE_SPLIT": True,
                                          "SKIP_PREFIX": False, "MERGE_PREFIX": False}, {**_PARTIALS, **_FP8}, 4),
    *[("tinyvllm.ops.cascade_attention", "_cascade_prefix_kernel", _CASCADE_PREFIX, {**_PARTIALS, **caches}, 4)
      for caches in ({}, _FP8)],
    *[(_ATTENTION, "_combine_splits_kernel", dict(HEADS=heads, BLOCK_SPLITS=64, BLOCK_N=64, HEAD_DIM=64,
                                                   CASCADE=cascade, SLIDING_WINDOW=0, USE_PDL=True), _PARTIALS, warps)
      for heads, warps in ((1, 1), (16, 4)) for cascade in (False, True)],
    # A sliding window and logit soft-capping: decode in one split and several, its combine, prefill (both
    # caches), cascade's prefix pass and merging suffix pass with the cap (cascade takes no window)
    *[(_ATTENTION, "_paged_decode_kernel", {**_DECODE, **_WINDOW_SOFTCAP, "SINGLE_SPLIT": single, "SKIP_PREFIX": False,
                                            "MERGE_PREFIX": False}, _PARTIALS, 4) for single in (True, False)],
    (_ATTENTION, "_combine_splits_kernel", dict(HEADS=16, BLOCK_SPLITS=64, BLOCK_N=64, HEAD_DIM=64, CASCADE=False,
                                                SLIDING_WINDOW=4096, USE_PDL=True), _PARTIALS, 4),
    *[(_ATTENTION, "_paged_prefill_kernel", {**_PREFILL, **_WINDOW_SOFTCAP}, {**_PARTIALS, **caches}, 8)
      for caches in ({}, _FP8)],
    ("tinyvllm.ops.cascade_attention", "_cascade_prefix_kernel",
     {**_CASCADE_PREFIX, "SOFTCAP": _WINDOW_SOFTCAP["SOFTCAP"]}, _PARTIALS, 4),
    (_ATTENTION, "_paged_decode_kernel", {**_DECODE, "SOFTCAP": _WINDOW_SOFTCAP["SOFTCAP"], "SINGLE_SPLIT": False,
                                          "SKIP_PREFIX": True, "MERGE_PREFIX": True}, _PARTIALS, 4),
    ("tinyvllm.ops.sampling", "_sample_chunk_kernel",
     dict(HAS_CUTOFF=True, DEFER_MIN_P=True, ROWS=1, BLOCK=2048, FAST_LOG=True, USE_PDL=True), _SAMPLING, 8),
    ("tinyvllm.ops.sampling", "_min_p_race_kernel",
     dict(HAS_CUTOFF=False, ROWS=1, BLOCK=2048, CHUNKS=64, FAST_LOG=True, USE_PDL=True), _SAMPLING, 8),
    ("tinyvllm.ops.decode_inputs", "_unpack_decode_inputs_kernel", dict(BLOCK=256, USE_PDL=True),
     {"input_ids_ptr": "*i64", "pending_ptr": "*i64", "tokens_ptr": "*i64", "packed_ptr": "*i32",
      "width_ptr": "*i32", "tables_ptr": "*i32"}, 1),
    # The GEMV at the 1B's shapes: qkv with the norm and RoPE + KV store (K 2048, 2 pairs of rows) and without it,
    # gate_up with the norm and SiLU·mul, down (K 8192, 1 row): 16 KB of weights per program.
    *[("tinyvllm.ops.gemv", "_gemv_kernel", _gemv(block_n, block_k, norm, silu, rope), _ROPE, 4)
      for block_n, block_k, norm, silu, rope in ((2, 2048, True, False, True), (4, 2048, True, False, False),
                                                 (2, 2048, True, True, False), (1, 8192, False, False, False))],
    (_ATTENTION, "_paged_prefill_kernel", _PREFILL, {**_PARTIALS, **_FP8}, 8),
    # RoPE + KV store and SiLU·mul, each with and without a folded norm (NORM: the stream row's 1/rms)
    *[("tinyvllm.ops.rotary", "_rotary_and_store_kernel",
       dict(HALF=32, BLOCK_Q_HEADS=32, BLOCK_KV_HEADS=8, NORM=norm, BLOCK_HIDDEN=2048 if norm else 1, USE_PDL=True),
       {"positions_ptr": "*i64", "cache_ptr": "*fp32", "slot_mapping_ptr": "*i64", **caches}, 4)
      for norm in (False, True) for caches in ({}, _FP8)],
    *[("tinyvllm.ops.activation", "_gated_mul_kernel",
       dict(BLOCK=4096 if norm else 1024, NORM=norm, BLOCK_HIDDEN=2048 if norm else 1, GELU=False, USE_PDL=True), {},
       8 if norm else 4) for norm in (False, True)],
    ("tinyvllm.ops.gemv", "_gemv_kernel", _gemv(2, 2048, True, False, True), {**_ROPE, **_FP8}, 4),
    ("tinyvllm.ops.activation", "_gated_mul_kernel",  # (Gemma 2's gate)
     dict(BLOCK=1024, NORM=False, BLOCK_HIDDEN=1, GELU=True, USE_PDL=True), {}, 4),
    # Prompt and sample logprobs (no PDL: it runs after the sampler's host work), with and without the running top k
    *[("tinyvllm.ops.logprobs", "_token_logprobs_kernel", dict(HAS_TOP=top, TOP=8, BLOCK=2048),
       {"targets_ptr": "*i64", "logprob_ptr": "*fp32", "rank_ptr": "*i32", "lse_ptr": "*fp32", "top_ids_ptr": "*i64",
        "top_logprobs_ptr": "*fp32"}, 8) for top in (False, True)],
]


_FUSED = dict(NORM_BLOCK=256, W_K_CONTIGUOUS=True, NORM=False, HAS_RESIDUAL=False, SILU_MUL=False, ARGMAX=False,
              W_SCALED=True, PRECISION="tf32", USE_PDL=True)
_FUSED_POINTERS = {"w_ptr": "*fp8e4nv", "partial_ptr": "*fp32", "counter_ptr": "*i32", "keys_ptr": "*i64",
                   "scale_ptr": "*fp32"}
_GEMV = dict(BLOCK_K=2048, NORM=True, HAS_RESIDUAL=True, SILU_MUL=False, ROPE=False, HALF=32, EVEN_K=True,
             W_SCALED=True, USE_PDL=True)
_GEMV_POINTERS = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
                  "slot_ptr": "*i64"}
# Float8 weights (quantization="fp8"): the per-token quantization, the GEMV and the tiled kernel reading float8 weights
# with their scales (W_SCALED), never a byte at a time
FP8_WEIGHT_CASES = [
    ("tinyvllm.ops.fp8", "_quantize_per_token_kernel", dict(BLOCK=2048, MIN_SCALE=MIN_TOKEN_SCALE, USE_PDL=True),
     {"x8_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, 4),
    # the GEMV: qkv with RoPE + KV store, gate_up with SiLU·mul, down (K 8192)
    ("tinyvllm.ops.gemv", "_gemv_kernel", {**_GEMV, "BLOCK_N": 4, "ROPE": True}, _GEMV_POINTERS, 4),
    ("tinyvllm.ops.gemv", "_gemv_kernel", {**_GEMV, "BLOCK_N": 4, "SILU_MUL": True}, _GEMV_POINTERS, 4),
    ("tinyvllm.ops.gemv", "_gemv_kernel", {**_GEMV, "BLOCK_N": 2, "BLOCK_K": 8192, "NORM": False,
                                           "HAS_RESIDUAL": False}, _GEMV_POINTERS, 4),
    # the tiled kernel: tl.dot with the norm, SiLU·mul and split K; the LM head's argmax at one row and at 64
    ("tinyvllm.ops.fused_linear", "_fused_linear_kernel",
     {**_FUSED, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "NORM": True, "HAS_RESIDUAL": True,
      "SILU_MUL": True}, _FUSED_POINTERS, 4),
    ("tinyvllm.ops.fused_linear", "_fused_linear_kernel",  # (a float32 model: the weight converted to float32)
     {**_FUSED, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "PRECISION": "ieee"},
     {**_FUSED_POINTERS, **{name: "*fp32" for name in ("y_ptr", "x_ptr", "residual_ptr", "new_residual_ptr",
                                                         "norm_weight_ptr")}}, 4),
    ("tinyvllm.ops.fused_linear", "_fused_linear_kernel",
     {**_FUSED, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "ARGMAX": True},
     {**_FUSED_POINTERS, "y_ptr": "*i64"}, 4),
    ("tinyvllm.ops.fused_linear", "_fused_linear_kernel",
     {**_FUSED, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "ARGMAX": True},
     {**_FUSED_POINTERS, "y_ptr": "*i64"}, 4),
]


def test_kernels_compile_for_hopper() -> None:
    compile_for_hopper(COMPILE_FOR_HOPPER, CASES + FP8_WEIGHT_CASES, 600)
