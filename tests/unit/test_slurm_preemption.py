"""SLURM's warning signal and requeue in one process (issue 39 item 4): ``acc.handle_preemption(
signals=, requeue=)``, ``accumix train preemption_signals=[SIGUSR1] requeue=true`` and the JAX
Trainer steps' signals. A stand-in ``scontrol`` on PATH records its calls and what ``latest``
named when it was called (the save must be published first). The two-rank launch, the
launcher's forwarding and the bitwise resume: tests/distributed/test_slurm_requeue.py."""

from __future__ import annotations

import csv
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import accumix as ax
from accumix.checkpoint import latest_checkpoint
from accumix.cli.main import main
from accumix.common.preemption import parse_signals
from accumix.common.slurm_requeue import requeue_target
from tests.scripts.resumable_train import build, train

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        "data.max_files=8", "data.max_val_bytes=2000", "sample.max_new_tokens=0", "nproc=1",
        "progress_bar=false", "global_batch_size=8", "micro_batch_size=4", "precision=fp32",
        "strategy=single", "eval_every=null", "checkpoint_every=null", "plot=false",
        "loggers=[csv]", "system_metrics_every=null"]


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A SLURM job's variables and a stand-in scontrol; returns its log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$* latest=$(cat "$RUN_DIR/latest" 2>/dev/null)" '
                        '>> "$SCONTROL_LOG"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SCONTROL_LOG", str(tmp_path / "scontrol.log"))
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    return tmp_path / "scontrol.log"


def _signal_once_watched(sig: int) -> threading.Thread:
    """Sends ``sig`` to this process as soon as a handler for it is installed (the Trainer
    installs it as ``fit`` starts), from another thread, as SLURM's warning would come."""

    def send() -> None:
        deadline = time.monotonic() + 120
        while signal.getsignal(sig) is signal.SIG_DFL and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(os.getpid(), sig)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_plain_loop_usr1_saves_at_the_boundary_then_requeues(slurm: Path, tmp_path: Path
                                                             ) -> None:
    run = tmp_path / "run"
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    objects = build(acc)
    acc.handle_preemption(run, signals=("SIGUSR1",), requeue=True)
    assert latest_checkpoint(run) is None  # a first run: nothing to resume, starts cleanly

    def usr1_in_window_3(acc: ax.Accelerator) -> None:
        if acc.optimizer_steps == 2 and acc._run.window.micro_step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only a flag: nothing saved in the handler

    with pytest.raises(SystemExit) as info:
        train(acc, objects, epochs=2, after_micro_step=usr1_in_window_3)
    assert info.value.code == 0 and acc.optimizer_steps == 3
    assert latest_checkpoint(run) == run / "step-3"
    assert slurm.read_text().splitlines() == ["requeue 77 latest=step-3"]  # after the publish
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_requeue_and_signals_are_checked_before_the_run(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    acc = ax.Accelerator(strategy="single", precision="fp32")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ax.ConfigError, match=r"requeue=True needs a SLURM job \(SLURM_JOB_ID"):
        acc.handle_preemption(tmp_path, requeue=True)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ax.ConfigError, match="needs SLURM's scontrol on PATH"):
        acc.handle_preemption(tmp_path, requeue=True)
    with pytest.raises(ax.ConfigError, match="signals: 'USR9' is not a signal; use names"):
        acc.handle_preemption(tmp_path, signals=("USR9",))
    assert parse_signals(["SIGUSR1", "usr2", "TERM", 15]) == (
        signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
    (tmp_path / "scontrol").write_text("")
    (tmp_path / "scontrol").chmod(0o755)
    array_task = {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "3",
                  "PATH": str(tmp_path)}
    assert requeue_target(array_task) == "9_3"


def test_accumix_train_saves_on_usr1_requeues_exits_143_and_resumes(
        slurm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    args = ["train", *TINY, f"output_dir={run}", "preemption_signals=[SIGUSR1]", "requeue=true"]
    sender = _signal_once_watched(signal.SIGUSR1)
    with pytest.raises(SystemExit) as info:
        main([*args, "max_steps=40"])
    sender.join()
    assert info.value.code == 143
    saved = latest_checkpoint(run)
    assert saved is not None
    step = int(saved.name.split("-")[1])
    assert step < 40 and slurm.read_text().splitlines() == [f"requeue 77 latest={saved.name}"]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    # The requeued job: the same command resumes at the saved step and takes one more.
    assert main([*args, f"max_steps={step + 1}"]) == 0
    assert f"done: step {step + 1}" in capsys.readouterr().out
    with (run / "metrics.csv").open() as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == list(range(1, step + 2))
    assert len(slurm.read_text().splitlines()) == 1
    # A bad name: one line, exit 2, before anything runs.
    assert main(["train", "preemption_signals=[SIGFOO]"]) == 2
    assert "preemption_signals: 'SIGFOO' is not a signal" in capsys.readouterr().err


def test_jax_steps_take_the_trainers_signals() -> None:
    pytest.importorskip("jax")
    import accumix.jax as axj
    from accumix.trainer.jax_steps import JaxSteps
    from tests import jax_workloads as w

    # Whatever held SIGTERM before (ray.init in this worker installs its own) holds it after.
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=1)
    steps = JaxSteps(accelerator=acc, state=acc.setup(w.init_params(), w.optimizer()),
                     train_windows=None, loss_fn=w.item_loss)
    steps.watch_preemption(SimpleNamespace(preemption_signals=(signal.SIGUSR1,)))
    assert signal.getsignal(signal.SIGTERM) is before[0]  # the steps' own put back
    os.kill(os.getpid(), signal.SIGUSR1)
    assert steps._agree(1, 0.0)[0]
    steps.close()
    assert signal.getsignal(signal.SIGUSR1) is before[1]
