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
