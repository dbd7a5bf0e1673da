"""Issue 45, case 3, in one process: what ``accumix launch`` holds and sets for a job on
loopback, the line it prints for one that is not, and a taken port refused in one line. (The
listening addresses of whole jobs: ``tests/distributed/test_launch.py``,
``test_jax_processes.py`` and ``test_listening.py``.)"""

from __future__ import annotations

import os
import socket

import pytest

from accumix.errors import ConfigError
from accumix.runtime import loopback
from accumix.testing import free_port
from tests.listening import listening


def test_a_loopback_launch_holds_the_store_on_loopback_and_keeps_gloo_there(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in loopback.SOCKET_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice is kept
    port = free_port()
    with loopback.loopback_launch("127.0.0.1", port, hosts_store=True) as local:
        assert local
        assert ("127.0.0.1", port) in listening([os.getpid()])
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback.loopback_interface() == "lo"
        assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
        # torchrun's static rendezvous makes this store on node 0: it shares the held server.
        import datetime

        import torch.distributed as dist

        agent = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=10),
                              multi_tenant=True)
        agent.set("k", "v")
        assert dist.TCPStore("127.0.0.1", port, is_master=False).get("k") == b"v"
        assert [p for _, p in listening([os.getpid()])].count(port) == 1
        del agent
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert capsys.readouterr().err == ""
    # A node that does not host the store (node 1 of two on loopback) only sets the variables.
    with loopback.loopback_launch("localhost", port, hosts_store=False) as local:
        assert local and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    # A port another process holds on loopback: one line naming it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{busy}"):
            with loopback.loopback_launch("127.0.0.1", busy, hosts_store=True):
                pass


def test_a_launch_across_machines_says_what_it_exposes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with loopback.loopback_launch("10.1.2.3", 29500, hosts_store=True) as local:
        assert not local and "GLOO_SOCKET_IFNAME" not in os.environ
    line = capsys.readouterr().err
    assert line.count("\n") == 1
    assert "ranks meet at 10.1.2.3:29500; the rendezvous store listens on port 29500 of every " \
           "interface" in line and "none of it is authenticated" in line
    with loopback.loopback_launch("10.1.2.3", 29500, hosts_store=False):
        pass
    assert "store" not in capsys.readouterr().err.split(";")[1]
