"""The heap as a test finds it, out of the garbage collector's reach while the test runs.

``micro_batch_size="auto"`` collects garbage around every probe and walks ``gc.get_objects()``
for the CPU tensors alive (``accumix.memory.peak_memory``): in a test process holding every
imported module (torch, jax, deepspeed, pytest's own), each such pass costs ~0.5 s and a test
makes dozens. ``gc.freeze()`` moves what exists before the test into the permanent generation,
which neither ``gc.collect()`` nor ``gc.get_objects()`` visits: the probe then sees exactly the
objects the test made (its model, optimizer, batches), as in a fresh process, in microseconds.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freezes the objects alive now for the block; gives them back to the collector after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
