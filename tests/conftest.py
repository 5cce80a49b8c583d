"""Shared test setup. TRITON_INTERPRET must be set before triton is first imported, so that the
Triton kernels run on CPU tensors under the interpreter (see shared/TOOLCHAIN.md)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
