"""``accumix launch``: ``torch.distributed.run`` with the defaults a user would have picked.

accumix runs no rendezvous of its own: this builds torchrun's arguments and calls it in this
process. What it decides for you:

* ``--nproc auto``: the GPUs of this node, else its CPU cores (one process per core, each with
  one thread); an explicit N on a CPU gives each process ``cores // N`` threads;
* one node: the static rendezvous on loopback (``127.0.0.1``) on a free port, and a second
  port held for JAX's coordinator for the whole launch (``jax_coordinator_port``);
* inside a SLURM job step (``srun --ntasks-per-node=1 accumix launch ...``): the node count,
  this node's rank, node 0's address and a port from the job id come from the allocation;
* several nodes otherwise: ``--master-addr`` is required; the port defaults to 29500.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accumix.common import preemption_report
from accumix.common.launch_env import is_loopback
from accumix.errors import PREEMPTED_EXIT_CODE, ConfigError
from accumix.runtime.env import first_host
from accumix.runtime.loopback import loopback_launch
from accumix.testing import free_port

DEFAULT_MULTINODE_PORT = 29500
OVERSUBSCRIBE = "ACCUMIX_OVERSUBSCRIBE"  # "1": nproc may exceed this node's GPUs / CPU cores


@dataclass(kw_only=True, frozen=True, slots=True)
class LaunchPlan:
    """The resolved torchrun settings."""

    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    max_restarts: int
    threads_per_process: int | None  # OMP_NUM_THREADS for CPU ranks; None: leave as is


def local_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, which containers set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _positive(name: str, value: str | int, minimum: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = minimum - 1
    if number < minimum:
        raise ConfigError(f"{name}={value!r} is invalid; use an integer >= {minimum}")
    return number


def slurm_settings(environ: Mapping[str, str]) -> dict[str, int | str]:
    """Defaults read from a SLURM allocation (empty outside one).

    Raises:
        ConfigError: a multi-node allocation without one launcher per node.
    """
    if "SLURM_JOB_ID" not in environ:
        return {}
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES")
                or environ.get("SLURM_NNODES") or 1)
    in_step = "SLURM_STEP_ID" in environ
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS") or nodes) if in_step else nodes
    if nodes > 1 and (not in_step or tasks != nodes):
        raise ConfigError(
            f"this SLURM allocation has {nodes} nodes; start one launcher per node: "
            "srun --ntasks-per-node=1 accumix launch ..."
        )
    out: dict[str, int | str] = {"nnodes": nodes, "node_rank": int(environ.get("SLURM_NODEID", 0))}
    if nodes > 1:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        out["master_addr"] = first_host(nodelist)
        # Lightning's rule, as runtime/env.py uses it: two jobs on one node get other ports.
        out["master_port"] = 10000 + int(environ["SLURM_JOB_ID"]) % 10000
    if environ.get("SLURM_GPUS_ON_NODE"):
        out["gpus"] = int(environ["SLURM_GPUS_ON_NODE"])
    if environ.get("SLURM_CPUS_ON_NODE"):
        out["cpus"] = int(environ["SLURM_CPUS_ON_NODE"])
    return out


def resolve_nproc(value: str | int, environ: Mapping[str, str] | None = None) -> int:
    """Processes for this node: ``auto`` = GPUs, else CPU cores (or the SLURM allocation's).

    Raises:
        ConfigError: not ``auto`` nor an integer >= 1, or more than ``auto`` would give (this
            node's GPUs, else its CPU cores) unless ``ACCUMIX_OVERSUBSCRIBE=1``.
    """
    environ = os.environ if environ is None else environ
    slurm = slurm_settings(environ)
    gpus = local_gpus()
    available = (min(gpus, int(slurm.get("gpus", gpus))) if gpus
                 else int(slurm.get("cpus", local_cpus())))
    if value == "auto":
        return available
    procs = _positive("nproc", value)
    if procs > available and environ.get(OVERSUBSCRIBE) != "1":
        what = "GPUs" if gpus else "CPU cores"
        raise ConfigError(f"nproc={procs} is more than this machine's {available} {what}; use "
                          f"nproc=auto or at most {available} (or set {OVERSUBSCRIBE}=1 to start "
                          "more processes anyway)")
    return procs


def plan_launch(*, nproc: str | int = "auto", nnodes: int | None = None,
                node_rank: int | None = None, master_addr: str | None = None,
                master_port: int | None = None, max_restarts: int = 0,
                environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Resolves the launch: explicit values first, then SLURM's, then the defaults.

    Raises:
        ConfigError: a bad number, a node rank outside the nodes, or several nodes without a
            master address.
    """
    environ = os.environ if environ is None else environ
    slurm = slurm_settings(environ)
    procs = resolve_nproc(nproc, environ)
    nodes = _positive("nnodes", nnodes if nnodes is not None else slurm.get("nnodes", 1))
    rank = _positive("node-rank", node_rank if node_rank is not None
                     else slurm.get("node_rank", 0), minimum=0)
    if rank >= nodes:
        raise ConfigError(f"node-rank={rank} is invalid with nnodes={nodes}; use 0..{nodes - 1}")
    _positive("max-restarts", max_restarts, minimum=0)
    addr = master_addr or slurm.get("master_addr")
    if addr is None:
        if nodes > 1:
            raise ConfigError(
                f"nnodes={nodes} needs --master-addr: the address of node 0, the same on "
                "every node"
            )
        addr = "127.0.0.1"
    port = master_port or slurm.get("master_port")
    if port is None:
        port = DEFAULT_MULTINODE_PORT if nodes > 1 else free_port()
    port = _positive("master-port", port)
    if port > 65535:
        raise ConfigError(f"master-port={port} is invalid; use a port in 1..65535")
    threads = None
    if local_gpus() == 0 and "OMP_NUM_THREADS" not in environ:
        threads = max(1, int(slurm.get("cpus", local_cpus())) // procs)
    return LaunchPlan(nproc=procs, nnodes=nodes, node_rank=rank, master_addr=str(addr),
                      master_port=port, max_restarts=max_restarts, threads_per_process=threads)


def torchrun_args(plan: LaunchPlan, target: str, target_args: Sequence[str], *,
                  module: bool = False) -> list[str]:
    """``torch.distributed.run`` arguments for ``plan`` running ``target``."""
    args = [
        f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={plan.nproc}",
        f"--node-rank={plan.node_rank}",
        f"--master-addr={plan.master_addr}",
        f"--master-port={plan.master_port}",
        f"--max-restarts={plan.max_restarts}",
    ]
    return [*args, *(["--module"] if module else []), target, *target_args]


@contextlib.contextmanager
def jax_coordinator_port(plan: LaunchPlan) -> Iterator[None]:
    """Holds a port on loopback for JAX's coordinator while the ranks run, and names it to them
    (``ACCUMIX_JAX_COORDINATOR``, read by ``accumix.jax.distributed``); a no-op on several
    nodes, off loopback, off Linux, or when the variable is already set.

    ``MASTER_PORT + 1`` (the default elsewhere) was never checked free, and a port merely free
    when chosen can be taken in the seconds before rank 0 binds it (rank 0 then died with
    "Failed to start RPC server"). JAX's service cannot bind port 0 and report it, so the
    launcher binds one itself and keeps it bound: with ``SO_REUSEPORT``, which gRPC servers set
    on Linux, rank 0's service (same user) binds it too, while a bind without ``SO_REUSEPORT``
    (or another user's) is refused and no outgoing connection picks it as its local port. A
    process of the same user that sets ``SO_REUSEPORT`` and names this port could still share
    it (the kernel cannot tell it from rank 0's service); nothing picks it by chance.
    """
    host = "127.0.0.1" if plan.master_addr == "localhost" else plan.master_addr
    if (plan.nnodes > 1 or not is_loopback(host) or ":" in host
            or "ACCUMIX_JAX_COORDINATOR" in os.environ or not sys.platform.startswith("linux")):
        yield
        return
    with contextlib.ExitStack() as sockets:
        while True:
            held = sockets.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            held.bind((host, 0))
            # MASTER_PORT was only checked free (torchrun's store binds it after this), so
            # the kernel may hand it out here (measured: 5 in 50,000): the store then fails
            # with EADDRINUSE. Keeping that socket bound makes the next bind pick another.
            if held.getsockname()[1] != plan.master_port:
                break
        os.environ["ACCUMIX_JAX_COORDINATOR"] = f"{host}:{held.getsockname()[1]}"
        try:
            yield
        finally:
            del os.environ["ACCUMIX_JAX_COORDINATOR"]


def run_torchrun(plan: LaunchPlan, target: str, target_args: Sequence[str], *,
                 module: bool = False) -> int:
    """Runs torchrun's agent in this process until every rank exited.

    Returns:
        0 when every rank succeeded; 2 when the ranks failed with a usage or config error
        (status 2, their one-line message already printed); 143 (128 + the signal) when this
        launcher got SIGTERM (or SIGINT, ...), which it forwarded to the ranks (they have
        torchrun's ``--shutdown-timeout``, 30 s, to save and exit), unless a rank that armed
        a pre-emption handler ended without saving (then 1: ``signalled_status``), or when
        every rank that failed exited 143 (the Trainer's pre-emption save-and-stop); 1 for
        any other failure.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if plan.threads_per_process is not None:
        os.environ["OMP_NUM_THREADS"] = str(plan.threads_per_process)
    # Each of torchrun's module loggers sets its own level (WARNING), so the parent's is not
    # enough: the agent's "Received 15 death signal" and "Sending process ... closing signal"
    # lines are the launcher's own business.
    for name in [n for n in logging.root.manager.loggerDict
                 if n.startswith("torch.distributed.elastic")] + ["torch.distributed.elastic"]:
        logging.getLogger(name).setLevel(logging.ERROR)
    reports: list[preemption_report.Report] = []
    try:
        # On loopback the store, gloo and NCCL listen there only (runtime/loopback.py).
        with jax_coordinator_port(plan), preemption_reports(reports), loopback_launch(
                plan.master_addr, plan.master_port, hosts_store=plan.node_rank == 0):
            run(parse_args(torchrun_args(plan, target, target_args, module=module)))
    except SignalException as exc:
        # torchrun's agent turned the signal into this exception after it forwarded the signal
        # to every rank and waited for them: no traceback, the status a scheduler reads.
        status, line = signalled_status(int(exc.sigval), plan.nproc,
                                        reports[-1] if reports else preemption_report.Report())
        print(line, file=sys.stderr, flush=True)
        return status
    except ChildFailedError as exc:
        status, line = failure_status(exc.failures)
        if line:
            print(line, flush=True)
        return status
    return 0


@contextlib.contextmanager
def preemption_reports(reports: list[preemption_report.Report]) -> Iterator[None]:
    """Names a directory to the ranks for their pre-emption reports (``preemption_report``)
    while they run, then appends what they wrote to ``reports``."""
    previous = os.environ.get(preemption_report.ENV)
    with tempfile.TemporaryDirectory(prefix="accumix-launch-") as directory:
        os.environ[preemption_report.ENV] = directory
        try:
            yield
        finally:
            reports.append(preemption_report.read(directory))
            if previous is None:
                del os.environ[preemption_report.ENV]
            else:
                os.environ[preemption_report.ENV] = previous


def signalled_status(signum: int, nproc: int, report: preemption_report.Report
                     ) -> tuple[int, str]:
    """The launch's exit status and line when the launcher itself got ``signum``.

    128 + ``signum`` (143 for SIGTERM: pre-empted, to be requeued) when every rank of this
    node saved on it, or when no rank armed a pre-emption handler (the script saves nothing on
    a signal: it stopped as any program does); 1 when a rank armed one and ended without
    saving (it crashed before its boundary): the status must not claim a checkpoint that was
    never written.
    """
    name = signal.Signals(signum).name
    status = 128 + signum
    if len(report.saved) >= nproc:
        checkpoint = report.saved[min(report.saved)]
        return status, (f"accumix launch: stopped by {name}; every rank saved {checkpoint} "
                        f"(exit status {status}): run the same command again to resume")
    unsaved = sorted(report.armed - report.saved.keys())
    if not unsaved:
        return status, (f"accumix launch: stopped by {name}, forwarded to every rank (exit "
                        f"status {status})")
    ranks = ", ".join(map(str, unsaved))
    return 1, (f"accumix launch: stopped by {name}, but rank(s) {ranks} ended without saving "
               "(their output is above): this stop left no checkpoint (exit status 1)")


def failure_status(failures: Mapping[int, Any]) -> tuple[int, str]:
    """The launch's exit status from torchrun's failed ranks, and the line naming the first.

    2 when every rank that ended on its own exited with 2 (a usage or config error, its
    one-line message already printed): once one rank fails the agent stops the others with
    SIGTERM, which may reach a rank before its own exit 2 (the launch then exited 1); 143 when
    they all exited 143 (the Trainer's pre-emption: saved, to be requeued); 1 otherwise, with
    the first failure named.
    """
    ended = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM}
    if ended and {f.exitcode for f in ended.values()} == {2}:
        return 2, ""
    if ended and {f.exitcode for f in ended.values()} == {PREEMPTED_EXIT_CODE}:
        return PREEMPTED_EXIT_CODE, ("accumix launch: the ranks were pre-empted and saved (exit "
                                     f"status {PREEMPTED_EXIT_CODE}); run the same command "
                                     "again to resume")
    own = {rank: f for rank, f in failures.items() if f.exitcode > 0}
    rank, first = min((own or failures).items(), key=lambda item: (item[1].timestamp, item[0]))
    how = (f"was killed by signal {first.signal_name()}" if first.exitcode < 0
           else f"exited with status {first.exitcode}")
    return 1, f"accumix launch: rank {rank} {how} (its output is above)"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch", help="run a script on N processes per node (torch.distributed.run)",
        description="Run SCRIPT on every local device (torch.distributed.run underneath). "
        "One node: rendezvous on 127.0.0.1. Several: run one launcher per node with the same "
        "--nnodes, --master-addr and --master-port and each its --node-rank (read from SLURM "
        "inside `srun --ntasks-per-node=1`).")
    parser.add_argument("--nproc", default="auto", metavar="N|auto",
                        help="processes on this node; auto: its GPUs, else its CPU cores")
    parser.add_argument("--nnodes", type=int, default=None, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index")
    parser.add_argument("--master-addr", default=None, help="node 0's address")
    parser.add_argument("--master-port", type=int, default=None,
                        help="node 0's port (one node: a free one; several: 29500)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart every rank up to N times after a failure")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as python -m")
    parser.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script")
    parser.set_defaults(run=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    if args.script is None:
        raise ConfigError("give the SCRIPT to run, e.g. accumix launch --nproc 2 train.py")
    if not args.module and not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script!r} does not exist")
    plan = plan_launch(nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                       master_addr=args.master_addr, master_port=args.master_port,
                       max_restarts=args.max_restarts)
    return run_torchrun(plan, args.script, args.script_args, module=args.module)
