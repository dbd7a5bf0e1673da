"""Secrets in text shown with the password masked (torch-free).

A tracking location such as ``postgresql://alice:S3cretPw@db.example/mlflow`` carries a
password; accumix names the location in errors, warnings, ``trackers.json`` and trackers'
params, all of which outlive the job in terminals, CI logs and files others read. ``redact``
masks the password of every URI in a text (``postgresql://alice:***@db.example/mlflow``) and the
value of query parameters that hold credentials (``?token=***``); the rest stays readable, so
the message still says which location was meant.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

# scheme://user:password@host: the password runs to the last "@" before the path, so one
# holding "@" itself is masked whole.
_USERINFO = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^:@/\s'\"]*:)(?P<password>[^/\s'\"]*)@")
_SECRET_QUERY = re.compile(
    r"(?i)(?P<head>[?&;](?:password|passwd|pwd|secret|token|access_token|api_key|apikey"
    r"|x-amz-signature|x-amz-security-token|sig|signature)=)(?P<value>[^&#\s'\"]+)")


def redact(text: str) -> str:
    """``text`` with every URI's password and every credential query value masked.

    >>> redact("postgresql://alice:S3cretPw@db.example:5432/mlflow?sslmode=require")
    'postgresql://alice:***@db.example:5432/mlflow?sslmode=require'
    """
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m.group('head')}{MASK}@", text)
    return _SECRET_QUERY.sub(lambda m: f"{m.group('head')}{MASK}", text)


def redact_values(value: Any) -> Any:
    """``value`` with ``redact`` applied to every string in it (mappings, lists, tuples)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(v) for v in value)
    return value


class RedactingFilter(logging.Filter):
    """A handler filter that masks secrets in each record's message (``redact``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True
