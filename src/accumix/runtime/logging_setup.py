"""accumix's logger: INFO lines on rank 0 only, unless the user configured logging themselves."""

from __future__ import annotations

import logging
import sys

from accumix.common.redact import RedactingFilter


class _RankZero(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def configure_logging(rank: int) -> None:
    """Gives the ``accumix`` logger a stderr handler, once, if the user has not set one."""
    logger = logging.getLogger("accumix")
    for handler in logger.handlers:
        if getattr(handler, "_accumix", False):
            handler.filters[0].rank = rank  # type: ignore[attr-defined]
            return
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._accumix = True  # type: ignore[attr-defined]
    handler.addFilter(_RankZero(rank))
    handler.addFilter(RedactingFilter())  # a URI's password never reaches the log
    handler.setFormatter(logging.Formatter("[accumix] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
