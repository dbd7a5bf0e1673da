"""The accumulation steps K from the batch sizes a user gives: shared by the torch and JAX backends.

Imports nothing but ``accumix.errors``, so the JAX side does not pay for torch's import.
"""

from __future__ import annotations

from accumix.errors import ConfigError


def derive_grad_accum_steps(
    *,
    grad_accum_steps: int | None,
    global_batch_size: int | None,
    micro_batch_size: int | None,
    dp_world_size: int,
) -> int | None:
    """The number of micro-steps per optimizer step, from what the user gave.

    Args:
        grad_accum_steps: an explicit K, or None.
        global_batch_size: samples per optimizer step over all data-parallel ranks, or None.
        micro_batch_size: samples per forward on one rank, or None (then it is taken from the
            first DataLoader set up, and this returns None until then).
        dp_world_size: the number of data-parallel ranks.

    Returns:
        K >= 1, or None when ``micro_batch_size`` is still unknown.

    Raises:
        ConfigError: K below 1, a global batch that does not divide, or contradicting numbers.
    """
    for name, value in (
        ("grad_accum_steps", grad_accum_steps),
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ConfigError(f"{name}={value!r} is invalid; use an integer >= 1")
    if global_batch_size is None:
        if micro_batch_size is not None and grad_accum_steps is None:
            return 1
        return grad_accum_steps or 1
    if micro_batch_size is None:
        return grad_accum_steps  # resolved when a loader brings its batch size
    per_step = micro_batch_size * dp_world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size="
            f"{micro_batch_size} x data-parallel world size {dp_world_size} = {per_step}; "
            f"{_what_divides(global_batch_size, micro_batch_size, dp_world_size)}"
        )
    derived = global_batch_size // per_step
    if grad_accum_steps is not None and grad_accum_steps != derived:
        raise ConfigError(
            f"grad_accum_steps={grad_accum_steps} contradicts global_batch_size="
            f"{global_batch_size} / (micro_batch_size={micro_batch_size} x world "
            f"{dp_world_size}) = {derived}; give either grad_accum_steps or the batch sizes"
        )
    return derived


def _what_divides(global_batch: int, micro: int, world: int) -> str:
    if global_batch % micro:
        divisors = [m for m in range(1, global_batch + 1) if global_batch % m == 0]
        return f"micro batch sizes that divide it: {divisors[:12]}"
    worlds = [w for w in range(1, global_batch // micro + 1) if (global_batch // micro) % w == 0]
    return f"data-parallel world sizes that would divide it: {worlds[:12]}"
