"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels.

At batch 1 a decode step is about ten launch-bound kernels per layer, so the time between two kernels is
part of the step's. A kernel launched with PDL may be scheduled while the kernel before it on the stream
is still running: it waits (griddepcontrol.wait) for that kernel to finish, and for its writes to be
visible, before it stores anything or reads what that kernel writes, then lets the next kernel be scheduled in
turn (launch_dependents). So when a kernel starts, the kernel two before it has finished (ours all wait, in
every program; cuBLAS's kernels launch without PDL): what only earlier kernels or the host wrote (weights, the
batch's layout, older tokens' K/V) may be read before the wait. Results are those of plain launches; only the
launch latency and those reads overlap the kernel before, which shortens a batch-1 decode graph (figures, PDL
on and off: benchmarks/RESULTS.md).
cuBLAS kernels launch as before."""

from __future__ import annotations

import functools
import os

import torch

from tinyvllm.ops.triton_import import tl, triton

gdc_wait = gdc_launch_dependents = None
if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # (a Triton without grid dependency control)
        pass

_OFF: dict = {"USE_PDL": False}
_ON: dict = {"USE_PDL": True, "launch_pdl": True}


@functools.cache
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_ptx(t: torch.Tensor) -> bool:
    """Whether Triton kernels on t's device run compiled PTX, which inline PTX (griddepcontrol here, lg2.approx in
    ops/sampling.py) needs: a CUDA tensor, outside Triton's interpreter (which runs kernels as Python)."""
    return t.is_cuda and not _interpreting()


@functools.cache
def _supported(device_index: int) -> bool:
    if gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict:
    """Launch options for a kernel taking a USE_PDL constexpr and starting with pdl_wait(USE_PDL):
    PDL on a Hopper-or-later GPU, plain launches elsewhere."""
    return _ON if runs_ptx(t) and _supported(t.device.index or 0) else _OFF


pdl_wait = prefetch_l2 = None  # (device functions: where Triton is not imported, names the kernels' modules import)
if triton is not None:

    @triton.jit
    def pdl_wait(USE_PDL: tl.constexpr):
        """A PDL kernel's wait for the kernel before (before its first store and its first read of what that kernel
        writes), then the next kernel may start."""
        if USE_PDL:  # only ever True where gdc_wait was imported (pdl_options)
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, USE_PDL: tl.constexpr):
        """Before pdl_wait: have L2 fetch the lines at ptrs (a tensor of pointers, one per line wanted), so that the
        loads after the wait find them there instead of in HBM. Safe even for lines the kernel before is writing:
        a prefetch fills L2 only, and L2 is where every SM's writes go. Nothing without PDL (nor under the
        interpreter, which runs no PTX)."""
        if USE_PDL:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
