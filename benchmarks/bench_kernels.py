"""Benchmarks of tinyvllm's Triton kernels on the GPU, each beside its peer in the same run:

- prefill attention (8 x 2048 causal, Llama-3.2-1B heads): TFLOP/s vs torch SDPA (flash, cuDNN);
- decode attention (paged, block size 16): GB/s of K+V attended vs SDPA flash on contiguous KV and vs
  the device-to-device copy ceiling measured here;
- RMSNorm, fused add+RMSNorm, RoPE fused with the KV-cache store, SiLU-and-mul at >= 64 MB: GB/s vs the
  copy ceiling and the torch reference;
- sampling at vocabulary 128256, batch 1/64/256 (greedy, temperature, top-k/top-p/min-p, with and without
  the engine's hints, eager and in a CUDA graph): microseconds vs sample_ref or torch.argmax;
- with --cascade, alone: cascade attention (tinyvllm/ops/cascade_attention.py) on decode batches of 8-256
  sequences sharing a 1,024-token prefix of blocks, each with its own 64-192 tokens: microseconds and effective
  GB/s (the K+V bytes the plain kernel reads) vs the plain paged decode kernel on the same blocks and vs SDPA
  flash on contiguous KV of the mean length; first a bf16 correctness check against the float32 reference;
  --sweep cascade (or all) also times other prefix splits and row tiles;
- with --gemv, alone: the skinny matmul (tinyvllm/ops/linear.py) at M = 1..64 (--batches: other row counts) on
  the five Llama-3.2-1B products, in the calls the model makes, vs cuBLAS (the projections' weights stored
  input-major, and in a last column output-major, as the model keeps those that run on the decode kernels at a
  few rows) and the copy ceiling, 16 distinct weights per shape replayed in a CUDA graph (as the 16 layers run:
  nothing served from the 50 MB L2); first a bf16 correctness check of every case against float64, fresh random
  inputs each run;
- with --fused, alone: the fused decode kernels (tinyvllm/ops/fused_linear.py) at M = 1..64, each against what
  the model runs without them (qkv: fused add+RMSNorm then cuBLAS; gate_up: the norm, cuBLAS, SiLU-and-mul;
  o and down: cuBLAS; the LM head: cuBLAS logits then the sampler's greedy argmax), beside linear.py's plain
  product and the copy ceiling, timed as --gemv times (16 weights per shape in a CUDA graph); first a bf16
  check against float32 references, then the crossover per product (the rows of ops.DECODE_KERNEL_MAX_ROWS).
  Ours runs on output-major weights, the layout the loader keeps for a product on the decode kernels (up to
  GEMV_MAX_ROWS rows the GEMV of tinyvllm/ops/gemv.py then runs it), the peer on the cuBLAS layout; --sweep also
  times the GEMV's other tiles, warps and register caps at M = 1.

    python benchmarks/bench_kernels.py [--quick] [--sweep [prefill|decode|rms_norm] [--sweep-only]]
    python benchmarks/bench_kernels.py --kv-cache-dtype fp8 [--quick]   (decode attention alone: float8 vs bf16 caches,
                                                                         and each in the other pool layout)
    python benchmarks/bench_kernels.py --gemv [--gemv-sweep] [--batches 128,256]   (--batches: the rows of both)
    python benchmarks/bench_kernels.py --cascade [--sweep cascade]
    python benchmarks/bench_kernels.py --fused [--batches 1,2,4,8] [--sweep]

--sweep also times alternative launch configurations: attention tiles, warps, stages and splits; RMSNorm
rows per program and warps beside a copy with the same grid; without --quick, sampling chunk sizes.
Naming a family sweeps only it; --sweep-only skips the tables. --gemv-sweep also times alternative skinny
matmul tiles, splits and warps (compiled first in parallel worker processes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.testing  # noqa: E402
from common import attention_metadata as metadata  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tinyvllm.ops import kv_pool  # noqa: E402
from tinyvllm.ops.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from tinyvllm.ops.attention import (  # noqa: E402
    decode_config,
    decode_num_splits,
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_triton,
    paged_prefill_triton,
    prefill_config,
)
from tinyvllm.ops.cascade_attention import (  # noqa: E402
    CascadePlan,
    cascade_attention_triton,
    cascade_plan,
    cascade_prefix_config,
)
from tinyvllm.ops.fused_linear import (  # noqa: E402
    fused_linear_ref,
    fused_linear_triton,
    fused_norm_linear_ref,
    fused_norm_linear_triton,
    linear_argmax_triton,
)
from tinyvllm.ops.gemv import GEMV_MAX_ROWS, GemvConfig  # noqa: E402
from tinyvllm.ops.gemv import gemv_config as gemv_tile_config  # noqa: E402
from tinyvllm.ops.layernorm import (  # noqa: E402
    _launch_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_config,
    rms_norm_ref,
    rms_norm_triton,
)
from tinyvllm.ops.linear import (  # noqa: E402
    SkinnyConfig,
    skinny_matmul_config,
    skinny_matmul_triton,
    split_k_for,
)
from tinyvllm.ops.pdl import pdl_options, pdl_wait  # noqa: E402
from tinyvllm.ops.rotary import (  # noqa: E402
    RopeStore,
    build_cos_sin_cache,
    rope_store_triton,
    rotary_embedding_and_store_ref,
    rotary_embedding_and_store_triton,
)
from tinyvllm.ops.sampling import sample_ref, sample_triton  # noqa: E402
from tinyvllm.worker.sampler import _KERNEL_GREEDY_MAX_ROWS  # noqa: E402

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, BLOCK_SIZE = 2048, 32, 8, 64, 8192, 128256, 16
L2_BYTES = 200 * 2**20  # rotate through this many bytes of inputs so that small cases are not L2-resident
PREFILL_BATCH, PREFILL_LEN = 8, 2048
DECODE_BATCHES, DECODE_CONTEXTS = [1, 64, 256], [512, 2048, 8192]
ELEMENTWISE_TOKENS = 16384  # 16384 x 2048 bf16 = 64 MiB per activation
COPY_ELEMENTS = 2**30  # 2 GiB of bf16

QUICK = False
# --kv-cache-dtype fp8: the decode attention table reads float8 e4m3 caches (kv_cache_dtype="fp8")
KV_CACHE_FP8 = False


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
    """GB/s of a 2 GB device-to-device copy (bytes read + written)."""
    src = torch.empty(COPY_ELEMENTS, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


# ------------------------------------------------------------------------------------------------ attention


def paged_from_contiguous(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [B, Hk, L, D] (L a multiple of BLOCK_SIZE) -> (k_cache, v_cache, block_tables) holding the same
    values in blocks of a randomly permuted pool, laid out as the engine lays out its pools (ops.kv_pool)."""
    batch, kv_heads, length, head_dim = k.shape
    blocks_per_seq = length // BLOCK_SIZE
    order = torch.randperm(batch * blocks_per_seq, device=DEVICE)
    block_tables = order.view(batch, blocks_per_seq).int()
    caches = []
    for t in (k, v):
        cache = kv_pool(batch * blocks_per_seq, BLOCK_SIZE, kv_heads, head_dim, t.dtype, DEVICE)
        cache[order] = t.permute(0, 2, 1, 3).reshape(batch * blocks_per_seq, BLOCK_SIZE, kv_heads, head_dim)
        caches.append(cache)
    return caches[0], caches[1], block_tables


