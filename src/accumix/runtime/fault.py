"""Faults: name the rank that died or hangs, stop the others, and save on pre-emption.

* **Watchdog.** In a distributed run each rank's daemon thread writes a heartbeat and its
  progress (window index, micro-step) to the job's TCP store about once a second; the main
  thread pays nothing. Between windows, the collectives accumix adds (a checkpoint's phases,
  the pre-emption check) count as progress too: a rank stalled after a boundary is behind one
  already inside ``save_state``. gloo's errors name no rank ("Timed out waiting 3000ms for recv",
  "Connection closed by peer [127.0.0.1]:26331"), so when an exception from a collective
  reaches the top of the script, the rank reads every heartbeat twice and says which rank
  stopped (its heartbeat stopped: died or frozen) or is stuck (alive, behind the others). Any
  rank that dies of an uncaught exception publishes it, and the other ranks' watchdogs stop
  their processes within a heartbeat: no rank is left hanging on a dead job, with or without
  torchrun's agent.
* **Pre-emption.** ``acc.handle_preemption(run_dir)`` turns SIGTERM (or a request from other
  code: ``accumix.common.preemption``) into a checkpoint at the next window boundary (the ranks
  agree with one scalar all-reduce per window), then exit 0.
* **Orphans.** A worker that torchrun's agent started (``accumix launch``, ``accumix train``)
  exits within a second of the agent's death: a SIGKILLed launcher cannot forward anything,
  and its workers would otherwise train on beside the next job in the same run directory.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from accumix.common import preemption_report, worker_signals
from accumix.common.locations import location
from accumix.common.preemption import PreemptionWatch
from accumix.common.slurm_requeue import requeue, requeue_target
from accumix.errors import ConfigError

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

_COLLECTIVE_HINTS = ("gloo", "nccl", "timed out", "timeout", "connection closed",
                     "connection reset", "broken pipe", "process group")
_watchdog: Watchdog | None = None
_launcher_watch: threading.Thread | None = None


class Watchdog:
    """This rank's heartbeat thread and the failure diagnosis (one per process).

    Args:
        store: the job's key-value store (a dedicated client with a short timeout).
        rank: this rank.
        world_size: the number of ranks.
        interval: seconds between heartbeats.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self._watched: weakref.ref[RunState] | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="accumix-watchdog", daemon=True)
        self._thread.start()

    def watch(self, run: RunState) -> None:
        """Reports ``run``'s progress from now on (the newest Accelerator's of the process)."""
        self._watched = weakref.ref(run)

    def progress(self) -> tuple[int, int, int]:
        """(windows finished, micro-steps begun in the next one, accumix collectives entered
        between windows): grows with every micro-step and every such collective."""
        run = self._watched() if self._watched is not None else None
        if run is None:
            return (0, 0, 0)
        window, entered = run.window, run.sync_points
        if window.micro_step == 0:  # between windows (also after a boundary that raised)
            return (window.index + 1, 0, entered)
        return (window.index, window.micro_step, entered)

    def _label(self) -> str:
        run = self._watched() if self._watched is not None else None
        return run.sync_label if run is not None else ""

    def _beat(self) -> None:
        self._seq += 1
        index, micro, entered = self.progress()
        self.store.set(f"hb/{self.rank}", f"{self._seq} {index} {micro} {entered} {self._label()}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                if self.store.check(["failed"]):
                    failed = self.store.get("failed").decode()
                    if not failed.startswith(f"{self.rank}:") and not self._stop.is_set():
                        rank, _, message = failed.partition(":")
                        _die(f"accumix: rank {rank} failed ({message.strip()}); stopping rank "
                             f"{self.rank} too")
            except Exception:  # noqa: BLE001 - the store's host exited: the launcher cleans up
                return

    def finish(self) -> None:
        """This rank is done: peers must not count it as dead; the thread stops."""
        self._stop.set()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - nothing left to tell
            pass

    def publish_failure(self, message: str) -> None:
        try:
            self.store.compare_set("failed", "", f"{self.rank}: {message}")
        except Exception:  # noqa: BLE001
            pass

    def _heartbeats(self) -> dict[int, tuple[int, tuple[int, int, int], str]]:
        """rank -> (heartbeat number, progress, the accumix collective it is in or "")."""
        beats = {}
        for rank in range(self.world_size):
            key = f"hb/{rank}"
            if self.store.check([key]) and not self.store.check([f"done/{rank}"]):
                seq, index, micro, entered, *label = self.store.get(key).decode().split(" ", 4)
                beats[rank] = (int(seq), (int(index), int(micro), int(entered)),
                               label[0] if label else "")
        return beats

    def diagnose(self) -> str:
        """Which rank is to blame for a failed collective, from two rounds of heartbeats."""
        try:
            first = self._heartbeats()
            time.sleep(2.5 * self.interval)
            second = self._heartbeats()
        except Exception as exc:  # noqa: BLE001
            return f"the job's store is unreachable ({exc}); rank 0 or the launcher has exited"
        silent = sorted(r for r in first if r != self.rank
                        and (r not in second or second[r][0] == first[r][0]))
        alive = {r: b[1] for r, b in second.items() if r not in silent}
        labels = {r: b[2] for r, b in second.items() if r not in silent}
        alive[self.rank], labels[self.rank] = self.progress(), self._label()
        lead = max(alive.values())
        leader = min(r for r, p in alive.items() if p == lead)
        behind = sorted(r for r, p in alive.items() if p < lead)
        parts = []
        if silent:
            parts.append(f"rank(s) {_list(silent)} stopped responding (no heartbeat for "
                         f"{2.5 * self.interval:.1f}s: the process died or is frozen; its own "
                         "log or the launcher's exit summary says why)")
        if behind:
            where = ", ".join(f"rank {r} at {_where(alive[r], labels[r])}" for r in behind)
            parts.append(f"rank(s) {_list(behind)} are alive but stuck behind ({where}) while "
                         f"rank {leader} reached {_where(lead, labels[leader])}: a hang outside "
                         "accumix, or a collective they skipped")
        if not parts:
            parts.append(f"every rank is alive at {_where(lead, labels[leader])}: the network "
                         "failed, or the ranks called different collectives")
        return "; ".join(parts)


def _where(progress: tuple[int, int, int], label: str = "") -> str:
    windows, micro, _ = progress
    return f"{windows} windows done + {micro} micro-step(s)" + (f", in {label}" if label else "")


@contextlib.contextmanager
def phase(run: RunState, label: str) -> Iterator[None]:
    """Marks a collective accumix adds between windows, so the watchdog sees a rank that has
    not reached it as behind (the window counters alone are equal there)."""
    run.sync_points += 1
    run.sync_label = label
    yield
    # Only on success: a collective that failed here leaves the label for the diagnosis.
    run.sync_label = ""


def advance(label: str) -> None:
    """This rank finished its own part of a collective (its files of a checkpoint write) and
    now waits for the others: progress, so a rank still inside its part is named as behind.
    The label stays until the enclosing ``phase`` ends."""
    watched = _watchdog._watched if _watchdog is not None else None
    run = watched() if watched is not None else None
    if run is not None:
        run.sync_points += 1
        run.sync_label = label


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _die(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def start_watchdog(run: RunState, timeout: float) -> Watchdog | None:
    """Starts this process's watchdog (once) and points it at ``run``; None in one process or
    when no TCP store address is known (a process group made with another init method)."""
    global _watchdog
    if run.world_size == 1 or not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        return None
    if _watchdog is None or _watchdog._stop.is_set():
        job_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False, timeout=timedelta(seconds=min(timeout, 10)),
                                   wait_for_workers=False)
            store = dist.PrefixStore(f"accumix/{job_id}/{attempt}/", client)
            interval = min(1.0, max(0.1, timeout / 10))
            _watchdog = Watchdog(store, run.rank, run.world_size, interval)
        except Exception:  # noqa: BLE001 - no diagnosis then, but training is unaffected
            return None
        _install_excepthook()
        atexit.register(_stop_at_exit)
    _watchdog.watch(run)
    return _watchdog


def die_with_launcher(interval: float = 0.5) -> bool:
    """Ends this process within ``interval`` seconds of its launcher's death, when torchrun's
    agent started it (``TORCHELASTIC_RUN_ID`` set): the agent forwards SIGTERM and kills its
    workers when it exits, but a SIGKILLed agent can do neither.

    A daemon thread polls the parent's pid: once the process is re-parented (to init or a
    subreaper), the parent is gone. ``prctl(PR_SET_PDEATHSIG)`` would fire when the agent's
    *thread* that started the worker ends, which the agent does not promise to keep alive.

    Returns:
        Whether a watch started now (once per process; never outside torchrun's agent).
    """
    global _launcher_watch
    if _launcher_watch is not None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        print(f"accumix: rank {os.environ.get('RANK', '?')} stops: its launcher (pid {parent}) "
              "is gone", file=sys.stderr, flush=True)
        os._exit(1)

    _launcher_watch = threading.Thread(target=watch, name="accumix-launcher-watch", daemon=True)
    _launcher_watch.start()
    return True


def _stop_at_exit() -> None:
    """Stops the heartbeat thread and waits for it before the interpreter finalizes.

    A daemon thread still inside a TCPStore call when Python finalizes is ended by
    ``pthread_exit``, whose forced unwind through torch's C++ frames calls ``std::terminate``:
    "terminate called without an active exception" and SIGABRT after a job that finished (seen
    after a pre-emption save's ``SystemExit(0)``, which skips ``acc.end()``). The aborts that
    remained after this join came from a gloo worker thread, not from this one: see
    ``accumix.runtime.env._teardown_at_exit``, which runs after this handler.
    """
    watchdog = _watchdog
    if watchdog is None:
        return
    if not watchdog._stop.is_set():
        watchdog.finish()  # a clean exit: the peers must not count this rank as dead
    watchdog._thread.join(timeout=2 * watchdog.interval + 1.0)


def _install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_accumix", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(kind, exc, tb)
        watchdog = _watchdog
        if watchdog is None or watchdog._stop.is_set():
            return
        summary = f"{kind.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        if _is_collective_failure(exc):
            summary = f"a collective failed: {watchdog.diagnose()}"
            print(f"accumix: rank {watchdog.rank}: {summary}", file=sys.stderr, flush=True)
        watchdog.publish_failure(summary)
        watchdog._stop.set()

    hook._accumix = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(h in str(exc).lower() for h in _COLLECTIVE_HINTS)


class PreemptionHandler:
    """Turns a signal into a checkpoint at the next window boundary (then, with ``requeue``,
    rank 0 asks SLURM to requeue the job); made by ``Accelerator.handle_preemption``.

    Attributes:
        triggered: a signal arrived and the checkpoint was written.
        checkpoint: that checkpoint's step directory.
    """

    def __init__(self, run: RunState, run_dir: str | os.PathLike[str], *,
                 save: Callable[[Path, int | None], Path], signals: tuple[int, ...],
                 keep_last: int | None, exit: bool, requeue: bool = False) -> None:
        for index, loader in enumerate(run.loaders):
            if loader._unresumable:  # a signal mid-epoch would find no save it could make
                raise ConfigError(
                    f"handle_preemption cannot save DataLoader {index} mid-epoch: it has "
                    f"{loader._unresumable}; use batch_size= with shuffle=True/False or a "
                    "DistributedSampler, or save with acc.save_state at epoch ends instead"
                )
        # Checked now, not when the signal comes: no SLURM job or no scontrol is one line.
        self._requeue = requeue_target() if requeue else None
        self._run, self._save_state = run, save
        # A path, or an object store URL (accumix.common.locations): kept as given.
        self.run_dir, self.keep_last, self.exit = location(run_dir), keep_last, exit
        self.triggered, self.checkpoint = False, None
        self._checked_window = run.window.index
        # Off the main thread (Ray Train's worker thread) no handler can be installed: the
        # watch then serves request_preemption() and the added checks only.
        self._watch = PreemptionWatch(signals, rank=run.rank)
        self._armed = tuple(signals) if self._watch.on_main_thread else ()
        self._agreed_stop = False
        # The DataLoader workers this rank starts from now on outlive these signals when
        # someone else sends them (the agent's killpg, the scheduler's): the save needs them.
        worker_signals.guard(self._armed)
        if self._armed:
            preemption_report.note_armed(run.rank)

    def at_batch(self) -> None:
        """Between batches: once per finished window, the ranks agree whether to stop."""
        window = self._run.window
        if window.micro_step or window.index == self._checked_window:
            return
        self._checked_window = window.index
        if self._agreed("the pre-emption check") and self._save() and self.exit:
            raise SystemExit(0)

    def at_end(self) -> bool:
        """At ``acc.end()``: a signal that came in the last window or after the loop is
        honoured now (saved, when between windows). Returns whether to exit 0 after ``end``."""
        if self.triggered or not self._watch.active:
            return False
        if not self._agreed("the pre-emption check of acc.end()"):
            return False
        if self._run.window.micro_step:  # a checkpoint cannot hold half a window
            self._agreed_stop = True  # the launcher hears that this stop saved nothing
            self.close()
            print(f"accumix: rank {self._run.rank} pre-empted inside an accumulation window at "
                  f"acc.end(); nothing saved", file=sys.stderr, flush=True)
            return self.exit
        return self._save() and self.exit

    def _agreed(self, label: str) -> bool:
        flag = torch.tensor([1.0 if self._watch.requested() else 0.0], device=self._run.device)
        with phase(self._run, label):
            return bool(self._run.strategy.all_reduce(flag, "max").item())

    def _save(self) -> bool:
        self.checkpoint = self._save_state(self.run_dir, self.keep_last)
        self.triggered = True
        self._watch.served()
        preemption_report.note_saved(self._run.rank, str(self.checkpoint))
        self.close()
        # one write: the ranks share the terminal, and print's separate newline interleaves
        sys.stderr.write(f"accumix: rank {self._run.rank} pre-empted; saved {self.checkpoint}\n")
        sys.stderr.flush()
        if self._requeue is not None and self._run.rank == 0:  # the save is published
            requeue(self._requeue)
        return True

    def close(self) -> None:
        """Restores the signal handlers that were there before; the Accelerator stops asking
        this handler at boundaries (no more agreement collectives). Closed before any signal
        (a replaced handler, ``acc.end()``), it tells the launcher it is no longer armed."""
        signalled = self._watch.signalled
        self._watch.close()
        worker_signals.release(self._armed)
        if self._armed and not (signalled or self._agreed_stop or self.triggered):
            preemption_report.note_disarmed(self._run.rank)
        self._armed = ()
        if self._run.preemption is self:
            self._run.preemption = None
