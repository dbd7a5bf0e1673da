"""``micro_batch_size="auto"`` on JAX: the choice read from the compiled window step.

No trial run: for a candidate micro-batch ``m`` (rows of one process per micro-step) the window
step is built for ``K = G / (processes x m)``, lowered on a window of ``make_batch(m)`` and
compiled, and XLA's ``memory_analysis()`` of that executable gives what one device needs:

    peak(m) = arguments + outputs - aliased (the donated state the outputs reuse) + temporaries

which is exact for static shapes (the window's data is part of the arguments; the scan's
activations, the gradient accumulator and the optimizer update are temporaries). The largest
candidate with ``peak(m) <= limit x (1 - headroom)`` wins; the candidates and the bisection are
``micro_batch_search``'s (memory grows with ``m``, so about log2(#candidates) compilations).
Every process chooses on its own devices, then the minimum over processes is taken (one
all-gather), so a process with less memory never runs another K. Given a run directory, the
answer is cached there (``accumix.memory.micro_batch_cache``'s file and format, under
``cache_key``'s JAX key), so a restart with the same settings compiles nothing and one on another
world size (or device, precision, strategy, shapes...) chooses again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from accumix.common.micro_batch_search import (
    MicroBatchChoice,
    candidates,
    check_headroom,
    fits_with_headroom,
    is_auto,
    largest_fitting,
)
from accumix.errors import ConfigError
from accumix.jax.data import make_window
from accumix.jax.step import build_step

if TYPE_CHECKING:
    from accumix.jax.accelerator import Accelerator
    from accumix.jax.state import TrainState

log = logging.getLogger("accumix")

MakeBatch = Callable[[int], Any]


def device_total_bytes() -> int | None:
    """What one local device may hold (XLA's ``bytes_limit``), or None where it reports
    nothing (the CPU backend)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def compiled_peak_bytes(compiled: Any) -> int:
    """One device's memory for a compiled executable, from ``memory_analysis()``."""
    stats = compiled.memory_analysis()
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def window_peak_bytes(acc: Accelerator, state: TrainState, loss_fn: Any, make_batch: MakeBatch,
                      micro_batch_size: int, *, clip_norm: float | None) -> int:
    """``peak(m)``: the window step for ``micro_batch_size`` rows, compiled, not run."""
    global_batch = acc.global_batch_size
    assert global_batch is not None
    steps = global_batch // (acc.world_size * micro_batch_size)
    jitted = build_step(loss_fn, optimizer=acc.optimizer, strategy=acc.strategy,
                        policy=acc.policy, scaler=acc.scaler, grad_accum_steps=steps,
                        clip_norm=clip_norm, state_shardings=acc.state_shardings)
    batch = make_batch(micro_batch_size)
    window = make_window([batch] * steps, grad_accum_steps=steps, strategy=acc.strategy,
                         local_devices=acc.local_devices)
    return compiled_peak_bytes(jitted.lower(state, window).compile())


def cache_key(acc: Accelerator, state: TrainState, make_batch: MakeBatch, *,
              clip_norm: float | None, headroom: float) -> str:
    """What the answer depends on: processes and devices, the device kind, precision, strategy
    (its ``repr`` holds its memory settings), a one-row batch's shapes and dtypes, the state's
    shapes and dtypes (params and optimizer state: another optimizer or model needs another
    answer), the global batch, the limit, the headroom and the clipping."""
    from accumix.memory.micro_batch_cache import key_of

    def shapes(tree: Any) -> str:
        return repr([(tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)))
                     for x in jax.tree.leaves(tree)])

    device = jax.local_devices()[0]
    parts = {"backend": "jax", "world": acc.world_size, "devices": acc.num_devices,
             "device": f"{device.platform}:{device.device_kind}",
             "precision": acc.policy.name, "strategy": repr(acc.strategy),
             "shapes": shapes(make_batch(1)), "params": shapes(state.params),
             "optimizer": shapes(state.opt_state), "global_batch": acc.global_batch_size,
             "limit": acc.memory_limit, "headroom": headroom, "clip_norm": clip_norm}
    return key_of(parts)


