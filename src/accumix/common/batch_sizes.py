"""The accumulation steps K from the batch sizes a user gives: shared by the torch and JAX backends.

Imports nothing but ``accumix.errors``, so the JAX side does not pay for torch's import.
"""

from __future__ import annotations

from typing import Any

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


def batch_geometry(*, steps: int, configured: int, given: str, micro_batch_size: int | None,
                   dp_world_size: int) -> dict[str, Any]:
    """What a checkpoint records of K: the K running now, the K the settings gave
    (``configured``: they differ after a ``GradientAccumulationScheduler`` or an assignment to
    ``acc.grad_accum_steps``), which setting gave it (``"grad_accum_steps"``,
    ``"global_batch_size"`` or ``"none"``), the micro batch and the data-parallel world size."""
    return {"steps": steps, "configured": configured, "given": given,
            "micro_batch_size": micro_batch_size, "dp_world_size": dp_world_size}


def resumed_grad_accum_steps(saved: dict[str, Any], mine: dict[str, Any], *,
                             global_batch_size: int | None, assigned: bool) -> int:
    """K for a run that loads a checkpoint, from both runs' ``batch_geometry``.

    * No K or batch size given: the saved K, so a K changed while the saved run trained (a
      scheduler's) is restored.
    * ``grad_accum_steps=`` given: the saved K if the saved run was given the same, else this
      run's (an explicit change); ``acc.grad_accum_steps`` assigned before the load: this run's.
    * ``global_batch_size`` given: K keeps the saved run's global batch on this world size and
      micro batch (the saved K if nothing else changed).

    Raises:
        ConfigError: ``global_batch_size`` (not K itself) gives a K whose global batch differs
            from the checkpoint's, or the saved global batch does not divide here.
    """
    steps, saved_steps = mine["steps"], saved["steps"]
    if assigned or saved_steps == steps:
        return steps
    if mine["given"] == "none":
        return saved_steps
    if mine["given"] == "grad_accum_steps":
        same = saved["given"] == "grad_accum_steps" and saved["configured"] == mine["configured"]
        return saved_steps if same else steps
    per_step = (mine["micro_batch_size"] or 0) * mine["dp_world_size"]
    saved_per_step = (saved["micro_batch_size"] or 0) * saved["dp_world_size"]
    saved_global = saved_steps * saved_per_step
    if per_step and saved_per_step and global_batch_size in (saved_global,
                                                            saved["configured"] * saved_per_step):
        if saved_global % per_step == 0:
            return saved_global // per_step
        raise ConfigError(
            f"the checkpoint's global batch of {saved_global} (K={saved_steps} x micro batch "
            f"{saved['micro_batch_size']} x {saved['dp_world_size']} ranks) is not a multiple "
            f"of micro batch {mine['micro_batch_size']} x {mine['dp_world_size']} ranks; "
            f"{_what_divides(saved_global, mine['micro_batch_size'], mine['dp_world_size'])}, "
            "or pass grad_accum_steps= to change K on purpose"
        )
    raise ConfigError(
        f"the checkpoint was saved with grad_accum_steps={saved_steps} (global batch "
        f"{saved_global or '?'}), but global_batch_size={global_batch_size} gives "
        f"grad_accum_steps={steps} here; pass global_batch_size={saved_global or '?'} to resume "
        f"as saved, or grad_accum_steps={steps} to change K on purpose"
    )


def world_change(saved: dict[str, Any], mine: dict[str, Any], steps: int) -> str | None:
    """The line that says what a resume on another data-parallel world did to K and the global
    batch (an elastic job's restart on fewer or more nodes); None on the same world.

    Args:
        saved: the checkpoint's ``batch_geometry``.
        mine: this run's.
        steps: the K this run resumes with (``resumed_grad_accum_steps``).
    """
    before, after = saved["dp_world_size"], mine["dp_world_size"]
    if before == after:
        return None
    head = f"world {before} -> {after}: K {saved['steps']} -> {steps}"
    if not (saved["micro_batch_size"] and mine["micro_batch_size"]):
        return f"{head} (micro batch not known yet)"
    old = saved["steps"] * saved["micro_batch_size"] * before
    new = steps * mine["micro_batch_size"] * after
    if old == new:
        return f"{head}, global batch {old} kept"
    return (f"{head}, global batch {old} -> {new}: K is kept without global_batch_size (give "
            f"global_batch_size={old} to keep the global batch)")
