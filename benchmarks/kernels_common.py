"""Shared by the kernel benchmarks (bench_attention.py, bench_cascade.py, bench_elementwise.py, bench_sampling.py,
bench_gemv.py, bench_fused.py): the Llama-3.2-1B's shapes, GPU timing that keeps the L2 cache out of the figure, the
tables they print, the copy ceiling, the SDPA peer of the attention kernels, and the decode products' weights and
CUDA-graph timing (bench_gemv.py and bench_fused.py time the same five products). Not a script."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
import triton
import triton.testing
from common import require_gpu  # (also puts the repository root on sys.path, for tinyvllm)
from torch.nn.attention import SDPBackend, sdpa_kernel

from tinyvllm.ops.linear import SkinnyConfig, skinny_matmul_triton

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, BLOCK_SIZE = 2048, 32, 8, 64, 8192, 128256, 16
L2_BYTES = 200 * 2**20  # rotate through this many bytes of inputs so that small cases are not L2-resident
COPY_ELEMENTS = 2**30  # 2 GiB of bf16

QUICK = False  # --quick (set by parse_on_gpu): shorter timing runs


def kernel_parser(doc: str, quick_help: str = "shorter timing runs") -> argparse.ArgumentParser:
    """A script's parser, its docstring as the description, with --quick."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def int_list(text: str) -> list[int]:
    """An argument '1,4,16' as [1, 4, 16]."""
    return [int(m) for m in text.split(",")]


def parse_on_gpu(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments; then, on a machine with a CUDA GPU (elsewhere the parser refuses), the seed and a line naming
    the GPU and the versions that compiled the kernels."""
    global QUICK
    args = parser.parse_args()
    QUICK = args.quick
    require_gpu(parser, what="tinyvllm's kernels at Llama-3.2-1B's shapes")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    return args


def bench(fn: Callable[[], object]) -> float:
    """Milliseconds per call (triton.testing.do_bench: L2 flushed before each call)."""
    return triton.testing.do_bench(fn, warmup=10 if QUICK else 25, rep=30 if QUICK else 100)


def bench_graph(fn: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of a function that makes `calls` calls, replayed as a CUDA graph (no launch
    overhead, as decode runs in the engine)."""
    return triton.testing.do_bench_cudagraph(fn, rep=20 if QUICK else 50) / calls


class Table:
    def __init__(self, title: str, unit: str) -> None:
        self.title, self.unit = title, unit
        self.rows: list[tuple[str, str, str, str, str, str]] = []

    def add(self, case: str, ours: float, peer_name: str, peer: float | None, ceiling: float | None = None) -> None:
        ratio = f"{ours / peer:.2f}x" if peer else "-"
        of_ceiling = f"{100 * ours / ceiling:.0f}%" if ceiling else ""
        self.rows.append((case, f"{ours:.1f}", peer_name, f"{peer:.1f}" if peer else "n/a", ratio, of_ceiling))
        print(f"  {case}: tinyvllm {ours:.1f} {self.unit}, {peer_name} {self.rows[-1][3]}", flush=True)

    def print(self) -> None:
        print(f"\n## {self.title}\n")
        print_columns(("case", f"tinyvllm {self.unit}", "peer", f"peer {self.unit}", "ours/peer", "of copy"),
                      self.rows)


def print_columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """The header, a rule and the rows, each column as wide as its widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("{:<" + str(w) + "}" for w in widths)
    print(line.format(*header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line.format(*r))


def copy_ceiling() -> float:
    """GB/s of a 2 GB device-to-device copy (bytes read + written), printed as well."""
    src = torch.empty(COPY_ELEMENTS, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    ceiling = 2 * src.numel() * src.element_size() / ms / 1e6
    print(f"device-to-device copy (2 GiB): {ceiling:.0f} GB/s (read + written)", flush=True)
    return ceiling


# ------------------------------------------------------------------------------- the attention kernels' peer


def sdpa(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable | None:
    """A closure running SDPA on `backend` with grouped KV heads (enable_gqa), or with K/V expanded to the
    query heads where the backend refuses GQA; None if the backend cannot run this shape at all. The
    closure's `gqa` attribute says which."""
    group = q.shape[1] // k.shape[1]

    def grouped() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    k_full, v_full = (k, v) if group == 1 else (None, None)

    def expanded() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k_full, v_full, is_causal=causal)

    for run, gqa in ((grouped, True), (expanded, False)):
        if not gqa and k_full is None:
            k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        try:
            run()
            torch.cuda.synchronize()
        except (RuntimeError, TypeError):
            continue
        run.gqa = gqa  # type: ignore[attr-defined]
        return run
    return None


