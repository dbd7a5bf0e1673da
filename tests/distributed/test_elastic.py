"""Elastic jobs (issue 43): ``accumix launch --nnodes 1:2`` agents on loopback, one process each
unless said, torchrun's c10d rendezvous hosted by node 0's launcher; the launcher of node 1 (it
does not host the rendezvous) is SIGKILLed mid-run.

tests/scripts/elastic_train.py runs three jobs in lockstep (the Trainer, a plain ddp loop and a
plain fsdp loop, global batch 16, a save every step) and compares each with the same job trained
uninterrupted by the processes it ends in (within 1e-6: the one-process large batch on one node,
the two-node run on two), and each step's samples with that run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from accumix.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"


def _agent(out: Path, node: str, rank: int, port: int, *args: str, nproc: int = 1,
           ) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(ELASTIC_NODE=node, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    # last_call_timeout: how long a rendezvous that has its minimum waits for more nodes
    # (torchrun's default 30 s); node 1 starts first, so the first round has both.
    return subprocess.Popen(
        [sys.executable, "-m", "accumix.cli.main", "launch", "--nnodes", "1:2", "--nproc",
         str(nproc), "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port",
         str(port), "--rdzv-conf", "last_call_timeout=3", *args],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def _pair(out: Path, *args: str, nproc: tuple[int, int] = (1, 1)
          ) -> tuple[subprocess.Popen[str], subprocess.Popen[str], int]:
    port = free_port()
    second = _agent(out, "b", 1, port, *args, nproc=nproc[1])
    time.sleep(1.0)
    return _agent(out, "a", 0, port, *args, nproc=nproc[0]), second, port


def _wait_for(path: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_a_lost_node_the_survivor_finishes_with_the_global_batch(tmp_path: Path) -> None:
    host, lost, _ = _pair(tmp_path, str(SCRIPT), str(tmp_path), "--kill-at", "5")
    out, err = host.communicate(timeout=600)
    assert host.returncode == 0, out[-3000:] + err[-3000:]
    lost.communicate(timeout=60)
    assert lost.returncode == -signal.SIGKILL  # the launcher that did not host the rendezvous
    result = json.loads((tmp_path / "result.json").read_text())
    for job, run in result.items():
        assert run["diff"] < 1e-6 and run["samples"], (job, run)
        assert run["steps"] == list(range(1, 13)), (job, run)
        assert run["worlds"][0] == 2 and run["worlds"][-1] == 1, (job, run)
        assert {(w, k) for w, k in zip(run["worlds"], run["K"], strict=True)} == {(2, 2), (1, 4)}
    for job in ("trainer", "ddp", "fsdp"):
        assert f"world 2 -> 1: K 2 -> 4, global batch 16 kept (resumed from {tmp_path / job}" \
            in err, err[-3000:]


def test_a_node_joining_back_the_job_finishes_on_two_nodes(tmp_path: Path) -> None:
    args = (str(SCRIPT), str(tmp_path), "--kill-at", "3", "--hold-alone-at", "6")
    host, lost, port = _pair(tmp_path, *args)
    _wait_for(tmp_path / "holding")  # one node left, it holds after step 6: a node comes back
    back = _agent(tmp_path, "b2", 1, port, *args)
    out, err = host.communicate(timeout=600)
    assert host.returncode == 0, out[-3000:] + err[-3000:]
    back_out, back_err = back.communicate(timeout=120)
    assert back.returncode == 0, back_out[-3000:] + back_err[-3000:]
    lost.communicate(timeout=60)
    result = json.loads((tmp_path / "result.json").read_text())
    for job, run in result.items():
        assert run["diff"] < 1e-6 and run["samples"], (job, run)
        assert run["steps"] == list(range(1, 13)), (job, run)
        worlds = run["worlds"]
        assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, (job, run)  # 2 -> 1 -> 2
        assert worlds[worlds.index(1):].count(2) >= 3, (job, run)  # steps on two again
    assert "world 1 -> 2: K 4 -> 2, global batch 16 kept" in err + back_err, err[-3000:]


def test_a_world_the_global_batch_cannot_divide_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # 3 processes (node 0: 2, node 1: 1) of accumix train, global batch 12 of micro-batches of
    # 4 (K=1); without node 1 the world of 2 cannot divide 12 into micro-batches of 4.
    args = ("-m", "accumix.cli.main", "train", "model.n_layer=1", "model.n_embd=16",
            "model.n_head=2", "model.block_size=16", "data.max_files=2",
            "data.max_val_bytes=500", "sample.max_new_tokens=0", "global_batch_size=12",
            "micro_batch_size=4", "precision=fp32", "strategy=ddp", "max_steps=400",
            "eval_every=null", "checkpoint_every=1", "progress_bar=false", "plot=false",
            "loggers=[csv]", "system_metrics_every=null", f"output_dir={tmp_path}")
    # One restart: the lost node's; the attempt on 2 ranks then fails on both (torchrun
    # reports the last attempt's failures: one line whatever the restarts).
    host, lost, _ = _pair(tmp_path, "--max-restarts", "1", *args, nproc=(2, 1))
    _wait_for(tmp_path / "step-2")
    os.killpg(lost.pid, signal.SIGKILL)  # its launcher (its rank follows within a second)
    out, err = host.communicate(timeout=600)
    lost.communicate(timeout=60)
    assert host.returncode == 2, out[-3000:] + err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("accumix train: error:")]
    assert lines == ["accumix train: error: global_batch_size=12 is not a multiple of "
                     "micro_batch_size=4 x data-parallel world size 2 = 8; data-parallel world "
                     "sizes that would divide it: [1, 3]"], err[-3000:]
    # The last checkpoint is intact: every file its meta.json lists, at the size written.
    step = tmp_path / (tmp_path / "latest").read_text().strip()
    files = json.loads((step / "meta.json").read_text())["files"]
    assert int(step.name.split("-")[1]) >= 2 and files
    assert all((step / name).stat().st_size == size for name, size in files.items())
