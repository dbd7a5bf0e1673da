"""The ``accumix`` command: the default recipe on 2 ranks, env, estimate-memory, plot, launch
planning (SLURM too) and usage errors."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accumix.cli.launch import plan_launch, slurm_settings, torchrun_args
from accumix.cli.main import main
from accumix.errors import ConfigError
from accumix.memory.model import estimate_memory
from accumix.recipes.gpt import GPT, GPTConfig

# The default recipe, shrunk to seconds: 1 layer, short documents, 20 files, 8 steps.
SHORT = ["max_steps=8", "eval_every=4", "checkpoint_every=8", "model.n_layer=1",
         "model.n_embd=64", "model.n_head=2", "model.block_size=64", "data.max_files=20",
         "data.max_val_bytes=4000", "sample.max_new_tokens=20", "optimizer.warmup_steps=2",
         "optimizer.lr=1e-2", "global_batch_size=16", "micro_batch_size=4"]


def test_train_default_recipe_on_two_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    done = subprocess.run(
        [sys.executable, "-m", "accumix.cli.main", "train", *SHORT, f"output_dir={run_dir}",
         "nproc=2"], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["loss"]) for r in rows]
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    # Bytes start near ln(256) = 5.55; a few steps learn the byte statistics.
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0
    assert rows[3]["val_loss"] and rows[7]["val_loss"] and not rows[0]["val_loss"]
    assert all(float(r["tokens_per_s"]) > 0 and r["skipped"] == "0" for r in rows)
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "latest").exists() and (run_dir / "step-8").is_dir()
    assert "2 process(es), strategy ddp" in done.stdout
    assert "validation loss" in done.stdout and "sample:\ndef " in done.stdout


def test_env_reports_devices_precision_and_world(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "precision auto" in out and "launcher        none: rank 0 of world 1" in out


def test_estimate_memory_table_and_auto_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate-memory", "--params", "1e9", "--world-size", "8", "--precision",
                 "bf16-mixed", "--device-gib", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    ddp, zero1 = estimate_memory(10**9, world_size=8, precision="bf16-mixed")[:2]
    assert out[2].split()[:6] == ["ddp", "3.73", "3.73", "7.45", "0.00",
                                  f"{ddp.total_bytes / 2**30:.2f}"]
    assert out[2].split()[-1] == "no" and out[3].split()[-1] == "yes"
    assert out[-1] == (f"auto: zero1: {zero1.total_bytes / 2**30:.2f} GiB per rank fits 80% of "
                       f"16.00 GiB; ddp needs {ddp.total_bytes / 2**30:.2f} GiB")
    # The recipe's model, from the same overrides as train.
    assert main(["estimate-memory", "model.n_layer=12", "model.n_embd=768", "model.n_head=12",
                 "--world-size", "2", "--device-gib", "80", "--precision", "fp32"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    with torch.device("meta"):
        count = GPT(GPTConfig(block_size=128, n_layer=12, n_head=12, n_embd=768)).num_parameters(
            non_embedding=False)
    assert first.startswith(f"the recipe's GPT ({count:,} parameters, micro batch 8 x 128")
    assert main(["estimate-memory", "--params", "lots"]) == 2


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    columns = ["step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "samples_per_s",
               "tokens_per_s", "val_loss"]
    with (tmp_path / "metrics.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for step in range(1, 6):
            writer.writerow([step, 5 - step * 0.5, 1e-3, 2.0, 65536 / 2 ** (step == 3),
                             int(step == 3), 10, 1000, 3.0 if step == 5 else ""])
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.csv' does not exist" in capsys.readouterr().err


def test_usage_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["launch"], ["bogus"], ["launch", "--nproc", "0", __file__],
                 ["launch", "--nproc", "two", __file__], ["launch", "missing.py"], []):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def test_launch_plan_defaults_and_slurm() -> None:
    plan = plan_launch(nproc="auto", environ={})
    assert (plan.nnodes, plan.node_rank, plan.master_addr) == (1, 0, "127.0.0.1")
    assert plan.nproc == len(os.sched_getaffinity(0)) and plan.threads_per_process == 1
    assert plan_launch(nproc=1, environ={}).threads_per_process == plan.nproc
    with pytest.raises(ConfigError, match="nnodes=2 needs --master-addr"):
        plan_launch(nproc=1, nnodes=2, environ={})
    with pytest.raises(ConfigError, match="node-rank=2 is invalid with nnodes=2"):
        plan_launch(nproc=1, nnodes=2, node_rank=2, master_addr="h", environ={})
    slurm = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1",
             "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_CPUS_ON_NODE": "8"}
    plan = plan_launch(nproc="auto", environ=slurm)
    assert (plan.nproc, plan.nnodes, plan.node_rank, plan.master_addr, plan.master_port,
            plan.threads_per_process) == (8, 2, 1, "gpu07", 11234, 1)
    assert torchrun_args(plan, "train.py", ["--x"])[:5] == [
        "--nnodes=2", "--nproc-per-node=8", "--node-rank=1", "--master-addr=gpu07",
        "--master-port=11234"]
    with pytest.raises(ConfigError, match="srun --ntasks-per-node=1"):
        slurm_settings({**slurm, "SLURM_STEP_NUM_TASKS": "16"})


def test_one_node_launch_holds_the_jax_coordinator_port_on_loopback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The port the ranks are told for JAX's coordinator stays bound by the launcher: a plain
    bind is refused (before, a free port could be taken before rank 0 bound it), a
    SO_REUSEPORT listener of the same user (JAX's gRPC service) binds it and is reached."""
    import errno
    import socket

    from accumix.cli.launch import jax_coordinator_port

    monkeypatch.delenv("ACCUMIX_JAX_COORDINATOR", raising=False)
    with jax_coordinator_port(plan_launch(nproc=2, environ={})):
        host, port = os.environ["ACCUMIX_JAX_COORDINATOR"].rsplit(":", 1)
        assert host == "127.0.0.1"
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind((host, int(port)))
        assert refused.value.errno == errno.EADDRINUSE
        with socket.socket() as service:
            service.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            service.bind((host, int(port)))
            service.listen()
            with socket.socket() as client:  # closes first: its side keeps the TIME_WAIT
                client.connect((host, int(port)))
                accepted = service.accept()[0]
            accepted.close()
    assert "ACCUMIX_JAX_COORDINATOR" not in os.environ
    with socket.socket() as other:
        other.bind((host, int(port)))  # released with the launch
    # Several nodes (each its own launcher) keep MASTER_PORT + 1; a set variable wins.
    with jax_coordinator_port(plan_launch(nproc=1, nnodes=2, master_addr="127.0.0.1",
                                          environ={})):
        assert "ACCUMIX_JAX_COORDINATOR" not in os.environ
    monkeypatch.setenv("ACCUMIX_JAX_COORDINATOR", "127.0.0.1:1234")
    with jax_coordinator_port(plan_launch(nproc=2, environ={})):
        assert os.environ["ACCUMIX_JAX_COORDINATOR"] == "127.0.0.1:1234"
    # The kernel may hand out MASTER_PORT (only checked free; torchrun's store binds it later,
    # then failed with EADDRINUSE): forced here, the held port is another one.
    master = plan_launch(nproc=2, environ={})
    real = socket.socket

    class FirstBindTakesMasterPort(real):
        def bind(self, address: Any) -> None:
            first = not calls
            calls.append(address)
            super().bind((address[0], master.master_port) if first else address)

    calls: list[Any] = []
    monkeypatch.delenv("ACCUMIX_JAX_COORDINATOR")
    monkeypatch.setattr(socket, "socket", FirstBindTakesMasterPort)
    with jax_coordinator_port(master):
        held = int(os.environ["ACCUMIX_JAX_COORDINATOR"].rsplit(":", 1)[1])
    monkeypatch.setattr(socket, "socket", real)
    assert held != master.master_port and len(calls) == 2, (held, master.master_port, calls)
    # Process 0's service listens on the loopback address only (JAX's default: every one).
    pytest.importorskip("jax")
    from accumix.jax.distributed import bind_address

    assert bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
    assert bind_address("localhost:1234") == "localhost:1234"
    assert bind_address("10.1.2.3:1234") is None


