"""The skinny matmul (tinyvllm/ops/linear.py) on the GPU at M = 1..64 rows on the five Llama-3.2-1B products of a
decode step, in the calls the model makes, against cuBLAS in the same run: the projections' weights stored
input-major (as the model keeps them on cuBLAS), and in a further column output-major (as the model keeps those that
run on the decode kernels at a few rows), plus a column through cuBLASLt; GB/s of weight read against the copy
ceiling measured here, and the crossover per product. 16 distinct weights per shape are replayed in a CUDA graph, as
the 16 layers run, so that nothing is served from the 50 MB L2.

First a bf16 correctness check of every case against float64 on fresh random inputs (a new seed each run), which
sets the exit status; last, at 128 rows and more (--batches), split-K through cuBLAS's batched product with float32
partials.

    python benchmarks/bench_gemv.py [--quick] [--sweep] [--batches 128,256]   (--batches: the rows of both)

--sweep (or --gemv-sweep) also times alternative tiles, splits and warps (compiled first in parallel worker
processes) and prints the best per case.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from kernels_common import (
    DEVICE,
    DTYPE,
    GEMV_SHAPES,
    GEMV_WEIGHTS,
    copy_ceiling,
    describe,
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

from tinyvllm.ops.linear import SkinnyConfig, skinny_matmul_config, skinny_matmul_triton, split_k_for

GEMV_BATCHES = [1, 2, 4, 8, 16, 32, 64]  # (--batches)
GEMV_SWEEP_BATCHES = [1, 4, 16, 32, 64]  # (--batches)
SPLIT_K_PARTS = (1, 2, 4, 8)


def cublas_product(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product as the model calls it (through cuBLAS)."""
    if name == "lm_head":
        return lambda x, w: torch.matmul(x, w.t())
    return F.linear


def gemv_config(name: str, m: int) -> SkinnyConfig:
    n, k = GEMV_SHAPES[name]
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    return skinny_matmul_config(m, n, k, name == "lm_head", sms)


