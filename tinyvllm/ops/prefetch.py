"""Weights into L2 ahead of the product that reads them, while HBM would idle.

At batch 1 a decoder layer's products stream weights from HBM, but between qkv_proj and o_proj the step runs
attention over a few kilobytes of K/V: HBM waits on a chain of small kernels. prefetch_l2 asks L2 for the next
products' first weights there (the tensors given, each whole: a contiguous view), so that o_proj and the first
programs of gate_up find them in L2. The lines are prefetched before the kernel's PDL wait (ops/pdl.py), so they
stream under the tail of the kernel before it; nothing is written, and the op is a no-op without PDL (before
Hopper, TINYVLLM_PDL=0, or the interpreter) and on the CPU (the reference).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine imports the reference on machines without Triton
    triton = None

from tinyvllm.ops.pdl import pdl_options, pdl_wait, prefetch_l2

_LINE_BYTES = 128  # an L2 line (the prefetch's granule)
_LINES_PER_PROGRAM = 1024  # 8 prefetches a thread at 4 warps
MAX_TENSORS = 3


def prefetch_l2_ref(first: torch.Tensor, *rest: torch.Tensor) -> None:
    """Nothing to compute: on the CPU (and in the reference) the prefetch is a no-op."""


if triton is not None:

    # Program p asks for lines p * LINES ... (p + 1) * LINES - 1 of the three ranges laid end to end (n_first lines
    # from first_ptr, ELEMS elements a line, then the second's, the third's; lines past the end repeat its last).
    @triton.jit
    def _prefetch_kernel(first_ptr, n_first, second_ptr, n_second, third_ptr, n_third, ELEMS: tl.constexpr,
                         LINES: tl.constexpr, USE_PDL: tl.constexpr):
        line = tl.program_id(0) * LINES + tl.arange(0, LINES)
        line_2 = line - n_first
        line_3 = line_2 - n_second
        ptr = tl.where(line < n_first, first_ptr + line.to(tl.int64) * ELEMS,
                       tl.where(line_2 < n_second, second_ptr + line_2.to(tl.int64) * ELEMS,
                                third_ptr + tl.minimum(line_3, n_third - 1).to(tl.int64) * ELEMS))
        prefetch_l2(ptr, USE_PDL)
        pdl_wait(USE_PDL)


def prefetch_l2_triton(first: torch.Tensor, *rest: torch.Tensor) -> None:
    """Launch _prefetch_kernel over up to MAX_TENSORS contiguous tensors of one dtype (with PDL only)."""
    tensors = (first, *rest)
    options = pdl_options(first)
    if not options["USE_PDL"]:
        return
    assert len(tensors) <= MAX_TENSORS and all(t.is_contiguous() and t.dtype == first.dtype for t in tensors)
    elems = max(1, _LINE_BYTES // first.element_size())
    ranges = [(t, triton.cdiv(t.numel(), elems)) for t in tensors]
    ranges += [(first, 0)] * (MAX_TENSORS - len(ranges))
    total = sum(lines for _, lines in ranges)
    if total == 0:
        return
    ranges[-1] = (ranges[-1][0], max(ranges[-1][1], 1))  # (the kernel clamps into the last range)
    _prefetch_kernel[(triton.cdiv(total, _LINES_PER_PROGRAM),)](
        *[arg for t, lines in ranges for arg in (t, lines)], ELEMS=elems, LINES=_LINES_PER_PROGRAM, num_warps=4,
        **options)