def other_layout(cache: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A pool [blocks, block_size, heads, head_dim] with the same values and shape in the layout the engine does not
    use (token-major: [blocks, block_size, heads, head_dim] in memory; head-major: [blocks, heads, block_size,
    head_dim]), and that layout's name: the kernels read either through the strides."""
    if cache.stride(2) > cache.stride(1):  # (head-major: a head's block_size rows lie together)
        return cache.contiguous(), "token-major"
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3), "head-major"


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


def bench_prefill(table: Table) -> None:
    batch, length = PREFILL_BATCH, PREFILL_LEN
    q4 = torch.randn(batch, NUM_Q_HEADS, length, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k4 = torch.randn(batch, NUM_KV_HEADS, length, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v4 = torch.randn_like(k4)
    k_cache, v_cache, block_tables = paged_from_contiguous(k4, v4)
    q = q4.transpose(1, 2).reshape(batch * length, NUM_Q_HEADS, HEAD_DIM).contiguous()
    meta = metadata([length] * batch, [length] * batch, block_tables)
    scale = HEAD_DIM**-0.5
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * batch * length * length / 2

    ours = lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale)  # noqa: E731
    tflops = flops / bench(ours) / 1e9
    case = f"prefill {batch}x{length} causal {NUM_Q_HEADS}/{NUM_KV_HEADS} heads d{HEAD_DIM} bf16"
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        peer = sdpa(backend, q4, k4, v4, causal=True)
        if peer is None:
            table.add(case, tflops, f"{name} (not available)", None)
            continue
        ref = peer().transpose(1, 2).reshape(batch * length, NUM_Q_HEADS, HEAD_DIM)
        diff = float((ours().float() - ref.float()).norm() / ref.float().norm())
        label = f"{name}{'' if peer.gqa else ' (K/V expanded)'} [rel diff {diff:.0e}]"
        table.add(case, tflops, label, flops / bench(peer) / 1e9)


def bench_decode(table: Table, ceiling: float) -> None:
    """Ours against SDPA flash on contiguous KV; with --kv-cache-dtype fp8, ours on float8 caches against ours on
    bf16 caches of the same values (both in GB/s of the bf16 K+V they stand for, so ours/peer is the speedup; the
    copy-ceiling column is left out, since the float8 kernel reads half those bytes), then each in the layout the
    engine does not use against the engine's."""
    scale = HEAD_DIM**-0.5
    batches, contexts = DECODE_BATCHES, DECODE_CONTEXTS
    if QUICK:
        batches, contexts = batches[:2], contexts[::2]
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2  # K and V, bf16
            if kv_bytes > 10e9:
                continue
            copies = max(1, min(64, math.ceil(L2_BYTES / kv_bytes)))
            sets = []
            for _ in range(copies):
                k4 = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE)
                v4 = torch.randn_like(k4)
                k_cache, v_cache, block_tables = paged_from_contiguous(k4, v4)
                q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
                meta = metadata([1] * batch, [context] * batch, block_tables)
                sets.append((q, k_cache, v_cache, meta, k4, v4))

            def ours(sets: list = sets) -> None:
                for q, k_cache, v_cache, meta, _, _ in sets:
                    paged_attention_triton(q, k_cache, v_cache, meta, scale)

            splits = decode_num_splits(batch, NUM_KV_HEADS, context)
            case = f"decode B={batch} ctx={context} ({kv_bytes / 2**20:.0f} MiB KV, {splits} splits)"
            if KV_CACHE_FP8:
                fp8_sets = [(q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), meta, None, None)
                            for q, k, v, meta, _, _ in sets]
                fp8_gbps = kv_bytes / bench_graph(lambda fp8_sets=fp8_sets: ours(fp8_sets), copies) / 1e6
                bf16_gbps = kv_bytes / bench_graph(ours, copies) / 1e6
                table.add(case.replace("KV,", "bf16 KV as fp8,"), fp8_gbps, "tinyvllm, bf16 cache", bf16_gbps)
                # The same pools in the other layout (head-major: a head's block one run of bytes, 1 KiB in float8;
                # token-major: 64-byte float8 rows 512 bytes apart), to show what the engine's layout is worth.
                for name, pools, gbps in (("fp8", fp8_sets, fp8_gbps), ("bf16", sets, bf16_gbps)):
                    moved = [(q, other_layout(k)[0], other_layout(v)[0], meta, None, None)
                             for q, k, v, meta, _, _ in pools]
                    table.add(case.replace("KV,", f"bf16 KV as {name}, {other_layout(pools[0][1])[1]} pool,"),
                              kv_bytes / bench_graph(lambda moved=moved: ours(moved), copies) / 1e6,
                              f"tinyvllm, {name}, the engine's pool", gbps)
                    del moved
                del sets, fp8_sets
                continue
            gbps = kv_bytes / bench_graph(ours, copies) / 1e6
            peers = [sdpa(SDPBackend.FLASH_ATTENTION, s[0].unsqueeze(2), s[4], s[5], causal=False) for s in sets]
            if peers[0] is None:
                table.add(case, gbps, "SDPA flash (not available)", None, ceiling)
                continue

            def peer(peers: list = peers) -> None:
                for run in peers:
                    run()

            label = f"SDPA flash contiguous{'' if peers[0].gqa else ' (K/V expanded)'}"
            table.add(case, gbps, label, kv_bytes / bench_graph(peer, copies) / 1e6, ceiling)
            del sets, peers