# -------------------------------------------------------------------- decode products (GEMV, fused kernels)

# (N, K) of the five products of a Llama-3.2-1B decode step. The projections are stored input-major on CUDA
# (model/loader.py) and called through F.linear; the tied LM head is the embedding [vocab, hidden], called
# as torch.matmul(hidden, weight.t()) (CausalLM.compute_logits).
GEMV_SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
               "lm_head": (128256, 2048)}
GEMV_WEIGHTS = 16  # distinct weights per shape, cycled as the 16 layers are: 16 x 8 MB and up, past the L2
GEMV_GRAPH_MS = 4.0  # each timed graph replays for about this long


def gemv_weights(name: str, count: int, generator: torch.Generator | None = None,
                 output_major: bool = False) -> list[torch.Tensor]:
    """`count` random weights [N, K] of one product, in the layout the model keeps it in on cuBLAS (output_major:
    on the decode kernels)."""
    n, k = GEMV_SHAPES[name]
    if name == "lm_head" or output_major:
        return [torch.randn(n, k, device=DEVICE, dtype=DTYPE, generator=generator) for _ in range(count)]
    return [torch.randn(k, n, device=DEVICE, dtype=DTYPE, generator=generator).t() for _ in range(count)]


def describe(config: SkinnyConfig) -> str:
    c = config
    return f"{c.block_m}x{c.block_n}x{c.block_k} split {c.split_k} w{c.num_warps} s{c.num_stages}"


def graph_us(fn: Callable[[], object], calls: int, estimate_us: float) -> float:
    """Microseconds per call of fn (which makes `calls` calls), fn repeated in one CUDA graph that runs for
    about GEMV_GRAPH_MS: median of 5 replays, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    rounds = max(1, min(50, round(GEMV_GRAPH_MS * 1e3 / (estimate_us * calls))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / (rounds * calls)


def estimate_us(name: str) -> float:
    n, k = GEMV_SHAPES[name]
    return n * k * 2 / 3e6  # at 3 TB/s


def time_gemv(name: str, weights: list[torch.Tensor], x: torch.Tensor, config: SkinnyConfig | None) -> float:
    return graph_us(lambda: [skinny_matmul_triton(x, w, config) for w in weights], len(weights), estimate_us(name))


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _gemv_compile(job: tuple[str, int, SkinnyConfig | None]) -> str | None:
    """Compile one (shape, M, config) by running it once (in a worker process of gemv_precompile)."""
    name, m, config = job
    try:
        n, k = GEMV_SHAPES[name]
        skinny_matmul_triton(torch.randn(m, k, device=DEVICE, dtype=DTYPE), gemv_weights(name, 1)[0], config)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # a config that does not compile or fit: reported, and skipped by the sweep
        return f"{type(error).__name__}: {str(error)[:150]}"


def gemv_precompile(jobs: list[tuple[str, int, SkinnyConfig | None]]) -> None:
    """Fill Triton's on-disk cache for every job in parallel processes (one compile takes about a second,
    and the sweep has hundreds): the timing loop then only loads them."""
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(_gemv_compile, job) for job in jobs]
        deadline = time.monotonic() + 240
        errors = [future.result(timeout=max(0.0, deadline - time.monotonic())) for future in futures]
    except Exception as error:  # a hung or broken pool: the timing loop compiles what is missing
        print(f"parallel compile failed ({type(error).__name__}: {error}); compiling in turn", flush=True)
        for process in list(pool._processes.values()):  # the workers this function started
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        return
    pool.shutdown()
    failed = [(job, e) for job, e in zip(jobs, errors) if e]
    print(f"compiled {len(jobs)} skinny matmul configs in {workers} processes; {len(failed)} failed", flush=True)
    for (name, m, config), error in failed:
        print(f"  {name} M={m} {describe(config) if config else 'default'}: {error}", flush=True)
