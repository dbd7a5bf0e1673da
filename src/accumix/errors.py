"""The exceptions accumix raises for users' mistakes and unrecoverable training states."""

from __future__ import annotations


class AccumixError(RuntimeError):
    """Base class of every error accumix raises on purpose."""


class ConfigError(AccumixError, ValueError):
    """A setting, a word or a combination that cannot work; the message names it and the fix."""


class LossScaleError(AccumixError):
    """fp16 gradients overflowed while the loss scale was already at its floor."""


class CheckpointError(AccumixError):
    """A checkpoint that is missing, torn, corrupt or does not fit this run; names the file."""


class CompileError(ConfigError):
    """``torch.compile`` failed (no C++ compiler, an op it cannot lower); ``compile=False``."""


# 128 + SIGTERM: the status of a process the scheduler's SIGTERM ended. Kubernetes'
# podFailurePolicy / Kubeflow's ExitCode restart policy retry 128-255 and treat 1-127 as
# permanent; SLURM's requeue does not read it; torchrun's agent restarts on any non-zero.
PREEMPTED_EXIT_CODE = 143


class Preempted(SystemExit):
    """The Trainer saved at the window boundary after a pre-emption signal (SIGTERM) and stops.

    Uncaught, the process exits with ``PREEMPTED_EXIT_CODE`` (143, 128 + SIGTERM), which a
    scheduler reads as a termination to retry; the requeued job resumes from ``checkpoint``.

    Attributes:
        step: the optimizer step saved.
        checkpoint: the step directory written (None without a run directory).
    """

    def __init__(self, step: int, checkpoint: object = None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint
