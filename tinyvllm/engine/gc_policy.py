"""How the engine sets Python's cyclic garbage collector while it serves.

A step allocates many small objects that live as long as a request (its token lists, outputs, per-step columns),
and with Python's default thresholds a young-generation collection runs every 700 allocations and walks them
again; an older-generation collection also walks everything alive before the engine started (the model's modules,
the CUDA graphs, the libraries: ~190k objects, tens of milliseconds a walk). So while the engine serves, the
young generation is collected every YOUNG_THRESHOLD allocations, and what was alive before is frozen out of the
collector's sight (gc.freeze, as vLLM's engine core does). Reference counting still frees everything that is not
in a cycle at once; only cycles wait longer.

- The server's engine core process serves for its whole life: `freeze_for_life()` once it is built.
- `LLM.generate` serves for one call, in a process that may build engine after engine: `serving()` holds the
  settings for the call and restores them after (unfreezing, so that nothing frozen outlives it)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 10_000  # allocations between young-generation collections (Python's default: 700)


def freeze_for_life() -> None:
    """Collect, freeze what is alive, and keep the larger young threshold: for a process that serves until it
    exits."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])


@contextmanager
def serving() -> Iterator[None]:
    """The serving settings for the body, restored after. Freezing and unfreezing move whole generation lists
    (no walk), so this costs nothing; it freezes only if nothing else has (a caller's own gc.freeze() is left
    as it was). Nested uses are harmless: the inner finds the heap frozen and the threshold set."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(threshold[0], YOUNG_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()
