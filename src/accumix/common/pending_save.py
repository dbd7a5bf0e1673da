"""One checkpoint being written behind the loop (a thread), shared by both backends.

Backend-free (no torch, no JAX): ``accumix.checkpoint.background`` (torch) and
``accumix.jax.checkpoint_save`` both run their background write in a ``PendingSave``; each
waits for it and raises its error at the next save or at ``end``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("accumix")


@dataclass(kw_only=True, eq=False)
class PendingSave:
    """One save being written behind the loop.

    Args:
        step_dir: the step directory it publishes.
    """

    step_dir: Any
    started: float = field(default_factory=time.perf_counter)
    error: str | None = None
    thread: threading.Thread | None = None

    def run(self, work: Callable[[], None]) -> None:
        """Starts ``work`` (the write and the publish) in a thread; its error, if any, is kept
        in ``error`` (and logged) for the next save or ``end`` to raise."""
        def target() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - raised at the next save or at end
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("the background save of %s failed: %s", self.step_dir,
                          self.error)

        # Not a daemon: a script that ends right after a save still publishes it.
        self.thread = threading.Thread(target=target, name="accumix-save", daemon=False)
        self.thread.start()