def time_cublas(name: str, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    peer = cublas_product(name)
    return graph_us(lambda: [peer(x, w) for w in weights], len(weights), estimate_us(name))


def time_cublaslt(name: str, weights: list[torch.Tensor], x: torch.Tensor) -> str:
    """time_cublas with torch's matmul sent to cuBLASLt (torch.backends.cuda.preferred_blas_library), whose
    heuristics may pick other kernels (split-K among them) than cuBLAS's at a few hundred rows; '-' where refused."""
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        return f"{time_cublas(name, weights, x):.2f}"
    except RuntimeError:
        return "-"
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def gemv_check() -> bool:
    """Every case in bf16 against float64 on fresh random inputs (a new seed each run): relative error
    ||y - ref|| / ||ref|| beside cuBLAS's, output poisoned with NaN first, five more eager calls and a CUDA
    graph replay bit-identical to the first call (the split-K reduce sums in a fixed order; a race between
    its programs would show as a moving result)."""
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    print(f"\n## Skinny matmul, bf16 correctness (seed {seed}): ||y - ref|| / ||ref||, ref in float64\n", flush=True)
    ok = True
    for name, (n, k) in GEMV_SHAPES.items():
        w = gemv_weights(name, 1, generator)[0]
        peer = cublas_product(name)
        errors = []
        for m in GEMV_BATCHES:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
            ref = x.double() @ w.double().t()
            y = skinny_matmul_triton(x, w, out=torch.full((m, n), float("nan"), device=DEVICE, dtype=DTYPE))
            error, peer_error = relative_error(y, ref), relative_error(peer(x, w), ref)
            same = all(torch.equal(skinny_matmul_triton(x, w), y) for _ in range(5))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_graph = skinny_matmul_triton(x, w)
            graph.replay()
            graph.replay()
            same = same and torch.equal(y_graph, y)
            good = math.isfinite(error) and error < 1e-2 and same
            ok &= good
            errors.append(f"M={m} {error:.1e} (cuBLAS {peer_error:.1e}){'' if same else ' NOT REPRODUCIBLE'}"
                          f"{'' if good else ' FAIL'}")
        print(f"  {name} {n}x{k}: " + "; ".join(errors), flush=True)
        del w
        torch.cuda.empty_cache()
    print(f"  => {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def bench_gemv(ceiling: float) -> dict[tuple[str, int], tuple[float, float]]:
    """(shape, M) -> (our us, cuBLAS us) with the wrapper's own configs; prints the table and the crossovers."""
    results: dict[tuple[str, int], tuple[float, float]] = {}
    rows = []
    for name, (n, k) in GEMV_SHAPES.items():
        weights = gemv_weights(name, GEMV_WEIGHTS)
        # (the projections' weights as the model keeps them when they run on the decode kernels at a few rows:
        # output-major, which cuBLAS then multiplies at every larger row count)
        output_major = None if name == "lm_head" else gemv_weights(name, GEMV_WEIGHTS, output_major=True)
        nbytes = n * k * 2
        for m in GEMV_BATCHES:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            ours, peer = time_gemv(name, weights, x, None), time_cublas(name, weights, x)
            results[name, m] = (ours, peer)
            ours_gbps, peer_gbps = nbytes / ours / 1e3, nbytes / peer / 1e3
            other = "-" if output_major is None else f"{time_cublas(name, output_major, x):.2f}"
            rows.append((f"{name} {n}x{k}", str(m), describe(gemv_config(name, m)), f"{ours:.2f}", f"{ours_gbps:,.0f}",
                         f"{peer:.2f}", f"{peer_gbps:,.0f}", f"{peer / ours:.2f}x", f"{100 * ours_gbps / ceiling:.0f}%",
                         f"{100 * peer_gbps / ceiling:.0f}%", other, time_cublaslt(name, weights, x)))
            print("  " + "  ".join(rows[-1]), flush=True)
        del weights, output_major
        torch.cuda.empty_cache()
    print(f"\n## Skinny matmul vs cuBLAS, bf16, {GEMV_WEIGHTS} weights per shape in a CUDA graph "
          f"(GB/s of weight read; copy ceiling {ceiling:.0f} GB/s)\n")
    print_columns(("product NxK", "M", "config (MxNxK tile, split, warps, stages)", "ours us", "ours GB/s",
                   "cuBLAS us", "cuBLAS GB/s", "cuBLAS/ours", "ours of copy", "cuBLAS of copy",
                   "cuBLAS us, weight [N, K] contiguous", "cuBLASLt us"), rows)
    print("\nCrossover (cuBLAS/ours > 1: ours faster):")
    for name in GEMV_SHAPES:
        slower = [m for m in GEMV_BATCHES if results[name, m][0] > results[name, m][1]]
        if not slower:
            print(f"  {name}: ours faster at every M measured")
            continue
        faster = [m for m in GEMV_BATCHES if m < slower[0]]
        print(f"  {name}: " + (f"ours faster up to M={faster[-1]}; " if faster else "") +
              f"cuBLAS faster from M={slower[0]} (cuBLAS faster at M={slower})")
    return results


def gemv_candidates(name: str, m: int) -> list[SkinnyConfig]:
    """Alternatives to the wrapper's config for the sweep: dot tiles with splits around each tile's own,
    warps and stages; at M = 1 CUDA-core GEMV tiles (two warps or four) too."""
    n, k = GEMV_SHAPES[name]
    k_contiguous = name == "lm_head"
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    default = skinny_matmul_config(m, n, k, k_contiguous, sms)
    block_m = max(default.block_m, 16)
    configs = [default, default._replace(num_warps=8), default._replace(num_warps=2 if default.block_m == 1 else 4)]
    if default.block_m > 1:
        configs += [default._replace(num_stages=2), default._replace(num_stages=4)]

    def around(bm: int, bn: int, bk: int, warps: int = 4) -> None:
        split = split_k_for(m, n, k, bm, bn, bk, sms)
        for s in sorted({max(split // 2, 1), split, split * 2}):
            if k >= s * bk:
                configs.append(SkinnyConfig(bm, bn, bk, s, num_warps=warps))

    dot_tiles = [(32, 128), (64, 64), (64, 128), (128, 64)] if k_contiguous else [(64, 64), (64, 128), (128, 64)]
    for block_n, block_k in dot_tiles:
        around(block_m, block_n, block_k)
    if m >= 128:  # (a decode step of many sequences: taller tiles read each weight tile for more rows)
        for bm, bn, bk, warps in [(128, 64, 64, 4), (128, 64, 64, 8), (128, 128, 64, 8), (256, 64, 64, 8),
                                  (128, 128, 32, 8), (64, 128, 64, 4)]:
            if bm <= triton.next_power_of_2(m):
                around(bm, bn, bk, warps)
    if m == 1:
        gemv_tiles = ([(16, 256, 4), (8, 512, 4), (16, 512, 4), (16, 256, 8), (32, 256, 8), (16, 128, 8)]
                      if k_contiguous
                      else [(128, 64, 2), (128, 64, 4), (128, 128, 4), (64, 128, 2), (256, 64, 4), (128, 128, 8)])
        for block_n, block_k, warps in gemv_tiles:
            around(1, block_n, block_k, warps)
    return list(dict.fromkeys(configs))


def sweep_gemv(results: dict[tuple[str, int], tuple[float, float]]) -> None:
    """Each candidate config's microseconds at GEMV_SWEEP_BATCHES, then the best one per case."""
    best_rows = []
    for name in GEMV_SHAPES:
        n, k = GEMV_SHAPES[name]
        weights = gemv_weights(name, GEMV_WEIGHTS)
        for m in GEMV_SWEEP_BATCHES:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            default = gemv_config(name, m)
            timings = []
            for config in gemv_candidates(name, m):
                try:
                    timings.append((time_gemv(name, weights, x, config), config))
                except Exception as error:  # a config that does not compile or fit
                    print(f"  {name} M={m} {describe(config)}: failed ({type(error).__name__})", flush=True)
            timings.sort(key=lambda t: t[0])
            print(f"\n  {name} M={m} (default {describe(default)}; cuBLAS {results[name, m][1]:.2f} us): " +
                  ", ".join(f"{describe(c)} {us:.2f}" for us, c in timings), flush=True)
            default_us = next(us for us, c in timings if c == default)
            again = time_gemv(name, weights, x, default)  # the same config timed again: the noise
            best_rows.append(f"  {name} M={m}: default {default_us:.2f} us (table {results[name, m][0]:.2f}, "
                             f"again {again:.2f}), best {timings[0][0]:.2f} us ({describe(timings[0][1])}), "
                             f"cuBLAS {results[name, m][1]:.2f} us")
        del weights
        torch.cuda.empty_cache()
    print("\n## Skinny matmul sweep: best config per case\n")
    print("\n".join(best_rows))


def bench_split_k(ceiling: float) -> None:
    """At 128 rows and more (where cuBLAS's products read their weights well below the copy rate): the product cut
    along K into S parts through cuBLAS's batched product with float32 outputs (torch.bmm out_dtype), the S
    partials [S, M, N] left for the next kernel to sum (as the residual add could), and with a torch sum after it;
    error of the summed result against float64. Whether split-K, which cuBLAS's heuristics do not pick there,
    would fill the GPU."""
    rows = [m for m in GEMV_BATCHES if m >= 128]
    if not rows:
        return
    print(f"\n## Split-K through torch.bmm(out_dtype=float32), 16 weights per shape in a CUDA graph: us (of copy "
          f"{ceiling:.0f} GB/s) for S parts; '+ sum': with the partials summed by torch\n", flush=True)
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = GEMV_SHAPES[name]
        weights = gemv_weights(name, GEMV_WEIGHTS)  # [N, K] views of [K, N] storage, as the model keeps them
        nbytes = n * k * 2
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            ref = x.double() @ weights[0].double().t()
            cells = []
            for parts in SPLIT_K_PARTS:
                xs = x.view(m, parts, k // parts).transpose(0, 1)  # [S, M, K/S], no copy
                ws = [w.t().view(parts, k // parts, n) for w in weights]  # [S, K/S, N] of the [K, N] storage
                try:
                    err = float((torch.bmm(xs, ws[0], out_dtype=torch.float32).sum(0).double() - ref).norm()
                                / ref.norm())
                    bare = graph_us(lambda xs=xs, ws=ws: [torch.bmm(xs, w, out_dtype=torch.float32) for w in ws],
                                    len(ws), estimate_us(name))
                    summed = graph_us(lambda xs=xs, ws=ws: [torch.bmm(xs, w, out_dtype=torch.float32).sum(0)
                                                            for w in ws], len(ws), estimate_us(name))
                except (RuntimeError, TypeError) as error:  # (out_dtype needs a recent torch)
                    cells.append(f"S={parts}: failed ({type(error).__name__}: {str(error)[:60]})")
                    continue
                cells.append(f"S={parts}: {bare:.2f} ({100 * nbytes / bare / 1e3 / ceiling:.0f}%), + sum "
                             f"{summed:.2f}, err {err:.1e}")
            print(f"  {name} {n}x{k} M={m}: " + "; ".join(cells), flush=True)
        del weights
        torch.cuda.empty_cache()


def main() -> int:
    global GEMV_BATCHES, GEMV_SWEEP_BATCHES
    parser = kernel_parser(__doc__)
    parser.add_argument("--sweep", "--gemv-sweep", action="store_true", help="also time alternative configs")
    parser.add_argument("--batches", type=int_list, default=None,
                        help="the row counts M (default 1,2,4,8,16,32,64; and those of --sweep, default 1,4,16,32,64)")
    args = parse_on_gpu(parser)
    if args.batches:
        GEMV_BATCHES = GEMV_SWEEP_BATCHES = args.batches
    jobs: list[tuple[str, int, SkinnyConfig | None]] = [(name, m, None) for name in GEMV_SHAPES for m in GEMV_BATCHES]
    if args.sweep:
        jobs += [(name, m, c) for name in GEMV_SHAPES for m in GEMV_SWEEP_BATCHES for c in gemv_candidates(name, m)]
    gemv_precompile(jobs)
    ok = gemv_check()
    ceiling = copy_ceiling()
    results = bench_gemv(ceiling)
    bench_split_k(ceiling)
    if args.sweep:
        sweep_gemv(results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
