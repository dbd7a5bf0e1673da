"""SLURM pre-emption and requeue (issue 39 item 4) under ``accumix launch --nproc 2``, with the
environment of ``srun --ntasks-per-node=1 accumix launch ...`` inside an sbatch job and a
stand-in ``scontrol`` on PATH that records its calls (tests/scripts/requeue_trainer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "requeue_trainer.py"
# What a one-node job step gives its task.
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "1",
         "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1",
         "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
         "SLURM_STEP_NODELIST": "node07", "SLURM_JOB_NODELIST": "node07"}


def _launch(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM, **extra, OMP_NUM_THREADS="1", SCONTROL_LOG=str(tmp_path / "scontrol.log"),
               PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "accumix.cli.main", "launch", "--nproc", "2",
                           str(SCRIPT), str(tmp_path / "run"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_usr1_saves_requeues_once_exits_143_and_the_requeued_run_resumes_bitwise(
        tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "rank=$RANK $*" >> "$SCONTROL_LOG"\n')
    scontrol.chmod(0o755)
    # A first run (nothing to resume: starts cleanly); rank 1 sends SIGUSR1 to its launcher one
    # micro-step into step 6's window: every rank saves at step 6, rank 0 requeues, exit 143.
    first = _launch(tmp_path, "--signal-at", "5")
    assert first.returncode == 143, first.stdout[-3000:] + first.stderr[-3000:]
    assert "the ranks were pre-empted and saved (exit status 143)" in first.stdout
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["rank=0 requeue 4242"]
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-6"
    assert "resumed from" not in first.stderr
    # The requeued job: the same command, SLURM_RESTART_COUNT set; it resumes at step 6, ends at
    # step 9, and the same processes then train it uninterrupted for the reference.
    again = _launch(tmp_path, "--reference", str(tmp_path / "reference"),
                    SLURM_RESTART_COUNT="1")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result == {"step": 9, "resumed_from": "run", "params_equal": True,
                      "losses_equal": True, "steps_logged": list(range(1, 10)),
                      "launcher": "torchrun"}, result
    assert len((tmp_path / "scontrol.log").read_text().splitlines()) == 1  # not again