# ---------------------------------------------------------------------------------------- cascade attention

CASCADE_BATCHES, CASCADE_PREFIX, CASCADE_SUFFIXES = [8, 32, 64, 256], 1024, (64, 192)
TOKEN_KV_BYTES = 2 * NUM_KV_HEADS * HEAD_DIM * 2  # K and V of one token, bf16


def shared_prefix_step(batch: int, prefix_len: int, suffix_lens: list[int]) -> tuple:
    """A decode step of `batch` sequences whose block tables start with the same prefix_len // BLOCK_SIZE blocks
    (as the prefix cache gives them), each then with suffix_lens[i] tokens in blocks of its own, from a randomly
    permuted pool: (q, k_cache, v_cache, cascade metadata, the same without common_prefix_len)."""
    prefix_blocks = prefix_len // BLOCK_SIZE
    own = [math.ceil(s / BLOCK_SIZE) for s in suffix_lens]
    num_blocks = prefix_blocks + sum(own)
    order = torch.randperm(num_blocks, device=DEVICE).int()
    tables = torch.zeros(batch, prefix_blocks + max(own), dtype=torch.int32, device=DEVICE)
    tables[:, :prefix_blocks] = order[:prefix_blocks]
    start = prefix_blocks
    for i, n in enumerate(own):
        tables[i, prefix_blocks:prefix_blocks + n] = order[start:start + n]
        start += n
    k_cache, v_cache = (kv_pool(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, DTYPE, DEVICE).normal_() for _ in "kv")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    plain = metadata([1] * batch, [prefix_len + s for s in suffix_lens], tables)
    cascade = dataclasses.replace(plain, common_prefix_len=torch.tensor([prefix_len], dtype=torch.int32,
                                                                          device=DEVICE))
    return q, k_cache, v_cache, cascade, plain


def cascade_suffixes(batch: int) -> list[int]:
    return torch.randint(CASCADE_SUFFIXES[0], CASCADE_SUFFIXES[1] + 1, (batch,)).tolist()


def cascade_check() -> bool:
    """Cascade attention in bf16 against the float32 reference and against the plain kernel, per batch size."""
    ok, scale = True, HEAD_DIM**-0.5
    print("cascade attention correctness (bf16 vs float32 reference, ||out - ref|| / ||ref||, tolerance 1e-2):")
    for batch in CASCADE_BATCHES:
        q, k_cache, v_cache, cascade, plain = shared_prefix_step(batch, CASCADE_PREFIX, cascade_suffixes(batch))
        out = cascade_attention_triton(q, k_cache, v_cache, cascade, scale).float()
        ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), plain, scale)
        ours_plain = paged_attention_triton(q, k_cache, v_cache, plain, scale).float()
        err = float((out - ref).norm() / ref.norm())
        err_plain = float((ours_plain - ref).norm() / ref.norm())
        diff = float((out - ours_plain).norm() / ours_plain.norm())
        good = err <= 1e-2 and bool(torch.isfinite(out).all())
        ok &= good
        print(f"  B={batch}: cascade {err:.1e}, plain kernel {err_plain:.1e}, cascade vs plain {diff:.1e}"
              f"{'' if good else '  FAIL'}", flush=True)
    return ok


