"""Float8 weights (tinyvllm/ops/fp8.py) on the GPU, on the five Llama-3.2-1B products (qkv 3072x2048, o 2048x2048,
gate_up 16384x2048, down 2048x8192, lm_head 128256x2048), against bfloat16 cuBLAS (F.linear, as the model calls it) in
the same run:

- decode, M = 1..64 rows (--batches): our decode kernel reading the float8 weight (fused_linear with weight_scale: the
  GEMV of gemv.py up to its rows, the tiled kernel above), cuBLAS on the bfloat16 weight, and torch._scaled_mm with x
  quantized per token first (fp8_linear's path, the quantization included);
- prefill and large batches, M = 128..8192 (--large-batches): fp8_linear (per-token quantization + _scaled_mm), and
  _scaled_mm alone (what fusing the quantization into the kernel before would leave), against cuBLAS on bfloat16.

Each as microseconds per product, the fraction of the copy rate it reaches (the weight's bytes over the time, against
a device-to-device copy measured here, read + written, as the other kernel benchmarks count it) and of the float8
tensor cores' peak (2 M N K FLOPs over the time, against a large _scaled_mm measured here). 16 distinct weights per
shape replayed in a CUDA graph, as the 16 layers run, so that nothing is served from L2. First every case is checked
against float32 references on fresh random inputs (a new seed each run), which sets the exit status.

    python benchmarks/bench_fp8.py [--quick] [--batches 1,4,16] [--large-batches 128,1024] [--sweep]

--sweep also times the float8 GEMV at M = 1 with other weight bytes per program and warps.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from kernels_common import (
    DEVICE,
    DTYPE,
    GEMV_SHAPES,
    GEMV_WEIGHTS,
    bench,
    copy_ceiling,
    estimate_us,
    gemv_weights,
    graph_us,
    int_list,
    kernel_parser,
    parse_on_gpu,
    print_columns,
    relative_error,
)

from tinyvllm.ops.fp8 import (
    dequantize_fp8_weight,
    fp8_linear_cuda,
    quantize_fp8_per_token,
    quantize_fp8_per_token_triton,
    quantize_fp8_weight,
    scaled_mm_takes,
)
from tinyvllm.ops.fused_linear import fused_linear_triton
from tinyvllm.ops.gemv import GemvConfig, gemv_config

DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64]  # (--batches)
LARGE_BATCHES = [128, 256, 512, 1024, 2048, 4096, 8192]  # (--large-batches)
CHECK_ROWS = 256  # rows of a large batch checked against the float32 reference (each row's result is its own)
SAME_MATH = 1e-2  # ||y - ref|| / ||ref|| against the same float8 operands in float32 (bf16 output rounding)
FP8_ROUNDING = 0.05  # against the unquantized operands (the bf16 weight; x itself)

Product = Callable[[torch.Tensor, int], torch.Tensor]  # (x, index of the weight) -> y


def fp8_weights(name: str, count: int, generator: torch.Generator | None = None,
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`count` float8 weights [N, K] of one product, output-major as the layers store them, and their scales [N]
    (quantized from random bfloat16 weights, one at a time)."""
    w8s, scales = [], []
    for w in (gemv_weights(name, 1, generator, output_major=True)[0] for _ in range(count)):
        w8, scale = quantize_fp8_weight(w)
        w8s.append(w8)
        scales.append(scale)
        del w
    return w8s, scales


def scaled_mm_alone(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """_scaled_mm on an x quantized beforehand: fp8_linear without its quantization kernel."""
    return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), out_dtype=DTYPE)


def products(name: str, weights: list[torch.Tensor], w8s: list[torch.Tensor], scales: list[torch.Tensor],
             x: torch.Tensor, decode: bool) -> dict[str, Product]:
    """The timed products by column: at decode sizes ours, cuBLAS and fp8_linear's _scaled_mm path; above, fp8_linear,
    _scaled_mm alone and cuBLAS."""
    def peer(x: torch.Tensor, i: int) -> torch.Tensor:  # (as the model calls it: the tied LM head through matmul)
        return torch.matmul(x, weights[i].t()) if name == "lm_head" else F.linear(x, weights[i])

    if decode:
        return {"ours": lambda x, i: fused_linear_triton(x, w8s[i], weight_scale=scales[i]), "cuBLAS bf16": peer,
                "_scaled_mm": lambda x, i: fp8_linear_cuda(x, w8s[i], scales[i])}
    x8, x_scale = quantize_fp8_per_token_triton(x)
    return {"fp8_linear": lambda x, i: fp8_linear_cuda(x, w8s[i], scales[i]),
            "_scaled_mm alone": lambda x, i: scaled_mm_alone(x8, x_scale, w8s[i], scales[i]), "cuBLAS bf16": peer}