def test_output_errors_of_a_two_process_job_are_one_line_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An unwritable MLFLOW_TRACKING_URI gave exit 1 and 41 lines (rank 1's gloo traceback
    among them), a missing package its line twice and torch's launcher error; a second job
    on a run directory in use ran beside the first (issue 29 items 10, 11)."""
    import importlib.util

    run_dir = tmp_path / "run"
    job = ["train", "nproc=2", "global_batch_size=8", "micro_batch_size=2",
           f"output_dir={run_dir}"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{blocker}/sub/mlflow.db")
    assert main([*job, "loggers=[csv,mlflow]"]) == 2
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main([*job, "loggers=[csv,wandb]"]) == 2
    from accumix.trainer.run_lock import lock_run_dir

    held = lock_run_dir(run_dir)  # a live job's lock
    try:
        assert main([*job, "loggers=[csv]"]) == 2
    finally:
        held.release()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err
    assert err[0].startswith("accumix train: error: mlflow cannot use the tracking location "
                             f"'sqlite:///{blocker}/sub/mlflow.db'")
    assert err[1] == ("accumix train: error: the wandb logger needs the wandb package; pip "
                      "install 'accumix[wandb]' or drop 'wandb' from loggers")
    assert err[2] == (f"accumix train: error: run directory '{run_dir}' is in use by a live job "
                      f"(pid {os.getpid()} on {os.uname().nodename}); wait for it to end (or "
                      "stop it), or give this job another run directory (output_dir=)")


@pytest.mark.parametrize("codes,status", [
    ({0: 2, 1: -15}, 2),  # rank 0's ConfigError; the agent stopped rank 1 before its own exit 2
    ({0: 2, 1: 2}, 2),
    ({0: 2, 1: -11}, 1),  # a crash is not a config error
    ({0: 3, 1: -15}, 1),
    ({0: 143, 1: 143}, 143),  # the Trainer's pre-emption on every rank: requeue (issue 29)
    ({0: 143, 1: -15}, 143),
])
def test_launch_exits_2_when_the_ranks_failed_with_a_config_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], codes, status
) -> None:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from accumix.cli.launch import plan_launch, run_torchrun

    def failing(_args: object) -> None:
        raise ChildFailedError("job.py", {rank: ProcessFailure(rank, 1000 + rank, code, "")
                                          for rank, code in codes.items()})

    monkeypatch.setattr(torchrun, "run", failing)
    assert run_torchrun(plan_launch(nproc=2), "job.py", []) == status
    assert ("accumix launch: rank" in capsys.readouterr().out) == (status == 1)


@pytest.mark.parametrize("ranks,status,line", [
    ({}, 143, "stopped by SIGTERM, forwarded to every rank (exit status 143)"),  # no handler
    ({0: "saved", 1: "saved"}, 143, "stopped by SIGTERM; every rank saved /run/step-3 (exit "
     "status 143): run the same command again to resume"),
    # issue 38: a rank crashed before its boundary (its DataLoader workers killed): was 143
    ({0: "saved", 1: "armed"}, 1, "stopped by SIGTERM, but rank(s) 1 ended without saving "
     "(their output is above): this stop left no checkpoint (exit status 1)"),
    ({0: "closed", 1: "closed"}, 143, "forwarded to every rank (exit status 143)"),
    ({0: "saved before a restart", 1: "saved before a restart"}, 1, "rank(s) 0, 1 ended "
     "without saving"),
])
def test_launch_signalled_exits_143_only_when_every_rank_saved(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ranks, status, line
) -> None:
    """The ranks' reports (``accumix.common.preemption_report``) written under the directory
    the launcher names, then torchrun's agent raising the signal it got."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from accumix.cli.launch import plan_launch, run_torchrun
    from accumix.common import preemption_report as report

    def signalled(_args: object) -> None:
        for rank, what in ranks.items():
            if what == "saved before a restart":
                report.note_armed(rank)
                report.note_saved(rank, "/run/step-2")
                monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
            report.note_armed(rank)
            if what == "saved":
                report.note_saved(rank, "/run/step-3")
            if what == "closed":
                report.note_disarmed(rank)
            monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        raise SignalException("", signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", signalled)
    assert run_torchrun(plan_launch(nproc=2), "job.py", []) == status
    assert line in capsys.readouterr().err
    assert report.ENV not in os.environ
