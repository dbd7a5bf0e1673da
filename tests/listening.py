"""What a job listens on: its processes' listening TCP sockets, read from ``/proc`` (Linux).

``listening(pids)`` maps each socket descriptor of the processes to its entry in
``/proc/net/tcp`` / ``tcp6`` (the kernel's table, what ``ss -ltn`` prints) and returns the local
addresses of those in state LISTEN. ``non_loopback_hostname()`` gives a command prefix that runs
a job under a host name resolving to this machine's non-loopback address (a new UTS namespace),
so gloo's default (the host name's address) is not loopback by chance.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
from functools import cache

LISTEN = "0A"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # 4 little-endian words
    return str(ipaddress.IPv6Address(words))


def _table() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in this network namespace."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN:
                host, port = local.rsplit(":", 1)
                out[inode] = (_address(host), int(port, 16))
    return out


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (its threads' ``children`` files)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            continue
    return found


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """The (address, port) each listening TCP socket of ``pids`` is bound to, sorted."""
    table = _table()
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in table:
                found.add(table[target[8:-1]])
    return sorted(found)


def job_listening() -> list[tuple[str, int]]:
    """What this rank's job listens on: its launcher (the parent) and every process the
    launcher started (the ranks)."""
    parent = os.getppid()
    return listening([parent, *children(parent)])


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or 127.x mapped into IPv6 (``::ffff:127.0.0.1``: an IPv6 socket
    bound to the IPv4 loopback)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@cache
def non_loopback_hostname() -> list[str]:
    """``["unshare", "-u", "sh", "-c", 'hostname ADDR && exec "$@"', "sh"]``: a prefix that
    runs a command with the host name set to this machine's non-loopback IPv4 address (what
    the host name of a cluster machine resolves to); empty where no such address or no
    ``unshare -u`` (root or user namespaces) is available."""
    if shutil.which("unshare") is None:
        return []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # a documentation address: no packet is sent
            address = probe.getsockname()[0]
    except OSError:
        return []
    if ipaddress.ip_address(address).is_loopback:
        return []
    prefix = ["unshare", "-u", "sh", "-c", f'hostname {address} && exec "$@"', "sh"]
    try:
        done = subprocess.run([*prefix, "hostname"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return prefix if done.returncode == 0 and done.stdout.strip() == address else []
