"""The Trainer and SIGTERM (issue 29 item 9), one process, real signals: a signal at an odd
moment (mid-window, during an evaluation, during a checkpoint's write, in an epoch's last
window, before the first step) is saved at the next window boundary, ``fit`` raises
``ax.Preempted`` (exit status 143), the signal handler is put back, and the resumed run ends
bit-identical to an uninterrupted one: parameters, and every logged loss. A loop that runs off
the main thread (Ray Train's worker thread) cannot catch a signal; a request
(``ax.request_preemption()``, an added check) is saved the same way, on both backends."""

from __future__ import annotations

import csv
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.common.preemption import add_preemption_check, preemption_requested
from accumix.trainer import Callback, Trainer

# 48 samples, micro-batch 4, K=2: 6 steps per epoch; 9 steps cross into the second epoch.
MAX_STEPS = 9


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class _SignalAt(Callback):
    """Sends this process SIGTERM once, at ``event`` of ``step`` (and micro-step)."""

    def __init__(self, event: str, step: int, micro_step: int = 0) -> None:
        self.event, self.step, self.micro_step, self.sent = event, step, micro_step, False

    def _at(self, trainer: Trainer, event: str) -> None:
        if (not self.sent and event == self.event and trainer.step == self.step
                and trainer.micro_step == self.micro_step):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)

    def on_fit_start(self, trainer: Trainer) -> None:
        self._at(trainer, "fit_start")

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        self._at(trainer, "batch")

    def on_validation_start(self, trainer: Trainer) -> None:
        self._at(trainer, "validation")

    def on_write_checkpoint(self, trainer: Trainer, directory: Path) -> None:
        self._at(trainer, "checkpoint_write")


def _fit(run_dir: Path, *callbacks: Callback) -> list[torch.Tensor] | ax.Preempted:
    """Shuffled data, dropout and Adam: a resume that misses any state is not bitwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        train_loader=DataLoader(_data(), batch_size=4, shuffle=True),
        val_loader=DataLoader(_data(), batch_size=8),
        accelerator=ax.Accelerator(precision="fp32", grad_accum_steps=2, seed=0),
        step_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), max_steps=MAX_STEPS,
        eval_every=2, checkpoint_every=4, run_dir=run_dir, loggers=["csv"],
        progress_bar=False, callbacks=list(callbacks))
    try:
        trainer.fit()
    except ax.Preempted as exc:
        return exc
    return [p.detach().clone() for p in model.parameters()]


def _rows(run_dir: Path) -> list[tuple[str, str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return [(r["step"], r["loss"], r.get("val_loss", "")) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[torch.Tensor], list]:
    run_dir = tmp_path_factory.mktemp("reference")
    params = _fit(run_dir)
    assert isinstance(params, list)
    return params, _rows(run_dir)


@pytest.mark.parametrize(("event", "step", "micro_step", "saved"), [
    ("batch", 2, 1, 3),              # mid-window: saved when that window ends
    ("validation", 2, 0, 2),         # during step 2's evaluation: saved at step 2
    ("checkpoint_write", 4, 0, 4),   # during step 4's save: that save serves, no second one
    ("batch", 5, 1, 6),              # in the epoch's last window: saved as the epoch ends
    ("fit_start", 0, 0, 1),          # before the first step: saved after it
])
def test_sigterm_saves_at_the_next_boundary_and_the_restart_is_bitwise(
        tmp_path: Path, reference: tuple[list[torch.Tensor], list], event: str, step: int,
        micro_step: int, saved: int) -> None:
    stopped = _fit(tmp_path, _SignalAt(event, step, micro_step))
    assert isinstance(stopped, ax.Preempted), "fit did not stop on SIGTERM"
    assert (stopped.code, stopped.step, stopped.checkpoint) == (143, saved,
                                                                 tmp_path / f"step-{saved}")
    assert (tmp_path / "latest").read_text().strip() == f"step-{saved}"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    assert [int(r[0]) for r in _rows(tmp_path)] == list(range(1, saved + 1))
    resumed = _fit(tmp_path)
    params, rows = reference
    assert isinstance(resumed, list)
    assert all(torch.equal(a, b) for a, b in zip(resumed, params, strict=True))
    assert _rows(tmp_path) == rows  # every step once, the same losses


class _RequestAt(Callback):
    """Asks for a pre-emption once, from another thread (as a cluster engine's notice would),
    at micro-step 1 of the window after ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        if not self.sent and trainer.step == self.step and trainer.micro_step == 1:
            self.sent = True
            asker = threading.Thread(target=ax.request_preemption)
            asker.start()
            asker.join()


def _in_thread(function: Any, *args: Any) -> Any:
    """``function(*args)`` in another thread, as Ray Train runs the loop (its result)."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(function(*args)), name="TrainingThread")
    worker.start()
    worker.join()
    return out[0]


def test_a_loop_off_the_main_thread_saves_a_requested_preemption(
        tmp_path: Path, reference: tuple[list[torch.Tensor], list],
        caplog: pytest.LogCaptureFixture) -> None:
    # Issue 39: before, handle_preemption raised "must be called from the main thread" there,
    # and the Trainer only warned that a SIGTERM would not be saved: the request went unseen.
    polls: list[int] = []
    remove = add_preemption_check(lambda: polls.append(1) is not None and False)
    try:
        with caplog.at_level(logging.INFO, logger="accumix"):
            stopped = _in_thread(_fit, tmp_path, _RequestAt(2))
    finally:
        remove()
    assert "will not be saved" not in caplog.text
    assert "runs off the main thread" in caplog.text  # said once: signals go unwatched there
    assert isinstance(stopped, ax.Preempted), "the request was not saved"
    assert (stopped.step, stopped.checkpoint) == (3, tmp_path / "step-3")
    assert len(polls) == 3  # the added check: polled once per window, at each agreement
    assert not preemption_requested()  # served
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # never touched off the main thread
    resumed = _in_thread(_fit, tmp_path)
    params, rows = reference
    assert all(torch.equal(a, b) for a, b in zip(resumed, params, strict=True))
    assert _rows(tmp_path) == rows


def test_jax_steps_off_the_main_thread_see_a_requested_preemption() -> None:
    # Before: JaxSteps installed its handler in __init__, which raised ValueError off the
    # main thread (Ray's JaxTrainer runs the loop in a thread). The read's agreement (what
    # stops the Trainer, as for SIGTERM) now sees a request.
    pytest.importorskip("jax")
    import accumix.jax as axj
    from accumix.trainer.jax_steps import JaxSteps
    from tests import jax_workloads as w

    def agreements() -> tuple[bool, bool, bool]:
        acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=1)
        steps = JaxSteps(accelerator=acc, state=acc.setup(w.init_params(), w.optimizer()),
                         train_windows=None, loss_fn=w.item_loss)
        before = steps._agree(1, 0.0)[0]
        ax.request_preemption()
        asked = steps._agree(1, 0.0)[0]
        steps._watch.served()  # what the stop does before it saves
        steps.close()
        return before, asked, steps._agree(1, 0.0)[0]

    assert _in_thread(agreements) == (False, True, False)
    assert not preemption_requested()