def cascade_sets(batch: int) -> tuple[list[tuple], int, int]:
    """Enough distinct steps of `batch` sequences to rotate past the L2 cache, the unique K+V bytes of one and
    the bytes the plain kernel reads for one."""
    suffixes = cascade_suffixes(batch)
    unique = (CASCADE_PREFIX + sum(suffixes)) * TOKEN_KV_BYTES
    attended = (batch * CASCADE_PREFIX + sum(suffixes)) * TOKEN_KV_BYTES
    copies = max(1, min(64, math.ceil(L2_BYTES / unique)))
    return [shared_prefix_step(batch, CASCADE_PREFIX, suffixes) for _ in range(copies)], unique, attended


def bench_cascade(times: Table, rates: Table) -> None:
    scale = HEAD_DIM**-0.5
    for batch in CASCADE_BATCHES:
        sets, unique, attended = cascade_sets(batch)
        plan = cascade_plan(sets[0][0], sets[0][1], sets[0][3])

        def run(which: int, sets: list = sets) -> None:
            for s in sets:
                (cascade_attention_triton if which == 3 else paged_attention_triton)(s[0], s[1], s[2], s[which], scale)

        cascade_us = bench_graph(lambda: run(3), len(sets)) * 1e3
        plain_us = bench_graph(lambda: run(4), len(sets)) * 1e3
        case = (f"B={batch} prefix {CASCADE_PREFIX} + suffixes {CASCADE_SUFFIXES[0]}-{CASCADE_SUFFIXES[1]} "
                f"({attended / 2**20:.0f} MiB attended, {unique / 2**20:.0f} MiB unique; {plan.num_prefix_splits} "
                f"prefix + {plan.num_splits} suffix splits)")
        print(f"  {case}: cascade {cascade_us:.1f} us, plain {plain_us:.1f} us, plain/cascade "
              f"{plain_us / cascade_us:.2f}x", flush=True)
        times.add(case, cascade_us, "plain paged kernel", plain_us)
        rates.add(case, attended / cascade_us / 1e3, "plain paged kernel", attended / plain_us / 1e3)
        length = CASCADE_PREFIX + (CASCADE_SUFFIXES[0] + CASCADE_SUFFIXES[1]) // 2
        peer_sets = []
        for s in sets:
            k4 = torch.randn(batch, NUM_KV_HEADS, length, HEAD_DIM, device=DEVICE, dtype=DTYPE)
            peer_sets.append(sdpa(SDPBackend.FLASH_ATTENTION, s[0].unsqueeze(2), k4, torch.randn_like(k4), False))
        if peer_sets[0] is None:
            rates.add(case, attended / cascade_us / 1e3, "SDPA flash (not available)", None)
        else:

            def peer(peer_sets: list = peer_sets) -> None:
                for p in peer_sets:
                    p()

            peer_us = bench_graph(peer, len(sets)) * 1e3
            rates.add(case, attended / cascade_us / 1e3, f"SDPA flash, contiguous KV, every context {length}",
                      batch * length * TOKEN_KV_BYTES / peer_us / 1e3)
        del sets, peer_sets
        torch.cuda.empty_cache()


def sweep_cascade() -> None:
    """Microseconds of other prefix split counts and prefix row tiles, then of other decode tiles, per batch size
    (the defaults come from cascade_plan; the suffix splits stay its choice)."""
    scale = HEAD_DIM**-0.5
    print(f"\n## Cascade attention plans: microseconds by prefix splits, per prefix tile (BLOCK_M, warps, stages); "
          f"default tile {cascade_prefix_config(DTYPE)}")
    for batch in CASCADE_BATCHES:
        sets, _, _ = cascade_sets(batch)
        default = cascade_plan(sets[0][0], sets[0][1], sets[0][3])
        print(f"  B={batch} (default {default.num_prefix_splits} prefix + {default.num_splits} suffix splits):")
        for prefix_config in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 8, 3)):
            results = []
            for splits in (1, 2, 4, 8, 16):
                plan = default._replace(num_prefix_splits=splits, prefix_config=prefix_config)

                def run(plan: CascadePlan = plan, sets: list = sets) -> None:
                    for s in sets:
                        cascade_attention_triton(s[0], s[1], s[2], s[3], scale, plan)

                try:
                    results.append(f"{splits}: {bench_graph(run, len(sets)) * 1e3:.1f}")
                except Exception as error:  # a config that does not compile or fit
                    results.append(f"{splits}: failed ({type(error).__name__})")
            print(f"    {prefix_config}: " + "  ".join(results), flush=True)
        # The decode tile (BLOCK_N, warps, stages): the suffix pass's, and the prefix pass's BLOCK_N (the combine
        # cuts both alike), at the default splits and prefix tile.
        results = []
        q, k_cache, v_cache, meta, _ = sets[0]
        reference = cascade_attention_triton(q, k_cache, v_cache, meta, scale, default).float()
        for decode in ((32, 4, 3), (64, 2, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3)):
            plan = default._replace(decode_config=decode)

            def run(plan: CascadePlan = plan, sets: list = sets) -> None:
                for s in sets:
                    cascade_attention_triton(s[0], s[1], s[2], s[3], scale, plan)

            try:
                out = cascade_attention_triton(q, k_cache, v_cache, meta, scale, plan).float()
                differs = float((out - reference).norm() / reference.norm()) > 1e-2
                results.append(f"{decode}: {bench_graph(run, len(sets)) * 1e3:.1f}{' WRONG' if differs else ''}")
            except Exception as error:  # a config that does not compile or fit
                results.append(f"{decode}: failed ({type(error).__name__})")
        print(f"    decode tile (default {default.decode_config}): " + "  ".join(results), flush=True)
        del sets
        torch.cuda.empty_cache()


