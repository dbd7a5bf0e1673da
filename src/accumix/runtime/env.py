"""The launch environment: who am I (rank, world, local rank), which device, which process group.

Read from torchrun's variables first, then SLURM's, then Open MPI's / PMI's, so one script runs
unchanged under `torchrun`, `srun` and `mpirun`. accumix never runs its own rendezvous: it hands
the address and port to `torch.distributed.init_process_group("env://")`.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from accumix.common.engine_env import check_joined

# Re-exported: the launch variables are read by the torch-free module.
from accumix.common.launch_env import DEFAULT_PORT, LaunchEnv, detect_launch_env, first_host
from accumix.errors import ConfigError
from accumix.runtime import loopback

__all__ = [
    "DEFAULT_PORT", "LaunchEnv", "detect_launch_env", "first_host", "init_process_group",
    "pick_device", "seed_everything",
]

log = logging.getLogger("accumix")


def pick_device(launch: LaunchEnv) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is present, else the CPU; under Ray Train the device Ray
    assigned the worker (it sees only its own GPUs)."""
    if launch.launcher == "ray":
        from accumix.common.ray_train import torch_device

        device = torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if launch.local_rank >= count:
            raise ConfigError(
                f"local rank {launch.local_rank} has no GPU: this node has {count}; "
                f"launch at most {count} processes per node"
            )
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_process_group(launch: LaunchEnv, device: torch.device, timeout: float) -> bool:
    """Joins the job's process group once (NCCL on CUDA, gloo on CPU).

    Args:
        launch: the launch environment.
        device: this rank's device; picks the backend.
        timeout: seconds a collective may wait before every rank fails.

    Returns:
        True if this call created the group; it is then destroyed when the process exits.

    Raises:
        ConfigError: the cluster engine says the job has more nodes or processes than this
            one joined (``common/engine_env.check_joined``): never a silent world of 1.
    """
    global _created_group
    check_joined(launch, os.environ)
    if not launch.distributed:
        return False
    _register_exit_teardown()  # a group the script made itself has gloo threads to wait for too
    if dist.is_initialized():
        return False
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; install a build with it")
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    store = _elastic_attempt_store(launch, timeout)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    # On a loopback address every rank is on this machine: the group listens there only (rank 0
    # hosts env://'s store; torchrun's agent hosts its own).
    with loopback.loopback_group(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 hosts_store=store is None and launch.rank == 0):
        dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timedelta(seconds=timeout),
            **kwargs,
        )
    _created_group = True
    return True


# -- at exit -----------------------------------------------------------------------------------
# torch names the worker threads of a gloo process group so (c10::setThreadName).
GLOO_WORKER_THREAD = "pt_gloo_runloop"
_created_group = False
_exit_registered = False
_exit_status: object = None  # the argument of the last sys.exit() call; None when none


def _register_exit_teardown() -> None:
    global _exit_registered
    if not _exit_registered:
        # Registered before the watchdog's handler, so it runs after it: the last thing
        # accumix does before the interpreter finalizes.
        atexit.register(_teardown_at_exit)
        _record_exit_status()
        _exit_registered = True


def _record_exit_status() -> None:
    """Wraps ``sys.exit`` so the exit handler knows the status a script exits with.

    Why: Python hands an uncaught ``SystemExit`` to no hook and keeps its code from the atexit
    handlers (``sys.last_value`` stays unset, ``sys.exc_info()`` is empty), so a script's
    ``sys.exit(1)`` from an ``except`` block looked like a clean exit and destroyed the group,
    which on NCCL can wait forever for peers that are gone. The wrapper only notes the status
    and calls the real ``sys.exit``; a bare ``raise SystemExit(1)`` stays unseen.
    """
    real_exit = sys.exit
    if getattr(real_exit, "_accumix", False):
        return

    def exit(status: object = None) -> None:
        global _exit_status
        _exit_status = status
        real_exit(status)

    exit._accumix = True  # type: ignore[attr-defined]
    exit.__doc__ = real_exit.__doc__
    sys.exit = exit  # type: ignore[assignment]


