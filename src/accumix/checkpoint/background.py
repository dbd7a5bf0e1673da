"""Saves behind the loop: at most one in flight, its errors raised at the next save or at end.

``save_state(..., background=True)`` returns once the state is staged (copied to host memory by
``torch.distributed.checkpoint.async_save``); a thread of this module then waits for DCP's
write, writes the rest and publishes, agreeing with the other ranks over a process group of its
own (gloo, made once per run: the loop's collectives on the default group go on meanwhile).

At most one save is in flight: the next ``save_state`` (background or not), ``load_state``,
``wait_for_save`` and ``end`` first wait for it (logged when they have to wait), and raise its
error on every rank, alike (one all-gather over the default group: a rank whose write failed
and one whose write succeeded stop together). A crash or a SIGKILL mid-write publishes nothing:
``latest`` moves only in the thread's last step.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from accumix.errors import CheckpointError
from accumix.runtime import fault

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

log = logging.getLogger("accumix")


@dataclass(kw_only=True, eq=False)
class PendingSave:
    """One save being written behind the loop."""

    step_dir: Any
    started: float = field(default_factory=time.perf_counter)
    error: str | None = None
    thread: threading.Thread | None = None

    def run(self, work: Callable[[], None]) -> None:
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


def start(run: RunState, step_dir: Any, work: Callable[[], None]) -> PendingSave:
    """Runs ``work`` (the write and the publish of ``step_dir``) in the background."""
    pending = PendingSave(step_dir=step_dir)
    run.pending_save = pending
    pending.run(work)
    return pending


def finish(run: RunState, why: str) -> Any:
    """Waits for the save in flight, if any (collective when there is one anywhere: every
    rank calls it at the same point). Returns the step directory it published, or None.

    Raises:
        CheckpointError: it failed on some rank (every rank raises, naming that rank).
    """
    pending: PendingSave | None = run.pending_save
    if pending is None:
        return None
    run.pending_save = None
    assert pending.thread is not None
    if pending.thread.is_alive():
        if run.is_main_process:
            log.info("%s waits for the background save of %s (at most one in flight)",
                     why, pending.step_dir)
        with fault.phase(run, f"{why}, waiting for the background save of {pending.step_dir}"):
            pending.thread.join()
    with fault.phase(run, f"{why}, checking the background save"):
        errors = run.strategy.all_gather_object(pending.error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"the background save of {pending.step_dir} failed on rank "
                              f"{rank}: {message}; the previous checkpoint is still the latest")
    return pending.step_dir


def process_group(run: RunState) -> Any:
    """The checkpoint threads' own gloo process group (None without a process group), made at
    the first background save (collective: every rank is in ``save_state`` then)."""
    if not (dist.is_available() and dist.is_initialized() and run.world_size > 1):
        return None
    if run.checkpoint_group is None:
        kwargs = ({"timeout": datetime.timedelta(seconds=run.timeout)}
                  if run.timeout else {})
        run.checkpoint_group = dist.new_group(backend="gloo", **kwargs)
    return run.checkpoint_group
