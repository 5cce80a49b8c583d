"""The fused decode kernels (tinyvllm/ops/fused_linear.py) on the GPU at M = 1..64 rows (--batches: other row
counts), each of the five Llama-3.2-1B products of a decode step against what the model runs without them in the
same run: qkv: fused add+RMSNorm, then cuBLAS, then RoPE and the KV-cache store; gate_up: the norm, cuBLAS,
SiLU-and-mul; o and down: cuBLAS; the LM head: cuBLAS logits, then the sampler's greedy argmax. Beside them
linear.py's plain product, for qkv and gate_up the GEMV with its RMSNorm in a kernel of its own (GemvConfig.fuse_norm),
and the copy ceiling measured here; 16 distinct weights per shape replayed in a CUDA graph, as the 16 layers run.
Ours runs on output-major weights, the layout the loader keeps for a product on the decode kernels (up to
GEMV_MAX_ROWS rows the GEMV of tinyvllm/ops/gemv.py then runs it), the peer on the cuBLAS layout.

First a bf16 check against float32 references on fresh random inputs, which sets the exit status; last, the
crossover per product (the rows ops.DECODE_KERNEL_MAX_ROWS takes).

    python benchmarks/bench_fused.py [--quick] [--batches 1,2,4,8] [--sweep]

--sweep also times the GEMV's other weight tiles, warps and register caps at M = 1.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from kernels_common import (
    BLOCK_SIZE,
    DEVICE,
    DTYPE,
    GEMV_SHAPES,
    GEMV_WEIGHTS,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    copy_ceiling,
    estimate_us,
    gemv_precompile,
    gemv_weights,
    graph_us,
    int_list,
    kernel_parser,
    parse_on_gpu,
    print_columns,
    relative_error,
    time_gemv,
)

from tinyvllm.ops.activation import silu_and_mul_triton
from tinyvllm.ops.fused_linear import (
    fused_linear_ref,
    fused_linear_triton,
    fused_norm_linear_ref,
    fused_norm_linear_triton,
    linear_argmax_triton,
)
from tinyvllm.ops.gemv import GEMV_MAX_ROWS, GemvConfig
from tinyvllm.ops.gemv import gemv_config as gemv_tile_config
from tinyvllm.ops.layernorm import fused_add_rms_norm_triton
from tinyvllm.ops.rotary import RopeStore, build_cos_sin_cache, rope_store_triton
from tinyvllm.ops.sampling import sample_triton
from tinyvllm.worker.sampler import _KERNEL_GREEDY_MAX_ROWS

FUSED_EPS = 1e-5
FUSED_BATCHES = [1, 2, 4, 8, 16, 32, 64]  # (--batches)


def fused_inputs(name: str, m: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """x [M, K] (and for the norm products the residual and the norm's weight; for qkv what its RoPE and KV-cache
    store need: positions, the cos/sin cache, K and V caches of 64 blocks, the rows' slots), as the layer passes
    them."""
    n, k = GEMV_SHAPES[name]
    inputs = {"x": torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)}
    if name in ("qkv", "gate_up"):
        inputs["residual"] = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
        inputs["norm_weight"] = 1 + 0.1 * torch.randn(k, device=DEVICE, dtype=DTYPE, generator=generator)
    if name == "qkv":
        inputs["positions"] = torch.randint(0, 4096, (m,), device=DEVICE, generator=generator)
        inputs["cos_sin"] = build_cos_sin_cache(HEAD_DIM, 4096, 500000.0, None, DEVICE)
        caches = torch.randn(2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=generator)
        inputs["k_cache"], inputs["v_cache"] = caches[0], caches[1]
        inputs["slots"] = torch.randperm(64 * BLOCK_SIZE, device=DEVICE, generator=generator)[:m]
    return inputs


def fused_rope(a: dict[str, torch.Tensor]) -> RopeStore | None:
    """qkv's RoPE and KV-cache store (fused_inputs), or None for the other products."""
    if "positions" not in a:
        return None
    return RopeStore(a["positions"], a["cos_sin"], a["k_cache"], a["v_cache"], a["slots"], NUM_Q_HEADS, NUM_KV_HEADS)


def fused_ours(name: str) -> Callable[[dict[str, torch.Tensor], torch.Tensor], object]:
    """The product as the model runs it on the fused kernels."""
    if name == "lm_head":
        return lambda a, w: linear_argmax_triton(a["x"], w)
    if name in ("qkv", "gate_up"):
        return lambda a, w: fused_norm_linear_triton(a["x"], a["residual"], a["norm_weight"], FUSED_EPS, w,
                                                     name == "gate_up", rope=fused_rope(a))
    return lambda a, w: fused_linear_triton(a["x"], w)


def fused_peer(name: str) -> Callable[[dict[str, torch.Tensor], torch.Tensor], object]:
    """The same step as the model runs it without the fused kernels: cuBLAS and our separate Triton kernels."""
    if name == "lm_head":
        greedy_rows: dict[int, tuple[torch.Tensor, ...]] = {}  # (kept, as the Sampler keeps them: not timed)

        def greedy(a: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
            logits = torch.matmul(a["x"], w.t())
            rows = logits.shape[0]
            if rows > _KERNEL_GREEDY_MAX_ROWS:
                return logits.argmax(dim=-1)
            if rows not in greedy_rows:
                zeros = torch.zeros(rows, device=DEVICE)
                index = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
                greedy_rows[rows] = (zeros, index, torch.ones_like(zeros), zeros, index)
            return sample_triton(logits, *greedy_rows[rows], False, 0, False)
        return greedy
    if name in ("qkv", "gate_up"):
        def norm_then_product(a: dict[str, torch.Tensor], w: torch.Tensor) -> object:
            normed, residual = fused_add_rms_norm_triton(a["x"], a["residual"], a["norm_weight"], FUSED_EPS)
            y = F.linear(normed, w)
            if name == "gate_up":
                return silu_and_mul_triton(y), residual
            return rope_store_triton(y, fused_rope(a)), residual
        return norm_then_product
    return lambda a, w: F.linear(a["x"], w)


def fused_check() -> bool:
    """Every product and M in bf16 against the float32 reference of the same (rounded) inputs: ||y - ref|| /
    ||ref|| (and the new residual's) beside the peer's, outputs poisoned with NaN; the LM head's tokens must have
    the reference's largest logit up to rounding. Then a CUDA graph replay, twice, bit-identical to the eager
    call (split-K counters and argmax keys are reset by the kernels)."""
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    print(f"\n## Fused decode kernels, bf16 correctness (seed {seed}): ||y - ref|| / ||ref||, ref in float32\n",
          flush=True)
    ok = True
    for name, (n, k) in GEMV_SHAPES.items():
        w = gemv_weights(name, 1, generator, output_major=True)[0]  # (the layout the loader keeps for the kernels)
        ours, peer = fused_ours(name), fused_peer(name)
        lines = []
        for m in FUSED_BATCHES:
            a = fused_inputs(name, m, generator)
            a32 = {key: t.float() for key, t in a.items()}
            with poisoned_empty():
                out = ours(a, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out_graph = ours(a, w)
            graph.replay()
            graph.replay()
            first = out[0] if isinstance(out, tuple) else out
            same = torch.equal(out_graph[0] if isinstance(out_graph, tuple) else out_graph, first)
            if name == "lm_head" and not bool(((first >= 0) & (first < n)).all()):
                good, text = False, f"M={m} tokens out of range {first.tolist()}"
            elif name == "lm_head":
                logits = a32["x"] @ w.float().t()
                row_max = logits.max(dim=1).values
                gaps = row_max - logits.gather(1, first[:, None]).squeeze(1)
                gap = float(gaps.max())
                # as tests/gpu's check: the kernel takes the max of the logits rounded to bf16, which merges values
                # within one bf16 step (8 bits) of the row's max
                step = 2.0 ** (torch.floor(torch.log2(row_max.abs())) - 7)
                good = float((gaps - step).max()) <= 1e-3 * float(logits.abs().max())
                agree = int((first == logits.argmax(dim=1)).sum())
                text = f"M={m} {agree}/{m} tokens = argmax, largest gap {gap:.1e}"
            else:
                if name in ("qkv", "gate_up"):
                    rope = fused_rope(a)
                    if rope is not None:  # (float32 caches of the reference's own)
                        rope = rope._replace(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float())
                    ref, ref_residual = fused_norm_linear_ref(a32["x"], a32["residual"], a32["norm_weight"],
                                                              FUSED_EPS, w.float(), name == "gate_up", rope=rope)
                    residual_error = relative_error(out[1], ref_residual.double())
                    if rope is not None:  # the rows the step stored, ours against the reference's
                        slots = a["slots"]
                        ours_kv = torch.stack([a["k_cache"], a["v_cache"]]).flatten(1, 2)[:, slots]
                        ref_kv = torch.stack([rope.k_cache, rope.v_cache]).flatten(1, 2)[:, slots]
                        residual_error = max(residual_error, relative_error(ours_kv, ref_kv.double()))
                    peer_out = peer(a, w)[0]
                else:
                    ref, residual_error = fused_linear_ref(a32["x"], w.float()), 0.0
                    peer_out = peer(a, w)
                error = relative_error(first, ref.double())
                peer_error = relative_error(peer_out, ref.double())
                good = math.isfinite(error) and error < 1e-2 and residual_error < 1e-2
                text = f"M={m} {error:.1e} (peer {peer_error:.1e}; residual{', KV' if name == 'qkv' else ''} " \
                       f"{residual_error:.1e})"
            good = good and same
            ok &= good
            lines.append(text + ("" if same else " NOT REPRODUCIBLE") + ("" if good else " FAIL"))
        print(f"  {name} {n}x{k}: " + "; ".join(lines), flush=True)
        del w
        torch.cuda.empty_cache()
    print(f"  => {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """torch.empty returns NaN (floats) or -1 (integers) inside: an element a kernel does not write shows."""
    real = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = real


def time_fused(name: str, fn: Callable[[dict[str, torch.Tensor], torch.Tensor], object],
               inputs: dict[str, torch.Tensor], weights: list[torch.Tensor]) -> float:
    """Microseconds per call of fn on each of the weights in turn, in a CUDA graph."""
    return graph_us(lambda: [fn(inputs, w) for w in weights], len(weights), estimate_us(name))


def bench_fused(ceiling: float) -> None:
    """Ours, the peer and linear.py's plain product per (product, M): us, GB/s of weight read, % of copy; then
    the crossover of ours against the peer."""
    results: dict[tuple[str, int], tuple[float, float]] = {}
    rows = []
    for name, (n, k) in GEMV_SHAPES.items():
        weights = gemv_weights(name, GEMV_WEIGHTS)  # the peer's: the layout the loader keeps for cuBLAS
        ours_weights = gemv_weights(name, GEMV_WEIGHTS, output_major=True)  # the decode kernels' layout
        nbytes = n * k * 2
        ours, peer = fused_ours(name), fused_peer(name)
        for m in FUSED_BATCHES:
            a = fused_inputs(name, m)
            ours_us, peer_us = time_fused(name, ours, a, ours_weights), time_fused(name, peer, a, weights)
            plain_us = time_gemv(name, weights, a["x"], None)
            apart = "-"
            if name in ("qkv", "gate_up") and m <= GEMV_MAX_ROWS:  # the GEMV with the norm as its own kernel
                silu = name == "gate_up"
                config = gemv_tile_config(n // 2 if silu else n, k, silu or name == "qkv")._replace(fuse_norm=False)

                def norm_apart(a: dict, w: torch.Tensor, silu: bool = silu, config: GemvConfig = config) -> object:
                    return fused_norm_linear_triton(a["x"], a["residual"], a["norm_weight"], FUSED_EPS, w, silu,
                                                    config, rope=fused_rope(a))
                apart = f"{time_fused(name, norm_apart, a, ours_weights):.2f}"
            results[name, m] = (ours_us, peer_us)
            gbps = [nbytes / us / 1e3 for us in (ours_us, peer_us)]
            rows.append((f"{name} {n}x{k}", str(m), f"{ours_us:.2f}", f"{gbps[0]:,.0f}",
                         f"{100 * gbps[0] / ceiling:.0f}%", f"{peer_us:.2f}", f"{gbps[1]:,.0f}",
                         f"{100 * gbps[1] / ceiling:.0f}%", f"{plain_us:.2f}", apart, f"{peer_us / ours_us:.2f}x"))
            print("  " + "  ".join(rows[-1]), flush=True)
        del weights, ours_weights
        torch.cuda.empty_cache()
    print(f"\n## Fused decode kernels vs the unfused step, bf16, {GEMV_WEIGHTS} weights per shape in a CUDA graph "
          f"(GB/s of weight read; copy ceiling {ceiling:.0f} GB/s)")
    print("peers: qkv = fused_add_rms_norm + cuBLAS + RoPE and KV store (ours: with them); "
          "gate_up = fused_add_rms_norm + cuBLAS + silu_and_mul; o, down = "
          "cuBLAS; lm_head = cuBLAS logits + the sampler's greedy argmax. linear.py: its plain product alone. "
          "norm apart: ours with the RMSNorm in layernorm.py's kernel before a plain GEMV (GemvConfig.fuse_norm)\n")
    print_columns(("product NxK", "M", "ours us", "ours GB/s", "ours of copy", "peer us", "peer GB/s", "peer of copy",
                   "linear.py us", "norm apart us", "peer/ours"), rows)
    print("\nCrossover (peer/ours > 1: ours faster), for ops.DECODE_KERNEL_MAX_ROWS:")
    for name in GEMV_SHAPES:
        slower = [m for m in FUSED_BATCHES if results[name, m][0] > results[name, m][1]]
        faster = [m for m in FUSED_BATCHES if not slower or m < slower[0]]
        print(f"  {name}: ours faster up to M={faster[-1] if faster else 0}" +
              (f"; the peer faster at M={slower}" if slower else " (every M measured)"))


def sweep_gemv_tiles(ceiling: float) -> None:
    """The GEMV (gemv.py) at M = 1 with other weight tiles per program and warps, each product as the model runs it
    (norm prologue for qkv and gate_up, RoPE and the KV store for qkv, SiLU·mul for gate_up), 16 weights per shape
    in a CUDA graph."""
    print("\n## GEMV tiles at M = 1 (us; weight elements per program, warps, registers a thread)\n", flush=True)
    rows = []
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = GEMV_SHAPES[name]
        weights = gemv_weights(name, GEMV_WEIGHTS, output_major=True)
        a = fused_inputs(name, 1)
        silu = name == "gate_up"
        # (then the default tile with a cap on the registers a thread uses: more programs an SM)
        tiles = [(*tile, None) for tile in itertools.product((4096, 8192, 16384, 32768), (2, 4, 8))]
        for tile, warps, registers in tiles + [(8192, 4, cap) for cap in (96, 88, 80, 72)]:
            # (with SiLU·mul or qkv's RoPE a program's tile is pairs of rows)
            config = gemv_tile_config(n // 2 if silu else n, k, silu or name == "qkv",
                                      tile_elements=tile)._replace(num_warps=warps, max_registers=registers)

            def run(a: dict, w: torch.Tensor, config: GemvConfig = config, silu: bool = silu) -> object:
                if "norm_weight" in a:
                    return fused_norm_linear_triton(a["x"], a["residual"], a["norm_weight"], FUSED_EPS, w, silu, config,
                                                    rope=fused_rope(a))
                return fused_linear_triton(a["x"], w, config=config)
            us = time_fused(name, run, a, weights)
            rows.append((name, str(tile), str(warps), str(registers or "-"), str(config.block_n), f"{us:.2f}",
                         f"{100 * n * k * 2 / us / 1e3 / ceiling:.0f}%"))
            print("  " + "  ".join(rows[-1]), flush=True)
        del weights
        torch.cuda.empty_cache()
    print_columns(("product", "tile elements", "warps", "max registers", "rows per program", "us", "of copy"), rows)


def main() -> int:
    global FUSED_BATCHES
    parser = kernel_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time the GEMV's tiles, warps and register caps")
    parser.add_argument("--batches", type=int_list, default=None, help="the row counts M (default 1,2,4,8,16,32,64)")
    args = parse_on_gpu(parser)
    if args.batches:
        FUSED_BATCHES = args.batches
    gemv_precompile([(name, m, None) for name in GEMV_SHAPES for m in FUSED_BATCHES])  # (linear.py's, for its column)
    ok = fused_check()
    ceiling = copy_ceiling()
    bench_fused(ceiling)
    if args.sweep:
        sweep_gemv_tiles(ceiling)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
