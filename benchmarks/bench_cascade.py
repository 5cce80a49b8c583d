"""Cascade attention (tinyvllm/ops/cascade_attention.py) on the GPU: decode batches of 8-256 sequences sharing a
1,024-token prefix of blocks (as the prefix cache gives them), each with its own 64-192 tokens.

First a bf16 correctness check against the float32 reference (and beside the plain paged decode kernel); then
microseconds per call and effective GB/s (the K+V bytes the plain kernel reads, the prefix counted per sequence)
against the plain paged decode kernel on the same blocks and against SDPA flash on contiguous KV of the mean length,
in CUDA graphs with the inputs rotated past the L2 cache; then each of cascade attention's passes alone.
The exit status is 1 where the check fails.

    python benchmarks/bench_cascade.py [--quick] [--sweep [--sweep-only]]

--sweep also times other prefix splits, prefix row tiles and decode tiles (cascade_plan's alternatives);
--sweep-only runs that sweep alone.
"""

from __future__ import annotations

import dataclasses
import math
import sys

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
    bench_graph,
    kernel_parser,
    parse_on_gpu,
    sdpa,
)
from torch.nn.attention import SDPBackend

from tinyvllm.ops import kv_pool
from tinyvllm.ops.attention import paged_attention_ref, paged_attention_triton
from tinyvllm.ops.cascade_attention import (
    CascadePlan,
    cascade_attention_triton,
    cascade_plan,
    cascade_prefix_config,
)

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


def main() -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time alternative plans and tiles")
    parser.add_argument("--sweep-only", action="store_true", help="with --sweep: skip the check and the tables")
    args = parse_on_gpu(parser)
    if args.sweep and args.sweep_only:
        sweep_cascade()
        return 0
    ok = cascade_check()
    times = Table(f"Cascade attention, decode with a shared {CASCADE_PREFIX}-token prefix: microseconds per call "
                  "(CUDA graphs, inputs rotated past L2; lower is better, so ours/peer < 1 wins)", "us")
    rates = Table("The same as effective GB/s: the K+V bytes every sequence attends (prefix counted per sequence) "
                  "per second; SDPA's own bytes for its row", "GB/s")
    bench_cascade(times, rates)
    times.print()
    rates.print()
    cascade_passes()
    if args.sweep:
        sweep_cascade()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
