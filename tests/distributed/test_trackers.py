"""Experiment trackers end to end, through real signals to real processes: a 2-rank
``accumix train loggers=[csv,mlflow,wandb,clearml]`` job is pre-empted by SIGTERM to its
launcher (a second job on its run directory refused meanwhile), its restart is SIGKILLed (the
workers must die with the launcher) after steps it logged but never checkpointed, and the job
ends on one process. Every tracker is read back through its own library (MLflow's client,
``wandb leet inspect``, ClearML's offline session files) and compared with metrics.csv: one
run, each step once, the attempts' changes recorded (issue 29 items 4, 6, 7, 9, 10). No
process may touch the network: every HTTP(S) client is pointed at a loopback listener that
counts connections, and it must count none.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from accumix.errors import ConfigError
from accumix.trainer.run_lock import check_run_dir_free

ACCUMIX = [sys.executable, "-m", "accumix.cli.main"]
JOB = ["global_batch_size=8", "micro_batch_size=2", "precision=fp32", "reduce_dtype=bf16",
       "strategy=ddp", "eval_every=null", "checkpoint_every=2", "model.n_layer=1",
       "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_files=8",
       "data.max_val_bytes=500", "sample.max_new_tokens=0", "progress_bar=false", "plot=false",
       "loggers=[csv,mlflow,wandb,clearml]", "system_metrics_every=1", "log_model=true",
       "name=tracked"]
LONG = 400  # max_steps of the attempts that are stopped long before it


@pytest.fixture
def listener() -> Iterator[list[str]]:
    """A loopback TCP server standing in for every network destination; yields its port, then
    the first bytes of each connection made to it (the test wants none)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    peers: list[str] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                peers.append(conn.recv(120).decode(errors="replace"))  # the request line
            except OSError as exc:
                peers.append(repr(exc))
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    peers.insert(0, str(server.getsockname()[1]))  # the port, first
    yield peers
    stop.set()
    thread.join()
    server.close()


def _environment(home: Path, port: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MLFLOW_TRACKING_URI", "WANDB_MODE",
                        "WANDB_API_KEY", "CLEARML_API_HOST", "CLEARML_CONFIG_FILE",
                        "CLEARML_CACHE_DIR", "NO_PROXY", "no_proxy")}
    trap = f"http://127.0.0.1:{port}"
    env.update(HOME=str(home), OMP_NUM_THREADS="1", HTTP_PROXY=trap, HTTPS_PROXY=trap,
               http_proxy=trap, https_proxy=trap, WANDB_BASE_URL=trap)
    return env


def _start(run_dir: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*ACCUMIX, "train", *JOB, f"output_dir={run_dir}", *extra],
                            env=env, cwd=run_dir.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_row(job: subprocess.Popen[str], run_dir: Path, step: int) -> int:
    """Waits (bounded) until metrics.csv has a row of ``step`` or later; the last step."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        steps = sorted(_csv_losses(run_dir)) if (run_dir / "metrics.csv").exists() else []
        if steps and steps[-1] >= step:
            return steps[-1]
        time.sleep(0.1)
    raise AssertionError(f"no row {step} (exit {job.poll()}): {job.communicate()[1][-3000:]}")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue  # gone meanwhile
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] \
            != "Z"
    except OSError:
        return False


def _csv_losses(run_dir: Path) -> dict[int, float]:
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def _wandb_attempts(run_dir: Path) -> list[dict]:
    """Each offline attempt's records, read with W&B's own reader (``wandb leet inspect``)."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    attempts = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(folder)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        # a killed attempt's file may hold nothing yet: its id is in the folder's name
        run = next((r["run"] for r in records if r["type"] == "run"),
                   {"run_id": folder.name.rpartition("-")[2]})
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        config = {}
        for r in records:
            if r["type"] in ("run", "config"):
                config.update((r.get("run", r).get("config") or {}).get("update", {}))
        exits = [r["exit"]["exit_code"] for r in records if r["type"] == "exit"]
        attempts.append({"run_id": run["run_id"], "history": history, "config": config,
                         "exits": exits})
    return attempts


