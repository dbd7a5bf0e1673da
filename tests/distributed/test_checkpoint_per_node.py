"""A run directory on each node's own disk (no shared filesystem), under two ``accumix launch
--nnodes 2`` agents on loopback as two nodes of one rank, fsdp; saves behind the loop, and a
SIGKILL inside one of them.

The job is tests/scripts/resumable_train.py with ``--per-node`` (``RUN_DIR/node<g>``) and
``--kill-in-write 4``: it saves every 2 steps, in the background on its first attempt; rank 1
SIGKILLs itself inside its background write of step 4. Both agents restart their workers, which
resume from step-2 (step 4 was never published: ``latest`` moves only once every node has
published) on each node's own files, save in the loop from then on, and end bit for bit on the
run never interrupted (trained next in the same processes). Every node publishes its own part:
its ranks' files and the metadata a load needs, ``latest`` on every node. Then one rank (this
process) resumes from node 0's directory: the shard rank 1 wrote is on node 1, and the refusal
names it in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import accumix as ax
from accumix.testing import free_port
from tests.scripts.resumable_train import build

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "resumable_train.py"
ACCUMIX = [sys.executable, "-m", "accumix.cli.main"]


def test_per_node_run_dirs_killed_resume_bitwise(tmp_path: Path) -> None:
    run, port = tmp_path / "run", str(free_port())
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen([*ACCUMIX, "launch", "--nproc", "1", "--nnodes", "2", "--node-rank",
                          str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                          "--max-restarts", "1", str(SCRIPT), str(run), "--strategy", "fsdp",
                          "--per-node", "--kill-in-write", "4",
                          "--reference", str(tmp_path / "ref")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT)
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [o[1][-3000:] for o in outputs]
    nodes = [run / "node0", run / "node1"]
    assert (nodes[0] / "events.txt").read_text().splitlines() == [
        "attempt 0 resumed -", "attempt 1 resumed step-2", "attempt 1 finished at step 8"]
    expected, got = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "ref",
                                                                       nodes[0] / "final"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    for rank, node in enumerate(nodes):  # each node published its own part, latest on both
        assert (node / "latest").read_text() == "step-8\n"
        assert sorted(p.name for p in node.iterdir() if p.name.startswith(("step-", ".step"))
                      ) == ["step-6", "step-8"]  # keep_last=2; nothing left in .step-N.tmp
        step = node / "step-8"
        assert sorted(p.name for p in step.glob("rank-*.pt")) == [f"rank-{rank}.pt"]
        assert sorted(p.name for p in (step / "model").iterdir()) == [
            ".metadata", f"__{rank}_0.distcp"]
        assert (step / "meta.json").is_file() and (step / "schedulers.pt").is_file()

    # Another world: one rank needs both shards; node 0's directory holds only rank 0's.
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=6, seed=0)
    build(acc)
    with pytest.raises(ax.CheckpointError) as refused:
        acc.load_state(nodes[0])
    message = str(refused.value)
    assert "\n" not in message and "__1_0.distcp" in message and "another node" in message
