"""tinyvllm's sampling kernel (tinyvllm/ops/sampling.py) on the GPU at vocabulary 128256, batch 1/64/256: greedy,
temperature, top-k/top-p/min-p, with and without the hints the engine passes (which spare a host sync), eager and in
a CUDA graph. Microseconds per call against sample_ref (the torch reference) or torch.argmax in the same run (lower
is better, so ours/peer < 1 wins).

    python benchmarks/bench_sampling.py [--quick]

Without --quick it also times other chunk sizes (tokens per program) and blocks (tokens per loop step) at batch 1
and 256, against the defaults.
"""

from __future__ import annotations

import sys

import kernels_common
import torch
from kernels_common import DEVICE, VOCAB, Table, bench, bench_graph, kernel_parser, parse_on_gpu

from tinyvllm.ops.sampling import sample_ref, sample_triton

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
        if kernels_common.QUICK or batch not in (1, 256):
            continue
        default = 1e3 * bench_graph(lambda a=sampled: sample_triton(*a), 1)
        for chunk_size in SAMPLING_CHUNK_SWEEP:
            ours = 1e3 * bench_graph(lambda a=sampled, c=chunk_size: sample_triton(*a, chunk_size=c), 1)
            table.add(f"sample B={batch} T={temperature} chunk_size={chunk_size}, CUDA graph", ours,
                      "default chunk_size", default)
        for block in SAMPLING_BLOCK_SWEEP:
            ours = 1e3 * bench_graph(lambda a=sampled, b=block: sample_triton(*a, block=b), 1)
            table.add(f"sample B={batch} T={temperature} block={block}, CUDA graph", ours, "default block", default)


def main() -> int:
    parse_on_gpu(kernel_parser(__doc__, "shorter timing runs, without the chunk-size and block sweep"))
    sampling = Table("Sampling (microseconds per call; lower is better, so ours/peer < 1 wins)", "us")
    bench_sampling(sampling)
    sampling.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
