"""``accumix launch``: ``torch.distributed.run`` with the defaults a user would have picked.

accumix runs no rendezvous of its own: this builds torchrun's arguments and calls it in this
process. What it decides for you:

* ``--nproc auto``: the GPUs of this node, else its CPU cores (one process per core, each with
  one thread); an explicit N on a CPU gives each process ``cores // N`` threads;
* one node: the static rendezvous on loopback (``127.0.0.1``) on a free port, and a second
  port held for JAX's coordinator for the whole launch (``jax_coordinator_port``);
* inside a SLURM job step (``srun --ntasks-per-node=1 accumix launch ...``): the node count,
  this node's rank, node 0's address and a port from the job id come from the allocation;
* in a Kubeflow pod (Trainer v2's ``PET_*``; a PyTorchJob pod's ``RANK``/``WORLD_SIZE``/
  ``MASTER_*``, the pod a node) or on a SkyPilot node (``SKYPILOT_*``; port 29500): the same
  from the engine's variables (``common/engine_env.py``); a flag that contradicts them is
  refused;
* SIGUSR1 and SIGUSR2 (``#SBATCH --signal=USR1@90``) are forwarded to every rank;
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accumix.cli.forward_signals import forwarding_warning_signals
from accumix.cli.rendezvous import DEFAULT_ELASTIC_RESTARTS, Rendezvous, plan_rendezvous
from accumix.common import preemption_report
from accumix.common.engine_env import EngineNodes, engine_nodes, node_range, slurm_nodes
from accumix.common.launch_env import is_loopback
from accumix.errors import PREEMPTED_EXIT_CODE, ConfigError
from accumix.runtime.loopback import loopback_launch
from accumix.testing import free_port

DEFAULT_MULTINODE_PORT = 29500
ENGINES = {"slurm": "SLURM", "kubernetes": "Kubeflow", "skypilot": "SkyPilot"}
REPORTED = "ConfigError: "  # how torchrun's error file words a rank's handed-over line
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
    # An elastic job's (--nnodes MIN:MAX) dynamic rendezvous; nnodes is then MAX. None: static.
    rendezvous: Rendezvous | None = None


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
    """Defaults read from a SLURM allocation (empty outside one), as ``accumix env`` shows them.

    Raises:
        ConfigError: a multi-node allocation without one launcher per node.
    """
    nodes = slurm_nodes(environ)
    if nodes is None:
        return {}
    out: dict[str, int | str] = {"nnodes": nodes.nnodes or 1, "node_rank": nodes.node_rank or 0}
    for key, name in (("master_addr", "master_addr"), ("master_port", "default_port"),
                      ("gpus", "gpus"), ("cpus", "cpus")):
        if getattr(nodes, name) is not None:
            out[key] = getattr(nodes, name)
    return out


def resolve_nproc(value: str | int, environ: Mapping[str, str] | None = None) -> int:
    """Processes for this node: ``auto`` = the engine's count (``PET_NPROC_PER_NODE``), else
    the GPUs (at most the engine's), else the CPU cores (or the engine's).

    Raises:
        ConfigError: not ``auto`` nor an integer >= 1, or more than this node's GPUs (else
            its CPU cores), unless an engine states the count or ``ACCUMIX_OVERSUBSCRIBE=1``.
    """
    environ = os.environ if environ is None else environ
    engine = engine_nodes(environ)
    gpus = local_gpus()
    if value != "auto":
        procs = _positive("nproc", value)
        engine_gpus = engine.gpus if engine is not None else None
        available = (min(gpus, engine_gpus or gpus) if gpus
                     else (engine.cpus if engine is not None else None) or local_cpus())
        # An engine that states the node's process count (PET_NPROC_PER_NODE=4) knows its pod.
        stated = engine is not None and isinstance(engine.nproc, int)
        if procs > available and not stated and environ.get(OVERSUBSCRIBE) != "1":
            what = "GPUs" if gpus else "CPU cores"
            raise ConfigError(f"nproc={procs} is more than this machine's {available} {what}; "
                              f"use nproc=auto or at most {available} (or set {OVERSUBSCRIBE}=1 "
                              "to start more processes anyway)")
        return procs
    asked = engine.nproc if engine is not None else None
    if isinstance(asked, int):
        return asked
    if asked == "gpu" and not gpus:
        raise ConfigError(f"{engine.said['nproc']} but this node has no GPU; give --nproc N "
                          "or PET_NPROC_PER_NODE=cpu")
    cpus = (engine.cpus if engine is not None else None) or local_cpus()
    if gpus and asked != "cpu":
        return min(gpus, (engine.gpus if engine is not None else None) or gpus)
    return cpus


def _deferred(engine: EngineNodes | None, key: str, flag: Any, option: str) -> Any:
    """The flag's value or the engine's; a flag that contradicts the engine is refused."""
    said = getattr(engine, key) if engine is not None else None
    if flag is not None and said is not None and flag != said:
        raise ConfigError(f"--{option} {flag} contradicts {engine.said[key]} (set by "
                          f"{ENGINES[engine.engine]}); drop --{option}: accumix launch reads it")
    return flag if flag is not None else said


def _node_range(engine: EngineNodes | None, nnodes: int | str | None) -> tuple[int, int]:
    """(MIN, MAX) nodes from ``--nnodes`` (N or MIN:MAX) or the engine's; a contradiction is
    refused."""
    if engine is not None and engine.nnodes is not None:
        said = (engine.nnodes, engine.max_nodes or engine.nnodes)
        if nnodes is not None and node_range("--nnodes", str(nnodes)) != said:
            raise ConfigError(f"--nnodes {nnodes} contradicts {engine.said['nnodes']} (set by "
                              f"{ENGINES[engine.engine]}); drop --nnodes: accumix launch reads "
                              "it")
        return said
    return node_range("--nnodes", str(nnodes)) if nnodes is not None else (1, 1)


def plan_launch(*, nproc: str | int = "auto", nnodes: int | str | None = None,
                node_rank: int | None = None, master_addr: str | None = None,
                master_port: int | None = None, max_restarts: int | None = None,
                rdzv_backend: str | None = None, rdzv_endpoint: str | None = None,
                rdzv_conf: str | None = None,
                environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Resolves the launch: the flags and the cluster engine's variables (SLURM, Kubeflow's
    ``PET_*`` or a PyTorchJob pod's, SkyPilot's), then the defaults. ``nnodes`` MIN:MAX (or
    the engine's ``PET_NNODES=1:2``) is an elastic job on torchrun's c10d rendezvous at node
    0's address (``rendezvous.py``), 3 restarts unless ``max_restarts`` says otherwise.

    Raises:
        ConfigError: a bad number, a node rank outside the nodes, several nodes without a
            master address, or a flag that contradicts the engine's variables.
    """
    environ = os.environ if environ is None else environ
    engine = engine_nodes(environ)
    if nproc != "auto" and engine is not None and isinstance(engine.nproc, int):
        _deferred(engine, "nproc", _positive("nproc", nproc), "nproc")
    procs = resolve_nproc(nproc, environ)
    low, nodes = _node_range(engine, nnodes)
    given_rank = _deferred(engine, "node_rank", node_rank, "node-rank")
    rank = _positive("node-rank", given_rank or 0, minimum=0)
    if rank >= nodes:
        raise ConfigError(f"node-rank={rank} is invalid with nnodes={nodes}; use 0..{nodes - 1}")
    one_node = nodes == 1  # the engine's address and port then serve nothing: loopback
    addr = master_addr if one_node else _deferred(engine, "master_addr", master_addr,
                                                  "master-addr")
    port = master_port if one_node else _deferred(engine, "master_port", master_port,
                                                  "master-port")
    if port is None and not one_node and engine is not None:
        port = engine.default_port  # SLURM's, from the job id: a flag may change it
    rendezvous = plan_rendezvous(nodes=(low, nodes), node_rank=given_rank, master_addr=addr,
                                 master_port=port, backend=rdzv_backend, endpoint=rdzv_endpoint,
                                 engine=engine, default_port=DEFAULT_MULTINODE_PORT,
                                 conf=rdzv_conf)
    restarts = _deferred(engine, "max_restarts", max_restarts, "max-restarts")
    if restarts is None:
        restarts = DEFAULT_ELASTIC_RESTARTS if rendezvous is not None else 0
    _positive("max-restarts", restarts, minimum=0)
    if addr is None:
        if nodes > 1 and rendezvous is None:
            raise ConfigError(
                f"nnodes={nodes} needs --master-addr: the address of node 0, the same on "
                "every node"
            )
        addr = "127.0.0.1"
    if port is None:
        port = DEFAULT_MULTINODE_PORT if nodes > 1 else free_port()
    port = _positive("master-port", port)
    if port > 65535:
        raise ConfigError(f"master-port={port} is invalid; use a port in 1..65535")
    threads = None
    if local_gpus() == 0 and "OMP_NUM_THREADS" not in environ:
        cpus = (engine.cpus if engine is not None else None) or local_cpus()
        threads = max(1, cpus // procs)
    return LaunchPlan(nproc=procs, nnodes=nodes, node_rank=rank, master_addr=str(addr),
                      master_port=port, max_restarts=int(restarts), threads_per_process=threads,
                      rendezvous=rendezvous)


def torchrun_args(plan: LaunchPlan, target: str, target_args: Sequence[str], *,
                  module: bool = False) -> list[str]:
    """``torch.distributed.run`` arguments for ``plan`` running ``target``."""
    if plan.rendezvous is not None:  # elastic: torchrun's dynamic rendezvous
        args = [*plan.rendezvous.torchrun_args(), f"--nproc-per-node={plan.nproc}",
                f"--max-restarts={plan.max_restarts}"]
    else:
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


@contextlib.contextmanager
def _ranks_environment(plan: LaunchPlan) -> Iterator[None]:
    """Variables for the ranks while they run (this process's are put back after)."""
    settings = {"ACCUMIX_LAUNCH": "1"}  # the ranks hand their one-line errors to this launcher
    if plan.rendezvous is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # torchrun's agents otherwise share the ranks' store from the first rendezvous's rank 0
        # on: a node that joins a later round waits for an address nobody writes (pytorch
        # #147064, #135712; a 60 s timeout, then the launch fails).
        settings["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
        with (jax_coordinator_port(plan), forwarding_warning_signals(),
              _ranks_environment(plan), preemption_report.collect(reports),
              loopback_launch(plan.master_addr, plan.master_port,
                              hosts_store=plan.node_rank == 0)):
            run(parse_args(torchrun_args(plan, target, target_args, module=module)))
    except SignalException as exc:
        # torchrun's agent turned the signal into this exception after it forwarded the signal
        # to every rank and waited for them: no traceback, the status a scheduler reads.
        status, line = signalled_status(int(exc.sigval), plan.nproc,
                                        reports[-1] if reports else preemption_report.Report())
        print(line, file=sys.stderr, flush=True)
        return status
    except ChildFailedError as exc:
        reported = reported_error(exc.failures)
        if reported:
            print(reported, file=sys.stderr, flush=True)
        status, line = failure_status(exc.failures)
        if line:
            print(line, flush=True)
        return status
    return 0


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


def reported_error(failures: Mapping[int, Any]) -> str:
    """The first one-line error a rank handed over (``cli/main.py`` writes it to torchrun's
    error file instead of printing it), or ``""``: printed once, whichever ranks and restarts
    met it."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    texts = [f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
             for _, f in ordered]
    return next((text[len(REPORTED):] for text in texts if text.startswith(REPORTED)), "")


def failure_status(failures: Mapping[int, Any]) -> tuple[int, str]:
    """The launch's exit status from torchrun's failed ranks, and the line naming the first.

    2 when every rank that ended on its own exited with 2 (a usage or config error, its
    one-line message printed: ``reported_error``): once one rank fails the agent stops the
    others with SIGTERM, which may reach a rank before its own exit 2 (the launch then exited
    1); 143 when
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
    parser.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                        help="number of nodes (default 1); MIN:MAX: an elastic job that loses "
                        "and takes back nodes (torchrun's c10d rendezvous on node 0)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index")
    parser.add_argument("--master-addr", default=None, help="node 0's address")
    parser.add_argument("--master-port", type=int, default=None,
                        help="node 0's port (one node: a free one; several: 29500)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="restart every rank up to N times after a failure (default 0; "
                        "elastic: 3)")
    parser.add_argument("--rdzv-backend", default=None,
                        help="an elastic job's rendezvous: c10d (default, hosted by node 0) or "
                        "etcd-v2")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="where the rendezvous runs (default: --master-addr:--master-port)")
    parser.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                        help="torchrun's rendezvous settings, e.g. last_call_timeout=5")
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
                       max_restarts=args.max_restarts, rdzv_backend=args.rdzv_backend,
                       rdzv_endpoint=args.rdzv_endpoint, rdzv_conf=args.rdzv_conf)
    return run_torchrun(plan, args.script, args.script_args, module=args.module)