def check() -> bool:
    """Each product and M against float32 references on fresh random inputs: ours and fp8_linear against the product
    of their own float8 operands (the same math: SAME_MATH) and of the unquantized ones (FP8_ROUNDING); cuBLAS bf16
    against float32 (SAME_MATH). Large batches are checked on their first CHECK_ROWS rows."""
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    print(f"\n## Float8 weights, correctness (seed {seed}): ||y - ref|| / ||ref||, ref in float32 (fp8: the float8 "
          f"operands' product, at most {SAME_MATH:.0e}; bf16: the bfloat16 weight's, at most {FP8_ROUNDING})\n",
          flush=True)
    ok = True
    for name, (n, k) in GEMV_SHAPES.items():
        weight = gemv_weights(name, 1, generator, output_major=True)[0]
        w8, scale = quantize_fp8_weight(weight)
        w_fp8, w_bf16 = dequantize_fp8_weight(w8, scale), weight.float()
        if not scaled_mm_takes(weight[:1], w8):
            print(f"  {name}: torch._scaled_mm cannot take it on this GPU; fp8_linear runs its reference", flush=True)
        cells = []
        for m in DECODE_BATCHES + LARGE_BATCHES:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
            decode = m in DECODE_BATCHES
            rows = slice(0, min(m, CHECK_ROWS))
            for column, product in products(name, [weight], [w8], [scale], x, decode).items():
                if column == "_scaled_mm alone":
                    continue
                y = product(x, 0)[rows].double()
                x32 = x[rows].float()
                if column == "cuBLAS bf16":
                    error = relative_error(y, (x32 @ w_bf16.t()).double())
                    good = error <= SAME_MATH
                    text = f"{error:.1e}"
                else:
                    x_used = x32  # ours multiplies x as it is; _scaled_mm its per-token quantization
                    if column != "ours":
                        x8, x_scale = quantize_fp8_per_token(x[rows])
                        x_used = x8.float() * x_scale
                    same, original = (relative_error(y, (x_used @ w.t()).double()) for w in (w_fp8, w_bf16))
                    good = same <= SAME_MATH and original <= FP8_ROUNDING
                    text = f"{same:.1e} (bf16 {original:.1e})"
                ok &= good and math.isfinite(float(y.sum()))
                cells.append(f"M={m} {column} {text}{'' if good else ' FAIL'}")
        print(f"  {name} {n}x{k}: " + "; ".join(cells), flush=True)
        del weight, w8, w_fp8, w_bf16
        torch.cuda.empty_cache()
    print(f"  => {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def fp8_peak() -> float:
    """TFLOP/s of the float8 tensor cores, measured: an 8192^3 _scaled_mm with per-tensor scales, the better of
    fast accumulation on and off (printed)."""
    size = 8192
    a = torch.randn(size, size, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=DEVICE).to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEVICE)
    rates = {}
    for fast in (False, True):
        ms = bench(lambda fast=fast: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=DTYPE,
                                                      use_fast_accum=fast))
        rates[fast] = 2 * size**3 / ms / 1e9
    print(f"float8 tensor cores ({size}^3 _scaled_mm): {rates[False]:.0f} TFLOP/s, {rates[True]:.0f} with fast "
          f"accumulation", flush=True)
    return max(rates.values())


def time_product(name: str, product: Product, x: torch.Tensor, count: int, m: int) -> float:
    """Microseconds per call of product on each of `count` weights in turn, in a CUDA graph (each output dropped at
    once, so that the graph's pool reuses its memory)."""
    def run() -> None:
        for i in range(count):
            product(x, i)
    n, k = GEMV_SHAPES[name]
    estimate = max(estimate_us(name), 2 * m * n * k / 500e6)  # (memory- or compute-bound)
    return graph_us(run, count, estimate)


