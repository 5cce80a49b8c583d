"""A serving process's heap, frozen after start-up."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """What is alive when a serving process has started lives as long as the process (the model, the graphs, the
    libraries' objects): frozen out of the cyclic collector's sight, as vLLM does, so that a full collection walks
    only what serving made (an API server's full collection of its start-up heap holds up every request for tens
    of milliseconds). Unfrozen at exit: else Triton's extension reports what freeze() kept as
    leaked, thirty lines at every stop."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
