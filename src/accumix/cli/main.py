"""The ``accumix`` command: ``launch``, ``train``, ``env``, ``estimate-memory``, ``plot``.

Exit status 0 on success; 2 on a usage or configuration error, with one line on stderr and no
traceback; 1 when the work itself failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from accumix.cli import env, estimate_memory, launch, plot, train
from accumix.common.redact import redact
from accumix.errors import ConfigError


class UsageError(Exception):
    """A command line argparse could not read."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints the usage and exits; we want one line and our own exit path.
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, one sub-parser per subcommand module."""
    parser = _Parser(prog="accumix", description="Run PyTorch training on one CPU, one GPU, "
                     "many GPUs and many machines, with exact gradient accumulation.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for module in (launch, train, env, estimate_memory, plot):
        module.add_parser(subparsers)
    return parser


def _launched_rank() -> int:
    from accumix.common.launch_env import detect_launch_env

    return detect_launch_env().rank


def _report_to_launcher(line: str) -> bool:
    """A rank started by ``accumix launch`` hands its one-line error to the launcher through
    torchrun's error file (``TORCHELASTIC_ERROR_FILE``): the launcher prints the first rank's
    once, when the launch ends, instead of one line per rank and per restart (an elastic job
    restarted on a world its global batch does not divide fails on every attempt).

    Returns:
        Whether the line was handed over (else the caller prints it).
    """
    if os.environ.get("ACCUMIX_LAUNCH") != "1" or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return False
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(ConfigError(line))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 2 usage or configuration error, 1 failure.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.run(args) or 0)
    except UsageError as exc:
        print(redact(str(exc)), file=sys.stderr)
        return 2
    except ConfigError as exc:
        command = f"accumix {args.command}" if "args" in locals() else "accumix"
        message = redact(" ".join(str(exc).split()))  # one line, no password in it
        if _report_to_launcher(f"{command}: error: {message}"):
            return 2  # accumix launch prints it once, after the last attempt
        if getattr(exc, "every_rank", False) and _launched_rank() != 0:
            return 2  # every rank raised the same error, agreed: rank 0 prints it once
        print(f"{command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("accumix: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
