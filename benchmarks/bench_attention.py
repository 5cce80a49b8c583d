"""tinyvllm's paged attention kernels (tinyvllm/ops/attention.py) on the GPU, each beside its peer in the same run:

- prefill (8 x 2048 causal, Llama-3.2-1B heads): TFLOP/s vs torch SDPA (flash, cuDNN), with the relative
  difference of the outputs;
- decode (paged, block size 16, batch 1/64/256 at context 512/2048/8192): GB/s of K+V attended vs SDPA flash on
  contiguous KV (an upper bound for a paged kernel) and vs the device-to-device copy ceiling measured here; inputs
  rotated past the L2 cache, in CUDA graphs as the engine runs decode.

    python benchmarks/bench_attention.py [--quick] [--sweep [prefill|decode] [--sweep-only]] [--batches 256,64]
    python benchmarks/bench_attention.py --kv-cache-dtype fp8 [--quick]   (decode alone: float8 vs bf16 caches,
                                                                           and each in the other pool layout)

--sweep also times alternative launch configurations (tiles, warps, stages and decode splits), to choose
prefill_config / decode_config; naming one kernel sweeps only it, --sweep-only skips the tables, and --batches keeps
the decode sweep's shapes of those batches. With --kv-cache-dtype fp8 the sweep runs only with --sweep-only, its decode
tiles then on float8 caches (GB/s of the bytes read).
"""

from __future__ import annotations

import math
import sys

import kernels_common
import torch
from common import attention_metadata as metadata
from kernels_common import (
    BLOCK_SIZE,
    DEVICE,
    DTYPE,
    HEAD_DIM,
    L2_BYTES,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    Table,
    bench,
    bench_graph,
    copy_ceiling,
    int_list,
    kernel_parser,
    parse_on_gpu,
    sdpa,
)
from torch.nn.attention import SDPBackend

from tinyvllm.ops import kv_pool
from tinyvllm.ops.attention import (
    decode_config,
    decode_num_splits,
    paged_attention_triton,
    paged_decode_triton,
    paged_prefill_triton,
    prefill_config,
)

PREFILL_BATCH, PREFILL_LEN = 8, 2048
DECODE_BATCHES, DECODE_CONTEXTS = [1, 64, 256], [512, 2048, 8192]
# --kv-cache-dtype fp8: the decode attention table reads float8 e4m3 caches (kv_cache_dtype="fp8")
KV_CACHE_FP8 = False


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
    if kernels_common.QUICK:
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


# -------------------------------------------------------------------------------------------------- sweeps

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


def main() -> int:
    global KV_CACHE_FP8, DECODE_SWEEP_SHAPES
    parser = kernel_parser(__doc__, "fewer decode shapes, shorter timing runs")
    parser.add_argument("--sweep", nargs="?", const="all", choices=("all", "prefill", "decode"),
                        help="also time alternative launch configs (of one kernel, if named)")
    parser.add_argument("--sweep-only", action="store_true", help="skip the tables, run the sweep alone")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                        help="fp8: the decode attention table alone, on float8 e4m3 caches against ours on bf16 caches")
    parser.add_argument("--batches", type=int_list, default=None,
                        help="with --sweep decode: only its shapes of these batches")
    args = parse_on_gpu(parser)
    KV_CACHE_FP8 = args.kv_cache_dtype != "auto"
    if args.batches:
        DECODE_SWEEP_SHAPES = [shape for shape in DECODE_SWEEP_SHAPES if shape[0] in args.batches]
    if args.sweep and args.sweep_only:
        sweep(args.sweep)
        return 0
    ceiling = copy_ceiling()
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

    print(f"\ncopy ceiling: {ceiling:.0f} GB/s")
    for table in (prefill, decode):
        table.print()
    if args.sweep:
        sweep(args.sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
