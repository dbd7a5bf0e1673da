"""Reading the launcher's variables: torchrun, SLURM, Open MPI / PMI."""

from __future__ import annotations

from typing import Any

import pytest

from accumix.runtime.env import detect_launch_env, first_host


def test_no_launcher() -> None:
    env = detect_launch_env({})
    assert (env.rank, env.world_size, env.launcher, env.distributed) == (0, 1, "none", False)


def test_torchrun() -> None:
    env = detect_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3",
                             "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("10.1.2.3", 1234, "torchrun")


def test_slurm_srun() -> None:
    env = detect_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                             "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456",
                             "SLURM_NTASKS_PER_NODE": "4",
                             "SLURM_JOB_NODELIST": "gpu[07-08,11]"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("gpu07", 13456, "slurm")


def test_slurm_batch_shell_is_not_a_launch() -> None:
    assert detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).launcher == "none"


def test_torchrun_inside_slurm_wins() -> None:
    env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0",
                             "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"})
    assert env.launcher == "torchrun" and env.world_size == 2


@pytest.mark.parametrize("variables,expected", [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "3"}, (1, 3, 0, 3)),
])
def test_mpi(variables, expected) -> None:
    env = detect_launch_env(variables)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == expected
    assert env.launcher == "mpi"


@pytest.mark.parametrize("nodelist,host", [
    ("node1", "node1"), ("node1,node2", "node1"), ("gpu[03-05,09],cpu1", "gpu03"),
    ("a-b[10,12]", "a-b10"),
])
def test_first_host(nodelist, host) -> None:
    assert first_host(nodelist) == host


@pytest.mark.parametrize("uncaught,exit_status", [
    (False, None), (True, None), (False, 0), (False, False), (False, 1), (False, "message")])
def test_exit_teardown_aborts_the_group_after_an_uncaught_exception(
        monkeypatch: pytest.MonkeyPatch, uncaught: bool, exit_status: object) -> None:
    # Issue 20: the exit handler destroyed the group even after an exception with collectives
    # pending; on NCCL destroy waits for them (possibly forever), abort cancels them. gloo takes
    # the same path; the test sees which one was taken. A script's sys.exit with a nonzero
    # status is a failure too (it destroyed the group); sys.exit(0) is not.
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from accumix.runtime import env
    from accumix.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    taken: list[str] = []

    def recording(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            taken.append(name)
            return real(*args, **kwargs)
        return call

    for module, name in ((dist, "destroy_process_group"), (c10d, "_abort_process_group")):
        monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    monkeypatch.setattr(env, "_created_group", True)
    monkeypatch.setattr(env, "_exit_status", None)
    monkeypatch.setattr(sys, "exit", sys.exit)  # put back after the test: the handler wraps it
    env._record_exit_status()
    if exit_status is not None:
        with pytest.raises(SystemExit) as exited:
            sys.exit(exit_status)
        assert exited.value.code == exit_status
    if uncaught:  # what Python sets once it printed an uncaught exception, before atexit
        monkeypatch.setattr(sys, "last_value", RuntimeError("a collective failed"),
                            raising=False)
    else:
        monkeypatch.delattr(sys, "last_value", raising=False)
        monkeypatch.delattr(sys, "last_exc", raising=False)
    env._teardown_at_exit()
    failed = uncaught or exit_status not in (None, 0)
    assert taken == (["_abort_process_group"] if failed else ["destroy_process_group"])
    assert not dist.is_initialized()


_EXITS_WITH_1 = """
import sys
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from accumix.runtime import env
from accumix.testing import free_port

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                        world_size=1)
env._created_group = True
env._register_exit_teardown()
for module, name in ((dist, "destroy_process_group"), (c10d, "_abort_process_group")):
    def call(*args, _real=getattr(module, name), _name=name, **kwargs):
        print("taken:", _name, flush=True)
        return _real(*args, **kwargs)
    setattr(module, name, call)
try:
    raise RuntimeError("a peer is gone")
except RuntimeError:
    sys.exit(1)
"""


def test_a_script_exiting_with_a_nonzero_status_aborts_the_group(tmp_path) -> None:
    """The real exit: Python gives the atexit handler no trace of an uncaught SystemExit."""
    import os
    import subprocess
    import sys

    script = tmp_path / "exits_with_1.py"
    script.write_text(_EXITS_WITH_1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout.split("\n")[:1]) == (1, ["taken: _abort_process_group"])
