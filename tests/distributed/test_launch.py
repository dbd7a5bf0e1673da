"""``accumix launch``: 2 ranks on one node; two single-rank agents given SkyPilot's variables on
loopback make one world of 2; a failing rank is named and fails the launch. Four PyTorchJob-style
processes (no launcher; the pod is a node) are one world of 4 nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from accumix.testing import free_port
from tests.listening import is_loopback, non_loopback_hostname

ROOT = Path(__file__).resolve().parents[2]

ACCUMIX = [sys.executable, "-m", "accumix.cli.main"]

# Each rank joins through the Accelerator (which reads torchrun's variables), sums rank + 1 over
# the world, and writes what it saw.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import accumix as ax

    from accumix.runtime import env

    acc = ax.Accelerator(precision="fp32")
    total = acc.reduce(torch.tensor(float(acc.rank + 1)), "sum").item()
    from tests.listening import job_listening  # the launcher's store, every rank's gloo
    listening = job_listening()
    # What the exit teardown waits for: gloo's workers, found by name, idle after the reduce
    # (a rename in torch would make the wait a silent no-op).
    idle = env.wait_for_idle_threads(env.GLOO_WORKER_THREAD, timeout=30)
    out = {"rank": acc.rank, "world": acc.world_size, "sum": total, "args": sys.argv[1:],
           "threads": torch.get_num_threads(), "addr": os.environ["MASTER_ADDR"],
           "gloo_idle": idle, "gloo_states": env.thread_states(env.GLOO_WORKER_THREAD),
           "launch": [acc.launch.launcher, acc.launch.num_nodes, acc.launch.node_rank,
                      acc.launch.local_world_size, acc.local_rank],
           "listening": listening, "port": int(os.environ["MASTER_PORT"])}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{acc.rank}.json"), "w") as f:
        json.dump(out, f)
    acc.end()
""")


def _results(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


def test_launch_two_ranks_on_one_node(tmp_path: Path) -> None:
    """Also issue 45: everything the job listens on (torchrun's store in the launcher, each
    rank's gloo) is on loopback, even where the host name resolves to another address (run in
    a UTS namespace whose host name is this machine's non-loopback IPv4 when it can be).
    Before: the store listened on ``::`` (every interface), gloo on the host name's address."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = subprocess.run([*non_loopback_hostname(), *ACCUMIX, "launch", "--nproc", "2",
                           str(script), "--lr", "0.1"],
                          env={**_env(), "OUT_DIR": str(tmp_path)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = _results(tmp_path)
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert all(r["args"] == ["--lr", "0.1"] and r["addr"] == "127.0.0.1" for r in results)
    listening = {tuple(a) for r in results for a in r["listening"]}
    assert ("127.0.0.1", results[0]["port"]) in listening  # the store, found
    assert len(listening) >= 3, listening  # and each rank's gloo listener
    assert all(is_loopback(address) for address, _ in listening), listening
    assert all(r["gloo_idle"] and r["gloo_states"] and set(r["gloo_states"]) == {"S"}
               for r in results), results


def test_two_skypilot_nodes_make_one_world(tmp_path: Path) -> None:
    # Issue 39: two launchers given only SkyPilot's variables (and --master-port: SkyPilot
    # names no port) are one world of 2 nodes; before, each passed --nnodes=1 and trained
    # alone. (Kubeflow's PET_* on two launchers: test_hsdp_launch.py; the --nnodes 2 flags:
    # test_checkpoint_per_node.py.)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    agents = [
        subprocess.Popen([*ACCUMIX, "launch", "--nproc", "1", "--master-port", port,
                          str(script)], env={
            **_env(), "OUT_DIR": str(tmp_path), "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=120) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    results = _results(tmp_path)
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert [r["launch"] for r in results] == [["skypilot", 2, node, 1, 0] for node in (0, 1)]


def test_four_pytorchjob_pods_are_four_nodes(tmp_path: Path) -> None:
    # Issue 39: PyTorchJob's `python train.py` in each pod (RANK, WORLD_SIZE, MASTER_*, no
    # LOCAL_*) was read as one node of 4 (hsdp, the memory model's shares, "auto" wrong).
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    pods = [
        subprocess.Popen([sys.executable, str(script)], env={
            **_env(), "OUT_DIR": str(tmp_path), "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
            # what a recent training-operator adds (checked against what joined)
            "PET_NNODES": "4", "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "auto",
            "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(4)
    ]
    outputs = [pod.communicate(timeout=180) for pod in pods]
    assert [pod.returncode for pod in pods] == [0] * 4, outputs
    results = _results(tmp_path)
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [
        (rank, 4, 10.0) for rank in range(4)]
    assert [r["launch"] for r in results] == [["kubernetes", 4, rank, 1, 0] for rank in range(4)]


def test_a_failing_rank_fails_the_launch_with_one_line(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = subprocess.run([*ACCUMIX, "launch", "--nproc", "2", str(script)], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "accumix launch: rank 1 exited with status 3" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
