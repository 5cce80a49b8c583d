"""tinyvllm's memory-bound kernels on the GPU at >= 64 MB, each beside its torch reference in the same run: RMSNorm,
fused add + RMSNorm (tinyvllm/ops/layernorm.py), RoPE fused with the KV-cache store (ops/rotary.py) and SiLU-and-mul
(ops/activation.py), in GB/s of the bytes each op must move, against the reference and the device-to-device copy
ceiling measured here (what the bytes alone cost).

    python benchmarks/bench_elementwise.py [--quick] [--sweep [--sweep-only]]

--sweep also times RMSNorm's rows per program and warps (rms_norm_config's alternatives), alone and fused with the
residual add, beside a copy kernel with the same grid and tiles; --sweep-only runs that sweep alone.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from kernels_common import (
    BLOCK_SIZE,
    DEVICE,
    DTYPE,
    HEAD_DIM,
    HIDDEN,
    INTERMEDIATE,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    Table,
    bench,
    copy_ceiling,
    kernel_parser,
    parse_on_gpu,
)

from tinyvllm.ops.activation import silu_and_mul_ref, silu_and_mul_triton
from tinyvllm.ops.layernorm import (
    _launch_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_config,
    rms_norm_ref,
    rms_norm_triton,
)
from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.rotary import build_cos_sin_cache, rotary_embedding_and_store_ref, rotary_embedding_and_store_triton

ELEMENTWISE_TOKENS = 16384  # 16384 x 2048 bf16 = 64 MiB per activation


def bench_elementwise(table: Table, ceiling: float) -> None:
    tokens = ELEMENTWISE_TOKENS
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device=DEVICE, dtype=DTYPE)
    size = x.numel() * x.element_size()

    def add(case: str, nbytes: int, ours: Callable, ref: Callable) -> None:
        table.add(f"{case} ({nbytes / 2**20:.0f} MiB moved)", nbytes / bench(ours) / 1e6, "torch reference",
                  nbytes / bench(ref) / 1e6, ceiling)

    add(f"rms_norm {tokens}x{HIDDEN}", 2 * size, lambda: rms_norm_triton(x, weight, 1e-5),
        lambda: rms_norm_ref(x, weight, 1e-5))
    add(f"fused_add_rms_norm {tokens}x{HIDDEN}", 4 * size, lambda: fused_add_rms_norm_triton(x, residual, weight, 1e-5),
        lambda: fused_add_rms_norm_ref(x, residual, weight, 1e-5))

    # RoPE fused with the KV-cache store, as the model runs it: q rotated in place, the rotated k and v to their
    # cache slots (each token its own slot)
    qkv = torch.randn(tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE, dtype=DTYPE)
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in qkv.split(
        [NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=1))
    k_cache, v_cache = (torch.empty(tokens // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE,
                                    dtype=DTYPE) for _ in range(2))
    slots = torch.randperm(tokens, device=DEVICE)
    cache = build_cos_sin_cache(HEAD_DIM, 131072, 500000.0, None, DEVICE)
    positions = torch.randint(0, 131072, (tokens,), device=DEVICE)
    rope_bytes = (2 * q.numel() + 2 * k.numel() + 2 * v.numel()) * 2 + tokens * HEAD_DIM * 4 + tokens * 8 * 2
    add(f"rotary + kv store q {tokens}x{NUM_Q_HEADS}x{HEAD_DIM}, k v {tokens}x{NUM_KV_HEADS}x{HEAD_DIM}", rope_bytes,
        lambda: rotary_embedding_and_store_triton(positions, q, k, v, cache, k_cache, v_cache, slots),
        lambda: rotary_embedding_and_store_ref(positions, q, k, v, cache, k_cache, v_cache, slots))

    gate_up = torch.randn(tokens // 4, 2 * INTERMEDIATE, device=DEVICE, dtype=DTYPE)
    silu_bytes = gate_up.numel() * 2 * 3 // 2
    add(f"silu_and_mul {gate_up.shape[0]}x{gate_up.shape[1]}", silu_bytes, lambda: silu_and_mul_triton(gate_up),
        lambda: silu_and_mul_ref(gate_up))


@triton.jit
def _copy_rows_kernel(out_ptr, x_ptr, num_rows, hidden, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """RMSNorm's memory traffic without its arithmetic (same grid, tiles and launch): what the shape costs."""
    pdl_wait(USE_PDL)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < hidden)
    tl.store(out_ptr + rows * hidden + cols, tl.load(x_ptr + rows * hidden + cols, mask=mask), mask=mask)


def sweep_rms_norm() -> None:
    """GB/s of RMSNorm (alone and fused with the residual add) by rows per program and warps, beside a
    copy with the same grid and tiles, at ELEMENTWISE_TOKENS x HIDDEN and 4x that."""
    for tokens in (ELEMENTWISE_TOKENS, 4 * ELEMENTWISE_TOKENS):
        _sweep_rms_norm_at(tokens)


def _sweep_rms_norm_at(tokens: int) -> None:
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=DTYPE)
    residual, out = torch.randn_like(x), torch.empty_like(x)
    weight = torch.randn(HIDDEN, device=DEVICE, dtype=DTYPE)
    size = x.numel() * x.element_size()
    print(f"\n## RMSNorm {tokens}x{HIDDEN} configs (rows per program, warps): GB/s alone / fused add / "
          f"copy-only kernel; default {rms_norm_config(tokens, HIDDEN)}")
    for config in itertools.product((1, 2, 4), (2, 4, 8, 16)):
        alone = 2 * size / bench(lambda c=config: _launch_rms_norm(x, None, weight, 1e-5, c)) / 1e6
        fused = 4 * size / bench(lambda c=config: _launch_rms_norm(x, residual, weight, 1e-5, c)) / 1e6
        copy = 2 * size / bench(lambda r=config[0], w=config[1]: _copy_rows_kernel[(triton.cdiv(tokens, r),)](
            out, x, tokens, HIDDEN, ROWS=r, BLOCK=HIDDEN, num_warps=w, **pdl_options(x))) / 1e6
        print(f"  {config}: {alone:.0f} / {fused:.0f} / {copy:.0f}", flush=True)


def main() -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time RMSNorm's alternative launch configs")
    parser.add_argument("--sweep-only", action="store_true", help="with --sweep: skip the table")
    args = parse_on_gpu(parser)
    if args.sweep and args.sweep_only:
        sweep_rms_norm()
        return 0
    ceiling = copy_ceiling()
    elementwise = Table("Elementwise ops, bf16 (GB/s of the bytes each op must move)", "GB/s")
    bench_elementwise(elementwise, ceiling)
    print(f"\ncopy ceiling: {ceiling:.0f} GB/s")
    elementwise.print()
    if args.sweep:
        sweep_rms_norm()
    return 0


if __name__ == "__main__":
    sys.exit(main())
