"""Triton, where its kernels can run: with a CUDA build of torch (a GPU machine), or under Triton's interpreter
(TRITON_INTERPRET set, as the tests set it). On a CPU-only machine the engine runs the references, and importing
Triton would only cost time and memory (~70 MB resident). triton and tl are None where it is not imported; the ops
modules define their kernels only where it is."""

from __future__ import annotations

import os
from typing import Any

import torch

triton: Any = None
tl: Any = None
if torch.version.cuda is not None or torch.version.hip is not None or "TRITON_INTERPRET" in os.environ:
    try:
        import triton
        import triton.language as tl
    except ImportError:  # (the references serve where Triton is missing)
        triton = tl = None