def test_a_job_preempted_then_killed_then_resumed_on_one_process_keeps_one_history(
        tmp_path: Path, listener: list[str]) -> None:
    from mlflow.tracking import MlflowClient

    home = tmp_path / "home"
    home.mkdir()
    env = _environment(home, listener[0])
    run_dir = tmp_path / "run"
    jobs: list[subprocess.Popen[str]] = []
    try:
        # Attempt 1, two ranks: SIGTERM to the launcher (a scheduler's pre-emption). A second
        # job on the same run directory meanwhile is refused (the check `accumix train` makes
        # before it starts any rank: tests/unit/test_cli.py runs it through the command).
        jobs.append(_start(run_dir, env, "nproc=2", f"max_steps={LONG}"))
        _wait_for_row(jobs[0], run_dir, 2)
        with pytest.raises(ConfigError, match=r"is in use by a live job \(pid \d+ on "):
            check_run_dir_free(run_dir)
        os.kill(jobs[0].pid, signal.SIGTERM)
        _, err = jobs[0].communicate(timeout=120)
        assert jobs[0].returncode == 143, err[-3000:]  # was 1 with a SignalException traceback
        assert "Traceback" not in err
        preempted = max(_csv_losses(run_dir))
        assert (run_dir / "latest").read_text().strip() == f"step-{preempted}"  # was step-4 of 7
        ids = json.loads((run_dir / "trackers.json").read_text())
        client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
        assert client.get_run(ids["mlflow"]["run_id"]).info.status == "KILLED"  # was RUNNING

        # Attempt 2, two ranks: the launcher is SIGKILLed; its workers must die with it.
        jobs.append(_start(run_dir, env, "nproc=2", f"max_steps={LONG}"))
        last = _wait_for_row(jobs[1], run_dir, preempted + 5)
        workers = _children(jobs[1].pid)
        assert len(workers) == 2
        os.kill(jobs[1].pid, signal.SIGKILL)
        jobs[1].wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "the workers outlived their launcher"
        # The rows logged up to the kill (under load the job logs on past the one waited for).
        last = max(_csv_losses(run_dir))
        # The job is resumed from an earlier checkpoint than the rows it logged: a crash
        # after those rows were logged, before their checkpoint.
        resume = max(s for s in range(preempted + 1, last) if s % 2 == 0)
        for step_dir in run_dir.glob("step-*"):
            if int(step_dir.name[5:]) > resume:
                shutil.rmtree(step_dir)
        (run_dir / "latest").write_text(f"step-{resume}")

        # Attempt 3, one process (an elastic restart on fewer ranks): K 2 -> 4.
        final = last + 1
        jobs.append(_start(run_dir, env, "nproc=1", f"max_steps={final}"))
        _, err = jobs[2].communicate(timeout=600)
        assert jobs[2].returncode == 0, err[-3000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    losses = _csv_losses(run_dir)
    assert sorted(losses) == list(range(1, final + 1))
    ids = json.loads((run_dir / "trackers.json").read_text())

    # MLflow: one run, FINISHED; one point per optimizer step, = metrics.csv; the keys of
    # rank 1 (not logged by the one-process attempt) kept; each attempt's changes recorded.
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    assert runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == sorted(losses.items())
    assert "system/rank1/rss_mb" in runs[0].data.metrics  # vanished on resume
    rank1 = client.get_metric_history(run_id, "system/rank1/rss_mb")
    assert sorted(m.step for m in rank1) == list(range(1, resume + 1))
    params = runs[0].data.params
    assert {k: params[k] for k in ("grad_accum_steps", "micro_batch_size", "global_batch_size",
                                   "world_size", "precision", "backend", "strategy")} == {
        "grad_accum_steps": "2", "micro_batch_size": "2", "global_batch_size": "8",
        "world_size": "2", "precision": "fp32", "backend": "torch", "strategy": "ddp"}
    assert (params["attempt3.world_size"], params["attempt3.grad_accum_steps"],
            params["attempt3.config.max_steps"]) == ("1", "4", str(final))  # were stale
    assert "attempt3.global_batch_size" not in params  # unchanged: 8
    assert params["config.max_steps"] == str(LONG)
    # The YAML key reached the Accelerator: the 2-rank attempts reduced in bf16; one process
    # reduces nothing.
    assert (params["config.reduce_dtype"], params["dtype_reduction"],
            params["dtype_accumulation"], params["attempt3.dtype_reduction"]) == (
        "bf16", "bfloat16", "float32", "none")
    assert runs[0].data.tags["job"] == "tracked"
    for name in ("cpu_percent", "rss_mb", "step_time_s"):
        points = client.get_metric_history(run_id, f"system/rank0/{name}")
        assert sorted(m.step for m in points) == list(range(1, final + 1)), name
    assert "model.safetensors" in [a.path for a in client.list_artifacts(run_id)]

    # W&B offline: one run id; the attempts, synced in order, hold every step once (the
    # killed attempt's rows were lost in wandb-core's buffer: the next attempt re-sent them);
    # the pre-empted attempt closed with its rows.
    attempts = _wandb_attempts(run_dir)
    assert [a["run_id"] for a in attempts] == [ids["wandb"]["run_id"]] * 3
    assert [row["_step"] for row in attempts[0]["history"]] == list(range(1, preempted + 1))
    assert (attempts[0]["exits"], attempts[2]["exits"]) == ([143], [0])
    held: dict[int, float] = {}
    for attempt in attempts:
        held = {**{row["_step"]: row["loss"] for row in attempt["history"]}, **held}
    assert sorted(held) == sorted(losses)  # was missing the killed attempt's steps
    # Steps the killed 2-rank attempt logged and kept, and the 1-process attempt repeated:
    # W&B keeps the first value (a resume on another world size sums in another order).
    assert {s: v for s, v in held.items() if s <= resume} == {
        s: v for s, v in losses.items() if s <= resume}
    assert held == pytest.approx(losses, rel=1e-6)
    assert {"system/rank0/rss_mb", "system/rank1/rss_mb"} <= set(attempts[0]["history"][-1])
    assert (attempts[2]["config"]["world_size"], attempts[2]["config"]["grad_accum_steps"]) \
        == (1, 4)
    assert (attempts[0]["config"]["world_size"], attempts[0]["config"]["grad_accum_steps"],
            attempts[0]["config"]["global_batch_size"], attempts[0]["config"]["precision"]) \
        == (2, 2, 8, "fp32")

    # ClearML offline: one task id for the job; a session per attempt; the pre-empted one
    # stopped, the last completed with its iterations.
    sessions = ids["clearml"]["offline_sessions"]
    assert len(sessions) == 3 and sessions[0] == ids["clearml"]["run_id"]
    for session, status, steps in ((sessions[0], "stopped", range(1, preempted + 1)),
                                   (sessions[2], "completed", range(resume + 1, final + 1))):
        folder = run_dir / "clearml" / "offline" / session
        events = [event for line in (folder / "metrics.jsonl").read_text().splitlines()
                  if line.strip() for event in json.loads(line)]  # a list per reported batch
        loss = sorted((e["iter"], e["value"]) for e in events if e["metric"] == "loss")
        assert loss == [(s, losses[s]) for s in steps]
        task = json.loads((folder / "task.json").read_text())
        assert task["status"] == status
    hyper = json.loads((run_dir / "clearml" / "offline" / sessions[0] / "task.json")
                       .read_text())["hyperparams"]["accumix"]
    assert {k: hyper[k]["value"] for k in ("world_size", "grad_accum_steps",
                                           "global_batch_size", "precision")} == {
        "world_size": "2", "grad_accum_steps": "2", "global_batch_size": "8",
        "precision": "fp32"}

    # metrics.csv carries every rank's system metrics too.
    with (run_dir / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    assert {"system/rank0/cpu_percent", "system/rank1/cpu_percent"} <= set(header)
    assert listener[1:] == [], "a tracker tried the network"
