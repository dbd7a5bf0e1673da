"""Asking SLURM to requeue the job after a pre-emption's checkpoint is published.

``#SBATCH --signal=USR1@90`` sends a warning signal 90 s before the time limit; accumix saves at
the next window boundary (never inside the signal handler: the save is collective) and then,
with ``requeue=True``, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (an array task:
``$SLURM_ARRAY_JOB_ID_$SLURM_ARRAY_TASK_ID``). The requeued job starts the same batch script
again and resumes from the run directory's ``latest``; a first run has nothing there and starts
afresh. Torch-free.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping

from accumix.errors import ConfigError

log = logging.getLogger("accumix")


def requeue_target(environ: Mapping[str, str] | None = None) -> str:
    """The id ``scontrol requeue`` takes for this job, checked before the run needs it.

    Raises:
        ConfigError: not inside a SLURM job, or no ``scontrol`` on ``PATH``.
    """
    environ = os.environ if environ is None else environ
    if not environ.get("SLURM_JOB_ID"):
        raise ConfigError("requeue=True needs a SLURM job (SLURM_JOB_ID is not set); submit "
                          "with sbatch, or drop requeue")
    if shutil.which("scontrol", path=environ.get("PATH")) is None:
        raise ConfigError("requeue=True needs SLURM's scontrol on PATH, and it is not there")
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else environ["SLURM_JOB_ID"]


def requeue(target: str) -> bool:
    """Runs ``scontrol requeue TARGET`` (rank 0 only, after the save is published).

    Returns:
        Whether SLURM accepted it; a refusal is logged as an error with scontrol's message
        (the checkpoint is there either way: resubmit the job by hand).
    """
    done = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        log.error("scontrol requeue %s failed (exit status %d: %s); the checkpoint is saved: "
                  "resubmit the job to resume", target, done.returncode,
                  (done.stderr or done.stdout).strip() or "no message")
        return False
    log.warning("asked SLURM to requeue job %s (scontrol requeue): it resumes from the "
                "checkpoint", target)
    return True
