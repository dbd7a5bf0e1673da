"""DataLoader workers that outlive a pre-emption signal until their rank has saved.

A scheduler's signal reaches more than the rank: torchrun's agent forwards it with
``os.killpg`` to each rank's process group, which holds the rank's forked DataLoader workers,
and SLURM signals every process of the job. torch's workers die of SIGTERM (its worker signal
handler re-raises it), the rank's next batch then raises ``DataLoader worker (pid ...) is killed
by signal: Terminated``, and the save the rank was about to make at its next window boundary
never happens (issue 38).

So while a pre-emption handler is armed in a rank (``guard``), the workers it starts block
its signals and a thread of theirs takes each one (``sigwaitinfo``, which names the sender):
a signal from anyone else (the agent, the scheduler, a ``kill`` of the whole group) is left to
the rank, which saves and then shuts its workers down as usual; a SIGTERM from the worker's own
parent (the loader's ``terminate()`` of a worker that did not stop in time) still ends it, as
torch's handler does. Workers of a rank without a handler keep torch's behaviour.

Torch-free (``signal``, ``threading``): the rank's side (``fault``) and the loader's
(``data.loader``) share it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

_guarded: set[int] = set()  # the signals this process's pre-emption handler takes


def guard(signals: Iterable[int]) -> None:
    """Workers started from now on survive ``signals`` sent by anyone but their rank."""
    _guarded.update(int(s) for s in signals)


def release(signals: Iterable[int]) -> None:
    """Workers started from now on get ``signals`` as torch's would (the handler closed)."""
    _guarded.difference_update(int(s) for s in signals)


def guarded() -> tuple[int, ...]:
    """The signals workers started now would survive."""
    return tuple(sorted(_guarded))


class WorkerInit:
    """A DataLoader's ``worker_init_fn`` that guards the worker (see the module), then calls
    the user's.

    Args:
        user_fn: the loader's own ``worker_init_fn``, or None.
    """

    def __init__(self, user_fn: Callable[[int], Any] | None) -> None:
        self.user_fn = user_fn
        # A forked worker reads the rank's module state as it was at the fork; a spawned one
        # gets the signals pickled with this object when the rank starts it.
        self.signals: tuple[int, ...] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"user_fn": self.user_fn, "signals": guarded()}

    def __call__(self, worker_id: int) -> None:
        signals = guarded() if self.signals is None else self.signals
        if signals:
            survive_others(signals)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def with_guard(user_fn: Callable[[int], Any] | None) -> WorkerInit:
    """``user_fn`` wrapped in a ``WorkerInit`` (once: an already wrapped one is returned)."""
    return user_fn if isinstance(user_fn, WorkerInit) else WorkerInit(user_fn)


def survive_others(signals: tuple[int, ...]) -> bool:
    """In a worker: ``signals`` from anyone but the parent are ignored, a SIGTERM from the
    parent ends the worker (exit 0, torch's worker handler's answer to its loader). Only from
    the worker's main thread, before it starts threads of its own (they inherit the blocked
    mask).

    Returns:
        Whether the guard is on (not where ``sigwaitinfo`` is missing, e.g. macOS).
    """
    if not hasattr(signal, "sigwaitinfo"):
        return False
    parent, wanted = os.getppid(), set(signals)
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(wanted)
            if info.si_signo == signal.SIGTERM and info.si_pid == parent:
                os._exit(0)

    threading.Thread(target=take, name="accumix-worker-signals", daemon=True).start()
    return True
