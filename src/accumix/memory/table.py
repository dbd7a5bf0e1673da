"""The memory model's estimates as an aligned text table (``accumix estimate-memory``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accumix.memory.model import MemoryEstimate


def format_table(estimates: list[MemoryEstimate]) -> str:
    """Render estimates as an aligned text table (sizes in GiB, 2 decimals).

    Args:
        estimates: From ``estimate_memory``.

    Returns:
        The table, one line per strategy under a header, without a trailing newline.
    """
    header = (
        "strategy",
        "params GiB",
        "grads GiB",
        "optimizer GiB",
        "activations GiB",
        "total GiB",
        "fits",
    )
    rows = [header, *(estimate.to_row() for estimate in estimates)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
