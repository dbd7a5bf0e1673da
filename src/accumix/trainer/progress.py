"""The progress bar on rank 0: loss, learning rate, loss scale, throughput and the ETA."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm
from typing_extensions import override

from accumix.trainer.events import Callback

if TYPE_CHECKING:
    from accumix.trainer.metrics import StepMetrics
    from accumix.trainer.trainer import Trainer


def _postfix(metrics: StepMetrics) -> dict[str, str]:
    out = {"loss": f"{metrics.loss:.4f}", "lr": f"{metrics.lr:.2e}"}
    if metrics.loss_scale is not None:
        out["scale"] = f"{metrics.loss_scale:g}"
    rate = metrics.tokens_per_s
    out["tok/s" if rate is not None else "samples/s"] = (
        f"{rate:,.0f}" if rate is not None else f"{metrics.samples_per_s:,.1f}"
    )
    if metrics.skipped:
        out["skipped"] = "yes"
    return out


class ProgressBar(Callback):
    """A tqdm bar over optimizer steps on rank 0; plain lines when stderr is not a terminal.

    Args:
        lines_every: in plain-line mode, print every this many steps (default: 20 lines a run,
            at least every step).
        file: where to write (default: stderr).
    """

    def __init__(self, lines_every: int | None = None, file: Any = None) -> None:
        self.lines_every = lines_every
        self.file = file
        self._bar: tqdm | None = None
        self._plain = False
        self._total: int | None = None

    @override
    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.accelerator.is_main_process:
            return
        stream = self.file or sys.stderr
        self._total = trainer.total_steps
        self._plain = not (hasattr(stream, "isatty") and stream.isatty())
        self._started, self._first_step = time.perf_counter(), trainer.step
        if self._plain:
            self.lines_every = self.lines_every or max(1, (self._total or 200) // 20)
            self._stream = stream
            return
        self._bar = tqdm(total=self._total, initial=trainer.step, unit="step",
                         dynamic_ncols=True, file=stream, desc="train")

    @override
    def on_load_checkpoint(self, trainer: Trainer, path: Any) -> None:
        self._first_step = trainer.step
        if self._bar is not None:
            self._bar.n = trainer.step
            self._bar.refresh()

    @override
    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        if not trainer.accelerator.is_main_process:
            return
        if self._bar is not None:
            self._bar.set_postfix(_postfix(metrics), refresh=False)
            self._bar.update(metrics.step - self._bar.n)
        elif self._plain and (metrics.step % self.lines_every == 0 or metrics.step == 1):
            total = f"/{self._total}" if self._total else ""
            parts = "  ".join(f"{k} {v}" for k, v in _postfix(metrics).items())
            print(f"step {metrics.step}{total}  {parts}{self._eta(metrics.step)}",
                  file=self._stream, flush=True)

    def _eta(self, step: int) -> str:
        done = step - self._first_step
        if not self._total or done < 1:
            return ""
        left = (time.perf_counter() - self._started) / done * max(self._total - step, 0)
        return f"  eta {int(left) // 60}:{int(left) % 60:02d}"

    @override
    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if trainer.accelerator.is_main_process:
            self.write(f"step {trainer.step}: validation loss {metrics['val_loss']:.4f}")

    def write(self, message: str) -> None:
        """Prints a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message, file=self._bar.fp)
        else:
            print(message, file=self.file or sys.stderr, flush=True)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @override
    def on_fit_end(self, trainer: Trainer) -> None:
        self._close()

    @override
    def on_exception(self, trainer: Trainer, exception: BaseException) -> None:
        self._close()
