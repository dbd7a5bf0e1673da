"""``micro_batch_size="auto"``: the search both backends share (DESIGN.md semantics 7).

Backend-free (imports nothing but ``accumix.errors``): the torch side probes a set-up model with
a real forward + backward + optimizer allocation, the JAX side reads the compiled window step's
``memory_analysis()``; both hand this module a ``fits(n)`` that already agrees across ranks
(the minimum over ranks: a rank that runs out of memory counts as "does not fit" everywhere),
and this module picks the candidate.

Only micro-batch sizes that divide ``global_batch_size / data-parallel world`` are candidates,
so K is an integer and the global batch stays exactly what the user gave.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from accumix.errors import ConfigError

AUTO = "auto"
DEFAULT_HEADROOM = 0.10


def is_auto(micro_batch_size: object) -> bool:
    """Whether ``micro_batch_size`` asks for the automatic search."""
    return isinstance(micro_batch_size, str) and micro_batch_size == AUTO


def check_micro_batch_word(micro_batch_size: object, global_batch_size: int | None) -> None:
    """Refuses a string other than ``"auto"``, and ``"auto"`` without a global batch.

    Raises:
        ConfigError: naming the value and what works.
    """
    if isinstance(micro_batch_size, str) and not is_auto(micro_batch_size):
        raise ConfigError(f"micro_batch_size={micro_batch_size!r} is invalid; use an integer "
                          ">= 1 or 'auto'")
    if is_auto(micro_batch_size) and global_batch_size is None:
        raise ConfigError("micro_batch_size='auto' needs global_batch_size= (the number the "
                          "search keeps exact); pass global_batch_size=G, or an integer "
                          "micro_batch_size")


def candidates(global_batch_size: int, dp_world_size: int) -> list[int]:
    """The micro-batch sizes that keep ``global_batch_size`` exact on this world, ascending.

    Raises:
        ConfigError: the global batch does not divide over the data-parallel ranks.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size!r} is invalid; use an integer "
                          ">= 1")
    if global_batch_size % dp_world_size:
        worlds = [w for w in range(1, global_batch_size + 1) if global_batch_size % w == 0]
        raise ConfigError(f"global_batch_size={global_batch_size} does not divide over "
                          f"{dp_world_size} data-parallel ranks; world sizes that divide it: "
                          f"{worlds[:12]}")
    per_rank = global_batch_size // dp_world_size
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def parse_memory_limit(memory_limit: int | float | str | None, *,
                       device_total: int | None) -> int | None:
    """What the search may use per device, in bytes.

    Args:
        memory_limit: None (the device's total), an integer number of bytes, or a percentage
            string such as ``"90%"`` of ``device_total``.
        device_total: the device's memory in bytes (on CPU: this process's share of the
            host's memory), or None where it is unknown.

    Returns:
        Bytes, or None when neither a limit nor the device's total is known.

    Raises:
        ConfigError: a malformed value, a percentage without a known total, or a limit above
            the device's total.
    """
    if memory_limit is None:
        return device_total
    if isinstance(memory_limit, str):
        text = memory_limit.strip()
        try:
            percent = float(text[:-1]) if text.endswith("%") else None
        except ValueError:
            percent = None
        if percent is None or not 0 < percent <= 100:
            raise ConfigError(f"memory_limit={memory_limit!r} is invalid; use bytes (an integer) "
                              "or a percentage such as '90%'")
        if device_total is None:
            raise ConfigError(f"memory_limit={memory_limit!r} is a share of a total this device "
                              "does not report; give bytes instead")
        return int(device_total * percent / 100)
    # numbers.Real: a numpy integer or float (from a config computed with numpy) is a number.
    # An infinite or NaN limit has no bytes (int() of it raised OverflowError/ValueError).
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real) \
            or not math.isfinite(memory_limit) or memory_limit <= 0 \
            or memory_limit != int(memory_limit):
        raise ConfigError(f"memory_limit={memory_limit!r} is invalid; use bytes (an integer > 0) "
                          "or a percentage such as '90%'")
    limit = int(memory_limit)
    if device_total is not None and limit > device_total:
        raise ConfigError(f"memory_limit={limit} bytes ({limit / 2**30:.2f} GiB) is above the "
                          f"device's {device_total} bytes ({device_total / 2**30:.2f} GiB); "
                          "give at most that, or None for the whole device")
    return limit


def check_headroom(headroom: object) -> None:
    """Raises a one-line ``ConfigError`` unless ``headroom`` is a fraction in [0, 1)."""
    if isinstance(headroom, bool) or not isinstance(headroom, numbers.Real) \
            or not 0 <= float(headroom) < 1:
        raise ConfigError(f"headroom={headroom!r} is invalid; use a fraction in [0, 1), "
                          "e.g. 0.1")


def fits_with_headroom(peak_bytes: int, limit_bytes: int, headroom: float) -> bool:
    """A measured peak fits when it leaves ``headroom`` (a fraction) of the limit free."""
    return peak_bytes <= limit_bytes * (1.0 - headroom)


def largest_fitting(sizes: list[int], fits: Callable[[int], bool], *, top_alone: bool = False
                    ) -> tuple[int | None, int]:
    """The largest of ``sizes`` (ascending) for which ``fits`` holds, by bisection.

    Memory grows with the micro-batch, so "fits" is monotone and bisection needs about
    log2(len(sizes)) probes. ``fits`` must already be agreed across ranks: then every rank
    probes the same sizes in the same order and their collectives match.

    Args:
        sizes: the candidates, ascending.
        fits: whether a size fits (agreed across ranks).
        top_alone: the largest size is tried first, on its own, and bisection runs over the
            others only if it does not fit: it is the size with K = 1, whose window holds no
            gradient accumulator through a forward, so it may fit where smaller sizes do not
            (a model whose parameters, not activations, fill the memory).

    Returns:
        (the size or None when not even the smallest fits, the number of probes made).
    """
    probes = 0
    if top_alone and sizes:
        probes += 1
        if fits(sizes[-1]):
            return sizes[-1], probes
        sizes = sizes[:-1]
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        probes += 1
        if fits(sizes[mid]):
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best, probes


@dataclass(frozen=True, kw_only=True)
class MicroBatchChoice:
    """What the search chose and why: said in one log line, cached in the run directory."""

    micro_batch_size: int
    grad_accum_steps: int
    dp_world_size: int
    global_batch_size: int
    peak_bytes: int
    limit_bytes: int
    tightest_rank: int
    probes: int

    def describe(self) -> str:
        """The one line: ``micro_batch_size=auto chose 12 (K=4 on 2 ranks, global 64): peak
        7.1 of 8.0 GiB on rank 1 (the tightest)``."""
        ranks = "rank" if self.dp_world_size == 1 else "ranks"
        return (f"micro_batch_size=auto chose {self.micro_batch_size} "
                f"(K={self.grad_accum_steps} on {self.dp_world_size} {ranks}, global "
                f"{self.global_batch_size}): peak {_gib(self.peak_bytes)} of "
                f"{_gib(self.limit_bytes)} GiB on rank {self.tightest_rank} (the tightest)")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}" if n >= 2**28 else f"{n / 2**30:.3f}"