def cascade_passes() -> None:
    """Microseconds of each of cascade attention's passes at its default plan: the prefix pass alone, the suffix pass
    alone (unmerged), and the merge as what the whole adds to the two (the combine kernel; with one suffix piece the
    suffix pass's own merge, less the partials it then does not write)."""
    import tinyvllm.ops.cascade_attention as cascade

    scale = HEAD_DIM**-0.5
    print("\n## Cascade attention by pass (microseconds, CUDA graphs, inputs rotated past L2)")
    for batch in CASCADE_BATCHES:
        sets, _, _ = cascade_sets(batch)
        plan = cascade_plan(sets[0][0], sets[0][1], sets[0][3])

        def whole(sets: list = sets, plan: CascadePlan = plan) -> None:
            for s in sets:
                cascade_attention_triton(s[0], s[1], s[2], s[3], scale, plan)

        def partials(sets: list = sets, plan: CascadePlan = plan) -> None:
            for s in sets:
                cascade.cascade_partials_triton(s[0], s[1], s[2], s[3], scale, plan)

        def suffix(sets: list = sets, plan: CascadePlan = plan) -> None:
            for q, k_cache, v_cache, meta, _ in sets:
                slots = plan.num_prefix_splits + plan.num_splits
                out = torch.empty((meta.num_seqs, q.shape[1], slots, q.shape[2]), dtype=torch.float32, device=DEVICE)
                lse = torch.empty((meta.num_seqs, q.shape[1], slots), dtype=torch.float32, device=DEVICE)
                cascade.launch_decode(out, out, lse, q, k_cache, v_cache, meta, scale, plan.num_splits,
                                      plan.min_partition, plan.decode_config, meta.common_prefix_len,
                                      plan.num_prefix_splits)

        whole_us, partials_us = (bench_graph(f, len(sets)) * 1e3 for f in (whole, partials))
        launch_decode = cascade.launch_decode
        cascade.launch_decode = lambda *args, **kwargs: None  # the partials without their suffix pass
        try:
            prefix_us = bench_graph(partials, len(sets)) * 1e3
        finally:
            cascade.launch_decode = launch_decode
        suffix_us = bench_graph(suffix, len(sets)) * 1e3
        merge = "suffix pass's merge" if plan.num_splits == 1 else "combine"
        print(f"  B={batch}: whole {whole_us:.1f} = prefix pass {prefix_us:.1f} + suffix pass {suffix_us:.1f} "
              f"+ {merge} {whole_us - partials_us:.1f} (the two passes unmerged {partials_us:.1f})", flush=True)
        del sets
        torch.cuda.empty_cache()


def run_cascade(sweep_plans: bool) -> int:
    ok = cascade_check()
    times = Table(f"Cascade attention, decode with a shared {CASCADE_PREFIX}-token prefix: microseconds per call "
                  "(CUDA graphs, inputs rotated past L2; lower is better, so ours/peer < 1 wins)", "us")
    rates = Table("The same as effective GB/s: the K+V bytes every sequence attends (prefix counted per sequence) "
                  "per second; SDPA's own bytes for its row", "GB/s")
    bench_cascade(times, rates)
    times.print()
    rates.print()
    cascade_passes()
    if sweep_plans:
        sweep_cascade()
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------- elementwise


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


SAMPLING_TEMPERATURE = 0.6
SAMPLING_BATCHES = [1, 64, 256]
SAMPLING_CHUNK_SWEEP = [2048, 4096, 8192, 16384]  # tokens per program (sample_triton's chunk_size)
SAMPLING_BLOCK_SWEEP = [1024, 2048, 4096]  # tokens per loop step (sample_triton's block)


