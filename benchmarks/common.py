"""Shared by the GPU benchmarks: the Llama-3.2-1B-shaped random-weight model of docs/benchmarks.md."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The benchmark model (docs/benchmarks.md) lives in the package, so that tests/ can build the same one.
from tinyvllm.entrypoints.bench_offline import (  # noqa: E402,F401
    LLAMA_1B,
    LLAMA_TINY,
    SHAPES,
    random_llama,
    random_llama_1b,
    random_llama_tiny,
    random_shape,
)


def cuda_ms(fn: Any, reps: int = 50) -> float:
    """Milliseconds of GPU time per call of fn (which only enqueues work), by CUDA events over `reps` calls
    after one warm-up call."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def attention_metadata(query_lens: list[int], context_lens: list[int], block_tables: Any) -> Any:
    from tinyvllm.ops import AttentionMetadata

    return AttentionMetadata.for_cached(query_lens, context_lens, block_tables)


def commit() -> str:
    """The commit measured (TINYVLLM_COMMIT where the tree travelled without its .git)."""
    if os.environ.get("TINYVLLM_COMMIT"):
        return os.environ["TINYVLLM_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def require_gpu(parser: Any, small: bool | None = None, what: str = "the Llama-3.2-1B-shaped model") -> None:
    """Refuse, with a message, to run a GPU benchmark where torch sees no CUDA GPU (it would build and run the 1B
    model on the CPU for a long while, without a word). small: the script's --small flag, the CPU's way to run it
    (None: the script has none); what: what the benchmark times, for the message."""
    import torch

    if torch.cuda.is_available() or small:
        return
    hint = ("; on a CPU, --small runs it on a tiny random Llama (docs/benchmarks.md lists the CPU runs)"
            if small is not None else "; it has no CPU mode (docs/benchmarks.md lists the CPU runs)")
    parser.error(f"this benchmark times {what} on a CUDA GPU, and torch sees none" + hint)


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class GcWatch:
    """Python's cyclic collections while it is open (`with GcWatch() as gc_watch:`): how many of each generation
    and their pause in total, so that a run's figures say whether a collection landed inside it."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.ms = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        import time

        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._start) * 1e3

    def __enter__(self) -> GcWatch:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def __str__(self) -> str:
        return f"GC: {'/'.join(map(str, self.counts))} collections (generation 0/1/2), {self.ms:.1f} ms"