def bench_products(ceiling: float, peak: float) -> None:
    """The decode and large-batch tables."""
    for decode, batches in ((True, DECODE_BATCHES), (False, LARGE_BATCHES)):
        rows = []
        columns: list[str] = []
        for name, (n, k) in GEMV_SHAPES.items():
            weights = gemv_weights(name, GEMV_WEIGHTS)  # (bf16, in the layout the model keeps for cuBLAS)
            w8s, scales = fp8_weights(name, GEMV_WEIGHTS)
            for m in batches:
                x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
                timed = products(name, weights, w8s, scales, x, decode)
                columns = list(timed)
                cells = []
                times = {}
                for column, product in timed.items():
                    us = times[column] = time_product(name, product, x, GEMV_WEIGHTS, m)
                    nbytes = n * k * (2 if column == "cuBLAS bf16" else 1)
                    of_copy = nbytes / us / 1e3 / ceiling
                    of_peak = 2 * m * n * k / us / 1e6 / peak
                    cells += [f"{us:.2f}", f"{100 * of_copy:.0f}%", f"{100 * of_peak:.1f}%"]
                fp8_column = columns[0]
                rows.append((f"{name} {n}x{k}", str(m), *cells, f"{times['cuBLAS bf16'] / times[fp8_column]:.2f}x"))
                print("  " + "  ".join(rows[-1]), flush=True)
            del weights, w8s, scales
            torch.cuda.empty_cache()
        what = "decode" if decode else "large batches"
        print(f"\n## Float8 weights, {what}: us per product, of copy ({ceiling:.0f} GB/s; the weight's bytes: 1 a "
              f"weight in float8, 2 in bf16) and of the float8 peak ({peak:.0f} TFLOP/s), {GEMV_WEIGHTS} weights per "
              f"shape in a CUDA graph\n")
        header = ["product NxK", "M"]
        for column in columns:
            header += [f"{column} us", "of copy", "of peak"]
        print_columns((*header, f"cuBLAS/{columns[0]}"), rows)


def sweep_gemv(ceiling: float) -> None:
    """The float8 GEMV at M = 1: weight bytes per program and warps, plain products (16 weights per shape)."""
    print("\n## float8 GEMV at M = 1 (us, of copy; weight bytes per program, warps)\n", flush=True)
    rows = []
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = GEMV_SHAPES[name]
        w8s, scales = fp8_weights(name, GEMV_WEIGHTS)
        x = torch.randn(1, k, device=DEVICE, dtype=DTYPE)
        for tile_bytes in (8192, 16384, 32768):
            for warps in (4, 8):
                config: GemvConfig = gemv_config(n, k, tile_elements=tile_bytes)._replace(num_warps=warps)

                def gemv(x: torch.Tensor, i: int, w8s: list = w8s, scales: list = scales,
                         config: GemvConfig = config) -> torch.Tensor:
                    return fused_linear_triton(x, w8s[i], config=config, weight_scale=scales[i])
                us = time_product(name, gemv, x, GEMV_WEIGHTS, 1)
                rows.append((name, str(tile_bytes), str(warps), str(config.block_n), f"{us:.2f}",
                             f"{100 * n * k / us / 1e3 / ceiling:.0f}%"))
                print("  " + "  ".join(rows[-1]), flush=True)
        w8s = scales = []  # (freed before the next product's)
        torch.cuda.empty_cache()
    print_columns(("product", "weight bytes per program", "warps", "rows per program", "us", "of copy"), rows)


def main() -> int:
    global DECODE_BATCHES, LARGE_BATCHES
    parser = kernel_parser(__doc__)
    parser.add_argument("--batches", type=int_list, default=None, help="decode row counts (default 1,2,4,8,16,32,64)")
    parser.add_argument("--large-batches", type=int_list, default=None,
                        help="large-batch row counts (default 128,256,512,1024,2048,4096,8192)")
    parser.add_argument("--sweep", action="store_true", help="also time the float8 GEMV's tiles at M = 1")
    args = parse_on_gpu(parser)
    DECODE_BATCHES = args.batches or DECODE_BATCHES
    LARGE_BATCHES = args.large_batches or LARGE_BATCHES
    ok = check()
    ceiling = copy_ceiling()
    peak = fp8_peak()
    bench_products(ceiling, peak)
    if args.sweep:
        sweep_gemv(ceiling)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
