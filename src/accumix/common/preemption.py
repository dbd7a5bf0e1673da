"""Pre-emption requests: a signal, or other code, asks the job to save at the next boundary.

Both backends' handlers (``acc.handle_preemption`` and the Trainer's JAX steps) hold a
``PreemptionWatch``; the ranks agree on it at the next window boundary (torch) or metrics read
(JAX), so every rank saves at the same step whichever of them was asked. Torch-free.

Only the main thread may install a signal handler, and Python runs handlers in the main thread
only. A loop that runs in another thread cannot catch a signal itself: Ray Train runs the
user's function in a thread of its worker process, whose main thread holds Ray's own SIGTERM
handler (it ends the worker). There the watch installs nothing and says so once, and a request
comes from:

* ``request_preemption()``: callable from any thread, or from a handler that the main thread
  installed (it only sets a flag);
* a check added with ``add_preemption_check(check)``: polled on every rank at each agreement
  point, every check each time (a cluster engine's own notice, such as Ray's
  ``get_preemption_info``, may be a barrier that every rank must call equally often).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

from accumix.errors import ConfigError

log = logging.getLogger("accumix")

# A plain flag, not a threading.Event: Event.set takes a lock, which a signal handler running
# in the main thread could find held by the main thread itself (a deadlock).
_requested = False
_checks: list[Callable[[], bool]] = []


def request_preemption() -> None:
    """Asks this process's pre-emption handler to save at the next window boundary (and stop),
    as if one of its signals had arrived. Safe from any thread and from a signal handler; a
    no-op while no handler is active, except that the request stays until one serves it."""
    global _requested
    _requested = True


def preemption_requested() -> bool:
    """Whether ``request_preemption()`` was called and not yet served."""
    return _requested


def add_preemption_check(check: Callable[[], bool]) -> Callable[[], None]:
    """Adds ``check`` to what every pre-emption agreement polls (on every rank, every time).

    Args:
        check: returns True when this process should save and stop.

    Returns:
        A function that removes the check again.
    """
    _checks.append(check)

    def remove() -> None:
        if check in _checks:
            _checks.remove(check)

    return remove


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def parse_signals(values: Iterable[int | str], *, key: str = "signals") -> tuple[int, ...]:
    """Signal numbers from numbers or names (``"SIGUSR1"``, ``"USR1"``, ``"usr1"``, ``10``).

    Raises:
        ConfigError: a name or number that is no signal here, naming the value.
    """
    out = []
    for value in values:
        text = str(value).strip()
        try:
            if text.lstrip("-").isdigit():
                sig = signal.Signals(int(text))
            else:
                name = text.upper()
                sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except (KeyError, ValueError):
            raise ConfigError(f"{key}: {value!r} is not a signal; use names such as SIGTERM, "
                              "SIGUSR1 (sbatch --signal=USR1@90) or their numbers") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"{key}: {sig.name} cannot be caught; use SIGTERM or SIGUSR1")
        out.append(int(sig))
    return tuple(dict.fromkeys(out))


class PreemptionWatch:
    """This process's reasons to stop soon: its signals (handlers installed when on the main
    thread), ``request_preemption()`` and the added checks.

    Args:
        signals: the signals that mean "save and stop"; their earlier handlers come back at
            ``close``.
        rank: this process's rank (only rank 0 says that signals go unwatched).
    """

    def __init__(self, signals: Iterable[int], *, rank: int = 0) -> None:
        self.signals = tuple(signals)
        self._signalled = False
        self._previous: dict[int, Any] = {}
        self.active = True
        self.on_main_thread = threading.current_thread() is threading.main_thread()
        if self.on_main_thread:
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.signals}
        elif self.signals and rank == 0:
            names = ", ".join(signal_name(s) for s in self.signals)
            log.info("pre-emption: the loop runs off the main thread (thread %r), where %s "
                     "cannot be caught; a pre-emption is saved when requested "
                     "(accumix.request_preemption(), or a cluster engine's notice)",
                     threading.current_thread().name, names)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True  # only a flag: the save needs every rank at the same boundary

    @property
    def signalled(self) -> bool:
        """Whether one of the signals arrived and no save has served it yet."""
        return self._signalled

    def requested(self) -> bool:
        """Whether this process should stop: polls every added check (each call, all of them,
        so that checks which are barriers are called equally often on every rank)."""
        polled = [bool(check()) for check in list(_checks)]
        return self._signalled or _requested or any(polled)

    def served(self) -> None:
        """The save was made: the signal and any pending request are consumed."""
        global _requested
        self._signalled = False
        _requested = False

    def close(self) -> None:
        """Puts the earlier signal handlers back; the watch is no longer active."""
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._previous = {}
        self.active = False