def find(acc: Accelerator, state: TrainState, loss_fn: Any, make_batch: MakeBatch, *,
         clip_norm: float | None, headroom: float,
         run_dir: str | os.PathLike[str] | None = None) -> MicroBatchChoice:
    """The choice, agreed by every process (collective), said in one log line.

    Call it after ``state = acc.setup(params, optimizer)``, before building windows or
    ``acc.setup_loader(loader)``; nothing in ``state`` changes.

    Args:
        acc: the Accelerator, made with ``micro_batch_size="auto"``.
        state: the set-up state (its shapes and shardings are read).
        loss_fn, clip_norm: as for ``acc.train_step`` (the same compiled step).
        make_batch: ``make_batch(n)``: this process's micro-batch of n rows (numpy arrays),
            the longest the data can give.
        headroom: the fraction of the memory limit left free.
        run_dir: where the answer is cached (``micro_batch_auto.json``), keyed by
            ``cache_key``; None: no cache.

    Raises:
        ConfigError: ``micro_batch_size`` is not ``"auto"`` or setup was not called; no limit
            known (the CPU backend reports no memory size: pass ``memory_limit=`` in bytes);
            not even one row fits on some process; a ``headroom`` outside [0, 1).
    """
    check_headroom(headroom)
    micro, limit_bytes = acc.micro_batch_size, acc.memory_limit
    if not is_auto(micro) or acc.optimizer is None:
        raise ConfigError("find_micro_batch_size needs micro_batch_size='auto' and "
                          f"acc.setup(params, optimizer) first (micro_batch_size={micro!r})")
    if limit_bytes is None:
        raise ConfigError("micro_batch_size='auto': this device reports no memory size; pass "
                          "memory_limit= in bytes")
    global_batch = acc.global_batch_size
    assert global_batch is not None
    # A process's rows are split over its devices: only multiples of their count can run.
    sizes = [m for m in candidates(global_batch, acc.world_size) if m % acc.local_devices == 0]
    if not sizes:
        raise ConfigError(f"micro_batch_size='auto': global_batch_size={global_batch} gives "
                          f"each of {acc.world_size} processes {global_batch // acc.world_size} "
                          f"rows, which its {acc.local_devices} devices do not divide; use a "
                          f"global batch that {acc.world_size * acc.local_devices} divides")
    key = None if run_dir is None else cache_key(acc, state, make_batch, clip_norm=clip_norm,
                                                   headroom=headroom)
    cached = _cached(acc, sizes, run_dir, key)
    if cached is not None:
        return cached
    peaks: dict[int, int] = {}

    def peak(m: int) -> int:
        if m not in peaks:
            peaks[m] = window_peak_bytes(acc, state, loss_fn, make_batch, m, clip_norm=clip_norm)
        return peaks[m]

    mine, probes = largest_fitting(
        sizes, lambda m: fits_with_headroom(peak(m), limit_bytes, headroom))
    every = _all_processes([mine or 0, probes])
    agreed = int(every[:, 0].min())
    if agreed == 0:
        short = [p for p, row in enumerate(every) if row[0] == 0]
        raise ConfigError(
            f"micro_batch_size='auto': not even {sizes[0]} rows per micro-step fit in "
            f"{limit_bytes} bytes with {headroom:.0%} headroom on process {short[0]} (the "
            f"compiled step needs {peak(sizes[0])} bytes there); raise memory_limit=, use "
            "strategy='fsdp' or a smaller model")
    at_choice = _all_processes([peak(agreed), limit_bytes])
    tightest = int(np.argmax(at_choice[:, 0] / at_choice[:, 1]))
    choice = MicroBatchChoice(
        micro_batch_size=agreed, grad_accum_steps=global_batch // (acc.world_size * agreed),
        dp_world_size=acc.world_size, global_batch_size=global_batch,
        peak_bytes=int(at_choice[tightest, 0]), limit_bytes=int(at_choice[tightest, 1]),
        tightest_rank=tightest, probes=int(every[:, 1].max()))
    log.info("%s", choice.describe())
    if key is not None and jax.process_index() == 0:
        from accumix.memory.micro_batch_cache import write_cache

        write_cache(run_dir, key, agreed)
    return choice


def _cached(acc: Accelerator, sizes: list[int], run_dir: str | os.PathLike[str] | None,
            key: str | None) -> MicroBatchChoice | None:
    """The run directory's answer under ``key`` when every process reads the same valid one
    (one all-gather), else None: then every process compiles and chooses."""
    if key is None:
        return None
    from accumix.memory.micro_batch_cache import read_cache

    every = _all_processes([read_cache(run_dir, key) or 0])[:, 0]
    micro = int(every[0])
    if micro not in sizes or (every != micro).any():
        return None
    global_batch = acc.global_batch_size
    assert global_batch is not None and acc.memory_limit is not None
    choice = MicroBatchChoice(
        micro_batch_size=micro, grad_accum_steps=global_batch // (acc.world_size * micro),
        dp_world_size=acc.world_size, global_batch_size=global_batch, peak_bytes=0,
        limit_bytes=acc.memory_limit, tightest_rank=0, probes=0)
    log.info("%s (cached in %s)", choice.describe().split(":")[0], run_dir)
    return choice


def rebatched(choice: MicroBatchChoice | None, loader: Any) -> Any:
    """The user's DataLoader at the micro-batch ``auto`` chose (whatever batch size it was
    given): the same dataset, sampler (shuffle, generator), collate_fn, workers, so the same
    exact-resume rules (``accumix.data.loader.with_batch_size``); as given when nothing was
    chosen."""
    if choice is None:
        return loader
    from accumix.data.loader import with_batch_size

    return with_batch_size(loader, choice.micro_batch_size)


def _all_processes(row: list[int]) -> np.ndarray:
    """Every process's ``row`` of integers, stacked in process order (one all-gather)."""
    mine = np.asarray(row, dtype=np.int64)
    if jax.process_count() == 1:
        return mine[None]
    from jax.experimental import multihost_utils

    # As bytes: without jax_enable_x64 an int64 array would travel as int32 (bytes overflow).
    every = multihost_utils.process_allgather(mine.view(np.uint8))
    return np.asarray(every, dtype=np.uint8).reshape(jax.process_count(), -1).view(np.int64)