def _teardown_at_exit() -> None:
    """Destroys the group accumix made, then waits until gloo's worker threads are idle.

    Why the wait: a gloo worker thread marks a collective complete (the main thread's
    ``wait()`` returns) and only *then* drops its reference to the work, whose tensors it
    frees. A tensor that Python already let go of is kept alive by that reference with its
    Python object (torch's PyObject preservation), so freeing it takes the GIL. If the main
    thread has meanwhile begun finalizing the interpreter (after the atexit handlers), the
    GIL acquire calls ``pthread_exit`` in that non-Python thread; the forced unwind runs into
    the work's ``noexcept`` destructor and ``std::terminate``: "terminate called without an
    active exception", SIGABRT, after a job that finished. The backtrace of the aborting
    thread (two cores, after an all-reduce and an all-gather): ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncAllreduceWork`` / ``~AsyncAllgatherWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` -> ``take_gil`` ->
    ``PyThread_exit_thread`` -> ``_Unwind_ForcedUnwind`` -> ``std::terminate``, the main
    thread in ``Py_FinalizeEx``. A loaded machine widens the gap (the worker is preempted
    right after the completion). ``destroy_process_group`` does not close it: it only drops
    c10d's own references, and other holders (the wrapped modules and optimizers, torch's
    registries) keep the gloo backend alive: its worker threads were still running after it
    and a ``gc.collect()`` under zero1, fsdp and deepspeed. The backend's destructor, which
    joins them, runs late or never; its ``shutdown()`` and ``abort()`` stop no thread.

    After an uncaught exception, or a ``sys.exit`` with a nonzero status, the group is aborted
    instead: a collective may still be pending (the one that raised, or one the other ranks
    are in), and NCCL's destroy waits for it, possibly forever, where its abort
    (``ncclCommAbort``) cancels it. gloo takes the same path (its abort only forgets the
    group). ``sys.exit(0)`` (a pre-emption's save-and-exit) keeps the clean destroy.
    """
    if _created_group and dist.is_initialized():
        if _exiting_on_exception():
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        else:
            dist.destroy_process_group()
    if not wait_for_idle_threads(GLOO_WORKER_THREAD):
        log.warning("accumix: gloo's worker threads were still busy at exit after 5s")


def _exiting_on_exception() -> bool:
    """The interpreter is exiting because of an uncaught exception (Python keeps it in
    ``sys.last_value`` once it has printed it, before the atexit handlers run) or a
    ``sys.exit`` with a nonzero status (``sys.exit("message")`` too: it exits with 1)."""
    if _exit_status not in (None, 0):  # False == 0: sys.exit(False) is a clean exit
        return True
    return getattr(sys, "last_value", None) is not None or getattr(
        sys, "last_exc", None) is not None


def wait_for_idle_threads(name: str, timeout: float = 5.0) -> bool:
    """Waits, with the GIL released, until every native thread of this process called
    ``name`` has been asleep at three looks in a row (Linux; elsewhere returns at once).

    A gloo worker between a collective's completion and its release of the work is running
    or waiting for the GIL; it is woken each time this thread releases the GIL (the sleeps),
    so it cannot look asleep three times before it is back in its idle wait.

    Returns:
        True when they are idle (or there are none); False after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    asleep, delay = 0, 0.001
    while asleep < 3:
        time.sleep(delay)  # releases the GIL to a worker waiting for it
        states = thread_states(name)
        asleep = asleep + 1 if all(state == "S" for state in states) else 0
        if time.monotonic() > deadline:
            return False
        delay = min(delay * 2, 0.02)
    return True


def thread_states(name: str) -> list[str]:
    """The scheduler states (``R``, ``S``, ``D``, ...) of this process's threads called
    ``name``, from ``/proc/self/task``; empty where there is no such file system."""
    states = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return states
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() != name:
                    continue
            with open(f"/proc/self/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # the thread exited meanwhile
    return states


def _elastic_attempt_store(launch: LaunchEnv, timeout: float) -> dist.Store | None:
    """torchrun's agent store, with a key prefix for this restart attempt.

    The agent keeps one TCP store for all attempts, and torch's env:// rendezvous adds no
    per-attempt prefix: a restarted rank can read the dead attempt's gloo/NCCL addresses and
    fail to connect ("Gloo connectFullMesh failed ... Connection refused").
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(launch.master_addr, launch.master_port, world_size=launch.world_size,
                           is_master=False, timeout=timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/accumix/attempt_{attempt}", client)


def seed_everything(seed: int) -> None:
    """Seeds python, numpy and torch (CPU and every GPU) with the same value on every rank."""
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed={seed} is out of range; use an integer in [0, 2**32)")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
