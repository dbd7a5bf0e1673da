"""A job whose ranks meet on loopback listens on loopback only.

A rendezvous address of ``127.0.0.1`` (what ``accumix launch`` uses on one node) means every
rank runs on this machine, yet by default three things listened on every interface, open to any
host on the network while the job ran, unauthenticated:

* torch's ``TCPStore`` (torchrun's agent store on ``MASTER_PORT``; rank 0's under a plain
  ``env://`` start): its server binds ``::`` whatever host it is given. It takes an already
  bound socket (``master_listen_fd``), and a store made with ``multi_tenant=True`` reuses the
  server a process already runs on that port, which torchrun's static rendezvous and
  ``env://`` both ask for: ``hold_store`` starts that server first, on a socket bound to the
  loopback address, and theirs becomes it.
* gloo's pair listeners (torch): on the address the host's name resolves to, unless
  ``GLOO_SOCKET_IFNAME`` names an interface; NCCL's bootstrap likewise with
  ``NCCL_SOCKET_IFNAME``. ``keep_local`` names the loopback interface in both (a value the user
  set is kept).
* JAX's gloo collectives on CPU: the host name's address too; ``accumix.jax.distributed`` gives
  them the loopback address (its coordinator already listened there).

Several-node jobs cannot do this: the store, gloo/NCCL and JAX's coordinator must be reachable
from the other nodes (SECURITY.md says what listens where and how to keep it to a private
network).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator, MutableMapping
from datetime import timedelta
from typing import Any

from accumix.common.launch_env import is_loopback
from accumix.errors import ConfigError

IFF_LOOPBACK = 0x8  # <linux/if.h>
SOCKET_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_held: dict[int, Any] = {}  # port -> the store whose server this process keeps on loopback


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux), None where it cannot be
    read (not Linux)."""
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        return None
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/flags", encoding="ascii") as f:
                if int(f.read().strip(), 16) & IFF_LOOPBACK:
                    return name
        except (OSError, ValueError):
            continue
    return None


def keep_local(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Names the loopback interface in ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` where
    they are unset (a job on loopback: every rank on this machine).

    Returns:
        The variables set (empty when both were set already or no loopback interface is
        known).
    """
    environ = os.environ if environ is None else environ
    name = loopback_interface()
    if name is None:
        return {}
    added = {var: name for var in SOCKET_VARIABLES if not environ.get(var)}
    environ.update(added)
    return added


def hold_store(host: str, port: int) -> Any:
    """Starts (once per port) a ``TCPStore`` server listening on ``host:port`` only, kept for
    the life of this process: torch's stores made after it on that port with
    ``multi_tenant=True`` (torchrun's agent, ``env://``) share its server instead of starting
    one on every interface.

    Raises:
        ConfigError: the port is taken on ``host``.
    """
    if port in _held:
        return _held[port]
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    address = "127.0.0.1" if host == "localhost" else host.strip("[]")
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, port))
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise ConfigError(f"the job's store cannot listen on {address}:{port} ({exc.strerror});"
                          " give another free port (MASTER_PORT, --master-port) or leave it "
                          "unset for a free one") from None
    # The server takes the descriptor over (libuv closes it with the server): it gets a copy.
    fd = os.dup(listener.fileno())
    listener.close()
    try:
        store = dist.TCPStore(address, port, None, True, timedelta(seconds=60),
                              wait_for_workers=False, multi_tenant=True, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    _held[port] = store
    return store


def release_store(port: int) -> None:
    """Drops the store ``hold_store`` keeps on ``port`` (its server stops with the last
    store that uses it)."""
    _held.pop(port, None)


@contextlib.contextmanager
def loopback_group(master_addr: str, master_port: int, *, hosts_store: bool) -> Iterator[bool]:
    """Around a rank's ``init_process_group``: on a loopback ``master_addr``, gloo and NCCL
    listen on the loopback interface (``keep_local``) and, when this rank ``hosts_store``
    (rank 0 under ``env://``), so does the store: the group's store shares the server held
    here, which is released after (it then ends with the group, as torch's own would).

    Yields:
        Whether the group was kept to loopback.
    """
    if not is_loopback(master_addr):
        yield False
        return
    keep_local()
    if hosts_store:
        hold_store(master_addr, master_port)
    try:
        yield True
    finally:
        if hosts_store:
            release_store(master_port)


def exposure(master_addr: str, master_port: int, *, hosts_store: bool) -> str:
    """The start-up line of a job that spans machines: what listens, where, unauthenticated."""
    store = (f"the rendezvous store listens on port {master_port} of every interface of this "
             "machine, " if hosts_store else "")
    return (f"accumix launch: ranks meet at {master_addr}:{master_port}; {store}the ranks' "
            "collectives (gloo/NCCL, JAX's coordinator on process 0) listen on this machine's "
            "network interfaces; none of it is authenticated: keep the nodes on a private "
            "network (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the interface; SECURITY.md)")


@contextlib.contextmanager
def loopback_launch(master_addr: str, master_port: int, *, hosts_store: bool) -> Iterator[bool]:
    """For a launcher whose ranks meet at ``master_addr`` (``accumix launch``): on loopback,
    the store (when this launcher ``hosts_store``: node 0) and the ranks' gloo / NCCL sockets
    listen on the loopback interface only; anywhere else, one line on stderr says what the job
    exposes (``exposure``).

    Yields:
        Whether the job was kept to loopback.
    """
    if not is_loopback(master_addr):
        print(exposure(master_addr, master_port, hosts_store=hosts_store), file=sys.stderr,
              flush=True)
        yield False
        return
    added = keep_local()
    try:
        if hosts_store:
            hold_store(master_addr, master_port)
        yield True
    finally:
        release_store(master_port)
        for name in added:
            os.environ.pop(name, None)