def bench_sampling(table: Table) -> None:
    def params(batch: int, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> tuple:
        return (
            torch.full((batch,), temperature, device=DEVICE),
            torch.full((batch,), top_k, dtype=torch.int64, device=DEVICE),
            torch.full((batch,), top_p, device=DEVICE),
            torch.full((batch,), min_p, device=DEVICE),
            torch.arange(batch, device=DEVICE),
        )

    # as before: no hints, so sample_triton reads them with one host sync
    batch = 64
    logits = 4 * torch.randn(batch, VOCAB, device=DEVICE)
    for name, temperature, top_k, top_p in (("greedy", 0.0, 0, 1.0), ("T=0.8 top_k=50", 0.8, 50, 1.0),
                                            ("T=0.8 top_p=0.9", 0.8, 0, 0.9)):
        args = (logits, *params(batch, temperature, top_k, top_p))
        table.add(f"sample B={batch} V={VOCAB} {name}", 1e3 * bench(lambda a=args: sample_triton(*a)),
                  "sample_ref", 1e3 * bench(lambda a=args: sample_ref(*a)))

    def against_ref(case: str, args: tuple) -> None:
        table.add(case, 1e3 * bench(lambda: sample_triton(*args)), "sample_ref", 1e3 * bench(lambda: sample_ref(*args)))

    # with the hints the engine passes (use_top_p, max_top_k, use_min_p): no host sync
    temperature = SAMPLING_TEMPERATURE
    for batch in SAMPLING_BATCHES:
        logits = 4 * torch.randn(batch, VOCAB, device=DEVICE)
        greedy = (logits, *params(batch, 0.0), False, 0, False)
        table.add(f"sample B={batch} V={VOCAB} all greedy, hinted", 1e3 * bench(lambda a=greedy: sample_triton(*a)),
                  "torch.argmax", 1e3 * bench(lambda x=logits: x.argmax(dim=-1)))
        sampled = (logits, *params(batch, temperature), False, 0, False)
        against_ref(f"sample B={batch} V={VOCAB} T={temperature}, hinted", sampled)
        # use_min_p=None (the engine does not pass it yet) runs the min-p pass, which returns at once
        unknown = (logits, *params(batch, temperature), False, 0)
        table.add(f"sample B={batch} V={VOCAB} T={temperature}, use_min_p unknown",
                  1e3 * bench(lambda a=unknown: sample_triton(*a)), "use_min_p=False",
                  1e3 * bench(lambda a=sampled: sample_triton(*a)))
        against_ref(f"sample B={batch} V={VOCAB} T={temperature} min_p=0.05, hinted",
                    (logits, *params(batch, temperature, min_p=0.05), False, 0, True))
        # device time alone (no launch overhead), as against one torch.argmax pass over the same logits
        argmax_graph = 1e3 * bench_graph(lambda x=logits: x.argmax(dim=-1), 1)
        table.add(f"sample B={batch} V={VOCAB} T={temperature}, hinted, CUDA graph",
                  1e3 * bench_graph(lambda a=sampled: sample_triton(*a), 1), "torch.argmax, CUDA graph", argmax_graph)
        if QUICK or batch not in (1, 256):
            continue
        default = 1e3 * bench_graph(lambda a=sampled: sample_triton(*a), 1)
        for chunk_size in SAMPLING_CHUNK_SWEEP:
            ours = 1e3 * bench_graph(lambda a=sampled, c=chunk_size: sample_triton(*a, chunk_size=c), 1)
            table.add(f"sample B={batch} T={temperature} chunk_size={chunk_size}, CUDA graph", ours,
                      "default chunk_size", default)
        for block in SAMPLING_BLOCK_SWEEP:
            ours = 1e3 * bench_graph(lambda a=sampled, b=block: sample_triton(*a, block=b), 1)
            table.add(f"sample B={batch} T={temperature} block={block}, CUDA graph", ours, "default block", default)


PREFILL_SWEEP = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 32, 4, 4),
                 (64, 64, 4, 3), (256, 64, 8, 3)]
DECODE_SWEEP = [(64, 4, 3), (64, 4, 2), (64, 8, 3), (64, 2, 3), (32, 4, 3), (32, 2, 3), (16, 2, 3), (128, 4, 3),
                (128, 8, 3), (64, 2, 2), (32, 2, 2), (128, 4, 2), (64, 4, 1), (256, 8, 3), (256, 8, 2), (256, 4, 3)]
# (the engine's shapes: batch 256 at the throughput workload's ~500-1500, then batch 1 at short contexts; the large
# batches first, as a run cut short by a time limit keeps those)
DECODE_SWEEP_SHAPES = [(256, 512), (256, 1024), (256, 2048), (64, 2048),
                       (1, 128), (1, 256), (1, 384), (1, 512), (1, 8192)]


def sweep(what: str) -> None:
    """TFLOP/s and GB/s of alternative launch configurations, to choose prefill_config / decode_config."""
    if what in ("all", "prefill"):
        sweep_prefill()
    if what in ("all", "decode"):
        for batch, context in DECODE_SWEEP_SHAPES:
            sweep_decode(batch, context)
    if what in ("all", "rms_norm"):
        sweep_rms_norm()
    if what in ("all", "cascade"):
        sweep_cascade()


