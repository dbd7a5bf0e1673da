"""Killed, pre-empted and hung workers under torchrun's elastic agent (2 ranks on gloo).

The job is tests/scripts/resumable_train.py: it auto-resumes from ``RUN_DIR/latest``, saves
every 2 steps and turns SIGTERM into a save at the next boundary (``acc.handle_preemption``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from accumix.testing import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "resumable_train.py"
ROOT = Path(__file__).resolve().parents[2]


def _command(run_dir: Path, *args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(SCRIPT), str(run_dir), *args]


ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT / "src")}


def _launch(run_dir: Path, *args: str, max_restarts: int = 0, timeout: float = 120.0
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(run_dir, *args, max_restarts=max_restarts),
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def test_sigkill_restart_and_sigterm_resume_bit_identical(tmp_path: Path) -> None:
    # Attempt 0: rank 1 is SIGKILLed one micro-step after step 3 (latest: step-2). The agent
    # restarts both; attempt 1 resumes from step-2, and rank 1 gets SIGTERM one micro-step
    # after step 5: both ranks save at the step-6 boundary and exit 0.
    run = tmp_path / "run"
    hurt = _launch(run, "--kill-at", "3", "--term-at", "5", max_restarts=1)
    assert hurt.returncode == 0, hurt.stderr[-3000:]
    events = (run / "events.txt").read_text().splitlines()
    assert events == ["attempt 0 resumed -", "attempt 1 resumed step-2"], events
    assert (run / "latest").read_text().strip() == "step-6"
    assert "rank 1 pre-empted; saved" in hurt.stderr and "rank 0 pre-empted" in hurt.stderr
    # Rank 0 named the dead rank (gloo's "Connection closed by peer" names none).
    assert "rank(s) 1 stopped responding" in hurt.stderr, hurt.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-4", "step-6"]  # keep_last=2

    # Resume to the end; the same processes then train the job uninterrupted (the reference).
    done = _launch(run, "--reference", str(tmp_path / "ref"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "events.txt").read_text().splitlines()[2:] == [
        "attempt 0 resumed step-6", "attempt 0 finished at step 8"]
    expected, got = load_file(str(tmp_path / "ref" / "model.safetensors")), _final(run)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


HANGS = {
    # rank 1 stops one micro-step into window 3; rank 0 waits in that window's collective
    "in a window": (("--hang-at", "2"), "rank 1 at 2 windows done + 1 micro-step(s)", ""),
    # rank 1 stops between windows 3 and 4; rank 0 is in the pre-emption check
    "between windows": (("--hang-between", "3"), "rank 1 at 3 windows done + 0 micro-step(s)",
                        " while rank 0 reached 3 windows done + 0 micro-step(s), in the "
                        "pre-emption check:"),
    # rank 1 stops before the save at step 2; rank 0 is in save_state's first collective
    "before a save": (("--hang-before-save", "2"), "rank 1 at 2 windows done + 0 micro-step(s)",
                      " while rank 0 reached 2 windows done + 0 micro-step(s), in "
                      "acc.save_state, preparing "),
    # issue 20.10: rank 1's disk stalls inside its checkpoint write at step 2; rank 0 has
    # written its files and waits in DCP's gather (both inside the same save_state phase)
    "in a checkpoint write": (("--hang-in-write", "2"),
                              "rank 1 at 2 windows done + 0 micro-step(s), in acc.save_state, "
                              "writing the models and optimizers",
                              " while rank 0 reached 2 windows done + 0 micro-step(s), in "
                              "acc.save_state, its files written, waiting for the other "
                              "ranks' writes:"),
}


def test_hung_rank_stops_every_process_within_the_timeout(tmp_path: Path) -> None:
    # The four jobs run at once: most of each is the wait for the timeout, which overlaps.
    timeout = 3.0
    jobs = {}
    for where, (args, _, _) in HANGS.items():
        run = tmp_path / where.replace(" ", "-")
        err = open(run.with_suffix(".stderr"), "w+")  # noqa: SIM115 - read back below
        proc = subprocess.Popen(_command(run, *args, "--timeout", str(timeout)),
                                stdout=subprocess.DEVNULL, stderr=err, text=True, env=ENV,
                                cwd=ROOT)
        jobs[where] = (run, proc, err)
    stopped: dict[str, float] = {}
    deadline = time.time() + 150
    try:
        while len(stopped) < len(jobs) and time.time() < deadline:
            for where, (_, proc, _) in jobs.items():
                if where not in stopped and proc.poll() is not None:
                    stopped[where] = time.time()
            time.sleep(0.05)
    finally:
        for _, proc, _ in jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sorted(stopped) == sorted(jobs), "a job never stopped"
    for where, (run, proc, err) in jobs.items():
        _, behind, leader = HANGS[where]
        err.seek(0)
        stderr = err.read()
        err.close()
        assert proc.returncode != 0, where
        hung_for = stopped[where] - float((run / "hang_started").read_text())
        # gloo's timeout on rank 0, the diagnosis (2.5 heartbeats of 0.3 s), rank 1's watchdog
        # (4.8 s measured; the margin is for a loaded machine).
        assert hung_for < timeout + 10.0, (where, hung_for)
        assert f"rank(s) 1 are alive but stuck behind ({behind}){leader}" in stderr, (
            where, stderr[-3000:])
        # Both workers ended with a failure (rank 1 by its watchdog or by the agent).
        assert stderr.count("exitcode  : ") == 2, (where, stderr[-2000:])
        assert "exitcode  : 0" not in stderr, where


def _job_processes(pid: int) -> list[int]:
    """``pid`` and every process below it (launcher, agent, ranks, DataLoader workers)."""
    import psutil

    return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]


def _stopped(run: Path, signal_to: str, start: str) -> tuple[int, str, str]:
    """An ``accumix launch`` of the job with 2 DataLoader workers a rank, stopped by SIGTERM
    once a checkpoint newer than ``start`` is published: to the launcher alone (``"launcher"``:
    its agent forwards it with killpg to each rank's group, workers included) or to every
    process of the job (``"job"``: SLURM's way). Returns (exit status, latest, stderr)."""
    command = [sys.executable, "-m", "accumix.cli.main", "launch", "--nproc", "2", str(SCRIPT),
               str(run), "--workers", "2", "--slow", "0.2"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=ROOT, start_new_session=True)
    latest = run / "latest"
    try:
        deadline = time.time() + 240
        while (not latest.exists() or latest.read_text().strip() == start) and (
                time.time() < deadline and proc.poll() is None):
            time.sleep(0.05)
        pids = [proc.pid] if signal_to == "launcher" else _job_processes(proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, latest.read_text().strip(), err


def test_sigterm_to_the_launcher_or_the_whole_job_with_dataloader_workers_saves(
        tmp_path: Path) -> None:
    """Issue 38 case 3: the forked DataLoader workers died of the SIGTERM meant for their
    rank, which then crashed ("DataLoader worker ... is killed by signal: Terminated") before
    its boundary: nothing saved, and the launcher still exited 143. Now the workers outlive it
    until the save; a stop that saved nothing would exit 1. Each stop resumes exactly."""
    run = tmp_path / "run"
    saved = []
    for signal_to in ("launcher", "job"):
        status, latest, err = _stopped(run, signal_to, saved[-1] if saved else "")
        assert status == 143, (signal_to, err[-3000:])
        assert "is killed by signal" not in err, (signal_to, err[-3000:])
        assert (f"rank 0 pre-empted; saved {run / latest}" in err
                and f"rank 1 pre-empted; saved {run / latest}" in err), (signal_to, err[-3000:])
        assert (f"accumix launch: stopped by SIGTERM; every rank saved {run / latest} (exit "
                "status 143): run the same command again to resume") in err, err[-3000:]
        saved.append(latest)
    assert int(saved[1][5:]) > int(saved[0][5:]) >= 2, saved
    # Resume to the end; the same processes then train the job uninterrupted (the reference).
    done = _launch(run, "--workers", "2", "--reference", str(tmp_path / "ref"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "events.txt").read_text().splitlines() == [
        "attempt 0 resumed -", f"attempt 0 resumed {saved[0]}", f"attempt 0 resumed {saved[1]}",
        "attempt 0 finished at step 8"]
    expected, got = load_file(str(tmp_path / "ref" / "model.safetensors")), _final(run)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
