"""Weights & Biases: offline in ``run_dir/wandb/`` unless the environment says online
(``WANDB_MODE=online``), then ``wandb sync`` uploads it (``pip install 'accumix[wandb]'``).

Rows are logged with ``step=`` the optimizer step. W&B's history cannot be rewritten: online, a
resumed run's repeated steps are below the run's last step and W&B ignores them (the first
attempt's values stay; accumix resumes exactly, so they are the same numbers); offline, each
attempt is its own ``offline-run-*`` directory under the same run id, synced in order.

wandb-core (a process of its own) buffers what it is sent and writes it when the run finishes:
an attempt killed before ``finish`` leaves its rows nowhere (no call makes it write them
earlier), so the next attempt re-sends them from ``metrics.csv`` (``base.py``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from typing_extensions import override

from accumix.errors import PREEMPTED_EXIT_CODE, ConfigError
from accumix.trainer.trackers.base import TrackerLogger, first_line


class WandbLogger(TrackerLogger):
    """One W&B run per job (offline by default).

    Args:
        project: the W&B project (default ``WANDB_PROJECT``, else ``accumix``).
        mode: ``offline`` or ``online`` (default ``WANDB_MODE``, else ``offline``).
        log_model: upload the final ``model.safetensors`` as a ``model`` artifact at ``close``.
        run_name: the run's name (default: the run directory's name).

    Raises:
        ConfigError: wandb is not installed.
    """

    word = "wandb"
    module = "wandb"
    buffers_rows = True

    def __init__(self, *, project: str | None = None, mode: str | None = None,
                 log_model: bool = False, run_name: str | None = None) -> None:
        super().__init__(log_model=log_model, run_name=run_name)
        self.project = project
        self.mode = mode
        self._run: Any = None

    @override
    def _start(self, saved: dict[str, Any] | None, resume_step: int) -> dict[str, Any]:
        import wandb

        assert self.run_dir is not None
        mode = self.mode or os.environ.get("WANDB_MODE") or "offline"
        if mode == "offline":  # offline means no network: W&B's usage reports stay off too
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        run_id = saved["run_id"] if saved else uuid.uuid4().hex[:12]
        try:
            self._run = wandb.init(
                dir=str(self.run_dir.resolve()), id=run_id, resume="allow", mode=mode,
                project=self.project or os.environ.get("WANDB_PROJECT", "accumix"),
                name=self.run_name, reinit="create_new",
                # the console stays the user's; W&B's own machine stats stay on
                settings=wandb.Settings(console="off", silent=True))
        except Exception as exc:
            raise ConfigError(f"wandb cannot start a {mode} run in {str(self.run_dir)!r} "
                              f"({first_line(exc)}); give a writable run_dir, or WANDB_MODE="
                              "offline") from None
        return {"run_id": run_id, "mode": mode}

    @override
    def _params(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)
        if tags:
            self._run.tags = tuple(sorted({*self._run.tags, *(f"{k}:{v}" for k, v in
                                                               tags.items())}))

    @override
    def _metrics(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    @override
    def _upload(self, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"model-{self._run.id}", type="model")
        artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    @override
    def _finish(self, status: str) -> None:
        if status == "PREEMPTED":
            # W&B's own word for it: a preempting run that exits non-zero shows as preempted
            self._run.mark_preempting()
            self._run.finish(exit_code=PREEMPTED_EXIT_CODE)
        else:
            self._run.finish(exit_code=0 if status == "FINISHED" else 1)
        self._run = None