def sweep_prefill() -> None:
    batch, length = PREFILL_BATCH, PREFILL_LEN
    q = torch.randn(batch * length, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k4 = torch.randn(batch, NUM_KV_HEADS, length, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k_cache, v_cache, block_tables = paged_from_contiguous(k4, torch.randn_like(k4))
    meta = metadata([length] * batch, [length] * batch, block_tables)
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * batch * length * length / 2
    print(f"\n## Prefill {batch}x{length} configs (BLOCK_M, BLOCK_N, warps, stages); "
          f"default {prefill_config(HEAD_DIM, NUM_Q_HEADS // NUM_KV_HEADS, DTYPE)}")
    for config in PREFILL_SWEEP:
        run = lambda c=config: paged_prefill_triton(q, k_cache, v_cache, meta, HEAD_DIM**-0.5, config=c)  # noqa: E731
        try:
            print(f"  {config}: {flops / bench(run) / 1e9:.1f} TFLOP/s", flush=True)
        except Exception as error:  # a config that does not compile or fit
            print(f"  {config}: failed ({type(error).__name__}: {str(error)[:100]})", flush=True)


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


def sweep_decode(batch: int, context: int) -> None:
    k4 = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k_cache, v_cache, block_tables = paged_from_contiguous(k4, torch.randn_like(k4))
    if KV_CACHE_FP8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    meta = metadata([1] * batch, [context] * batch, block_tables)
    kv_bytes = 2 * k4.numel() * k_cache.element_size()  # (the bytes read: half as many from a float8 cache)
    default_splits = decode_num_splits(batch, NUM_KV_HEADS, context)
    default = decode_config(HEAD_DIM, DTYPE, k_cache.dtype, batch * NUM_KV_HEADS)
    print(f"\n## Decode B={batch} ctx={context}{' fp8 cache' if KV_CACHE_FP8 else ''} configs (BLOCK_N, warps, "
          f"stages) x splits; default {default} x {default_splits} (one cache: L2-resident when small)")
    for config in DECODE_SWEEP:
        results = []
        for splits in sorted({1, 2, 4, 8, 16, 32, default_splits}):
            if splits > max(context // 64, 1) and splits != default_splits:
                continue
            run = lambda c=config, n=splits: paged_decode_triton(  # noqa: E731
                q, k_cache, v_cache, meta, HEAD_DIM**-0.5, num_splits=n, config=c
            )
            try:
                results.append(f"{splits}: {kv_bytes / bench_graph(run, 1) / 1e6:.0f}")
            except Exception as error:  # a config that does not compile or fit
                results.append(f"{splits}: failed ({type(error).__name__})")
        print(f"  {config}: GB/s by number of splits  " + "  ".join(results), flush=True)


# ------------------------------------------------------------------------------------ skinny matmul (GEMV)

# (N, K) of the five products of a Llama-3.2-1B decode step. The projections are stored input-major on CUDA
# (model/loader.py) and called through F.linear; the tied LM head is the embedding [vocab, hidden], called
# as torch.matmul(hidden, weight.t()) (CausalLM.compute_logits).
GEMV_SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
               "lm_head": (128256, 2048)}
GEMV_BATCHES = [1, 2, 4, 8, 16, 32, 64]
GEMV_SWEEP_BATCHES = [1, 4, 16, 32, 64]
FUSED_BATCHES = GEMV_BATCHES  # (--batches)
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


def cublas_product(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product as the model calls it (through cuBLAS)."""
    if name == "lm_head":
        return lambda x, w: torch.matmul(x, w.t())
    return F.linear


def gemv_config(name: str, m: int) -> SkinnyConfig:
    n, k = GEMV_SHAPES[name]
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    return skinny_matmul_config(m, n, k, name == "lm_head", sms)


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


def _estimate_us(name: str) -> float:
    n, k = GEMV_SHAPES[name]
    return n * k * 2 / 3e6  # at 3 TB/s


def time_gemv(name: str, weights: list[torch.Tensor], x: torch.Tensor, config: SkinnyConfig | None) -> float:
    return graph_us(lambda: [skinny_matmul_triton(x, w, config) for w in weights], len(weights), _estimate_us(name))


def time_cublas(name: str, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    peer = cublas_product(name)
    return graph_us(lambda: [peer(x, w) for w in weights], len(weights), _estimate_us(name))


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


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


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
            error, peer_error = _relative_error(y, ref), _relative_error(peer(x, w), ref)
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
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

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


SPLIT_K_PARTS = (1, 2, 4, 8)


def bench_split_k(ceiling: float) -> None:
    """At 128 rows and more (the products cuBLAS keeps at 40-53% of the copy rate at 256 rows): the product cut
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
                                    len(ws), _estimate_us(name))
                    summed = graph_us(lambda xs=xs, ws=ws: [torch.bmm(xs, w, out_dtype=torch.float32).sum(0)
                                                            for w in ws], len(ws), _estimate_us(name))
                except (RuntimeError, TypeError) as error:  # (out_dtype needs a recent torch)
                    cells.append(f"S={parts}: failed ({type(error).__name__}: {str(error)[:60]})")
                    continue
                cells.append(f"S={parts}: {bare:.2f} ({100 * nbytes / bare / 1e3 / ceiling:.0f}%), + sum "
                             f"{summed:.2f}, err {err:.1e}")
            print(f"  {name} {n}x{k} M={m}: " + "; ".join(cells), flush=True)
        del weights
        torch.cuda.empty_cache()


def run_gemv(sweep_configs: bool) -> int:
    jobs: list[tuple[str, int, SkinnyConfig | None]] = [(name, m, None) for name in GEMV_SHAPES for m in GEMV_BATCHES]
    if sweep_configs:
        jobs += [(name, m, c) for name in GEMV_SHAPES for m in GEMV_SWEEP_BATCHES for c in gemv_candidates(name, m)]
    gemv_precompile(jobs)
    ok = gemv_check()
    ceiling = copy_ceiling()
    print(f"device-to-device copy (2 GiB): {ceiling:.0f} GB/s (read + written)", flush=True)
    results = bench_gemv(ceiling)
    bench_split_k(ceiling)
    if sweep_configs:
        sweep_gemv(results)
    return 0 if ok else 1


# ------------------------------------------------------------------------------------- fused decode kernels

FUSED_EPS = 1e-5


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
                    residual_error = _relative_error(out[1], ref_residual.double())
                    if rope is not None:  # the rows the step stored, ours against the reference's
                        slots = a["slots"]
                        ours_kv = torch.stack([a["k_cache"], a["v_cache"]]).flatten(1, 2)[:, slots]
                        ref_kv = torch.stack([rope.k_cache, rope.v_cache]).flatten(1, 2)[:, slots]
                        residual_error = max(residual_error, _relative_error(ours_kv, ref_kv.double()))
                    peer_out = peer(a, w)[0]
                else:
                    ref, residual_error = fused_linear_ref(a32["x"], w.float()), 0.0
                    peer_out = peer(a, w)
                error = _relative_error(first, ref.double())
                peer_error = _relative_error(peer_out, ref.double())
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
    return graph_us(lambda: [fn(inputs, w) for w in weights], len(weights), _estimate_us(name))


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


def run_fused(sweep_tiles: bool) -> int:
    gemv_precompile([(name, m, None) for name in GEMV_SHAPES for m in FUSED_BATCHES])  # (linear.py's, for its column)
    ok = fused_check()
    ceiling = copy_ceiling()
    print(f"device-to-device copy (2 GiB): {ceiling:.0f} GB/s (read + written)", flush=True)
    bench_fused(ceiling)
    if sweep_tiles:
        sweep_gemv_tiles(ceiling)
    return 0 if ok else 1


def main() -> int:
    global QUICK, FUSED_BATCHES, GEMV_BATCHES, GEMV_SWEEP_BATCHES, KV_CACHE_FP8, DECODE_SWEEP_SHAPES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer decode shapes, shorter timing runs")
    parser.add_argument("--sweep", nargs="?", const="all", choices=("all", "prefill", "decode", "rms_norm", "cascade"),
                        help="also time alternative launch configs (of one kernel family, if named)")
    parser.add_argument("--sweep-only", action="store_true", help="skip the tables, run the sweep alone")
    parser.add_argument("--gemv", action="store_true", help="the skinny matmul section alone (check + table)")
    parser.add_argument("--gemv-sweep", action="store_true", help="with --gemv: also time alternative configs")
    parser.add_argument("--cascade", action="store_true", help="the cascade attention section alone (check + table)")
    parser.add_argument("--fused", action="store_true", help="the fused decode kernels alone (check + table)")
    parser.add_argument("--sampling", action="store_true", help="the sampling table alone")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                        help="fp8: the decode attention table alone, on float8 e4m3 caches against ours on bf16 caches")
    parser.add_argument("--batches", type=lambda text: [int(m) for m in text.split(",")], default=None,
                        help="with --fused or --gemv: the row counts M (default 1,2,4,8,16,32,64; and those of "
                        "--gemv-sweep, default 1,4,16,32,64); with --sweep decode: only its shapes of these batches")
    args = parser.parse_args()
    QUICK = args.quick
    KV_CACHE_FP8 = args.kv_cache_dtype != "auto"
    if args.batches:
        FUSED_BATCHES = GEMV_BATCHES = GEMV_SWEEP_BATCHES = args.batches
        DECODE_SWEEP_SHAPES = [shape for shape in DECODE_SWEEP_SHAPES if shape[0] in args.batches]
    if not torch.cuda.is_available():
        print("benchmarks/bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    if args.fused:
        return run_fused(args.sweep is not None)
    if args.gemv or args.gemv_sweep:
        return run_gemv(args.gemv_sweep)
    if args.cascade:
        return run_cascade(args.sweep in ("all", "cascade"))
    if args.sampling:
        sampling = Table("Sampling (microseconds per call; lower is better, so ours/peer < 1 wins)", "us")
        bench_sampling(sampling)
        sampling.print()
        return 0
    if args.sweep and args.sweep_only:
        sweep(args.sweep)
        return 0
    ceiling = copy_ceiling()
    print(f"device-to-device copy (2 GiB): {ceiling:.0f} GB/s (read + written)", flush=True)

    if KV_CACHE_FP8:  # (the decode table alone)
        decode = Table("Decode attention on float8 e4m3 caches (GB/s of the bf16 K+V they stand for; CUDA graphs, "
                       "inputs rotated past L2)", "GB/s")
        bench_decode(decode, ceiling)
        decode.print()
        return 0
    prefill = Table("Prefill attention (TFLOP/s, causal FLOPs = 4*Hq*D*sum(L^2)/2)", "TFLOP/s")
    bench_prefill(prefill)
    decode = Table("Decode attention (GB/s of K+V attended; CUDA graphs, inputs rotated past L2)", "GB/s")
    bench_decode(decode, ceiling)
    elementwise = Table("Elementwise ops, bf16 (GB/s of the bytes each op must move)", "GB/s")
    bench_elementwise(elementwise, ceiling)
    sampling = Table("Sampling (microseconds per call; lower is better, so ours/peer < 1 wins)", "us")
    bench_sampling(sampling)

    print(f"\ncopy ceiling: {ceiling:.0f} GB/s")
    for table in (prefill, decode, elementwise, sampling):
        table.print()
    if args.sweep:
        sweep(args.sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
