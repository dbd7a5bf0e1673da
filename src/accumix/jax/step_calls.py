"""What ``acc.train_step`` and ``acc.eval_step`` return: the jitted functions (``step.py``)
with what the host does around them (make a window, check the fp16 floor, place eval rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from accumix.jax.data import Window, canonical
from accumix.jax.state import TrainState

if TYPE_CHECKING:
    from accumix.jax.accelerator import Accelerator


class TrainStep:
    """The jitted step, plus the every-N-steps fp16 floor check (the step never syncs).

    ``acc.train_step(loss_fn)`` makes it; call it as ``state, metrics = step(state, window)``
    (a ``Window``, or a list of K micro-batches that ``acc.window`` turns into one).

    Args:
        jitted: the compiled ``(state, window) -> (state, metrics)`` function.
        acc: the ``Accelerator`` that made it (for ``acc.window`` and ``acc.check``).
        check_every: under fp16, read the loss-scale floor flag every this many calls.
    """

    def __init__(self, jitted: Any, acc: Accelerator, check_every: int) -> None:
        self.jitted, self._acc, self._check_every, self._calls = jitted, acc, check_every, 0

    def __call__(self, state: TrainState, window: Window | list[Any]
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
        if not isinstance(window, Window):
            window = self._acc.window(window)
        state, metrics = self.jitted(state, window)
        self._calls += 1
        if self._acc.scaler.enabled and self._calls % self._check_every == 0:
            self._acc.check(state)
        return state, metrics

    def lower(self, state: TrainState, window: Window) -> Any:
        """``jax.jit(...).lower`` of the step (for HLO inspection).

        Args:
            state: a train state (its shapes and shardings are used).
            window: a window of the shapes the step will see.
        """
        return self.jitted.lower(state, window)


class EvalStep:
    """``acc.eval_step``'s callable: this process's rows in, the global sums out.

    Rows that this process's devices do not divide (a validation set's last batch: 6 rows on 4
    devices) are evaluated apart, one row per device, the devices left over given a copy of the
    last row with weight 0: every device holds whole rows of one weight (``build_eval`` weighs
    a device by its first row), so the sums count each row once and nothing else.

    On several processes the rows may differ between them (a validation set's last batch split
    over ranks: 8 rows on one, 7 on the other), and every process must make the same calls with
    the same shapes (each is a collective): the processes share their row counts, evaluate the
    whole part they all have in one call, and the rest one row per device, a process that ran
    out giving its devices copies of its last row with weight 0.
    """

    def __init__(self, jitted: Any, acc: Accelerator) -> None:
        self.jitted, self._acc = jitted, acc

    def __call__(self, state: TrainState, batch: Any, weight: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
        local = jax.tree.map(canonical, batch)
        rows = jax.tree.leaves(local)[0].shape[0]
        devices = self._acc.local_devices
        counts = [rows]
        if jax.process_count() > 1:  # every process's rows, to make the same calls everywhere
            counts = [int(n) for n in multihost_utils.process_allgather(np.int64(rows))]
        whole = min(n - n % devices for n in counts)  # the rows every process's devices divide
        rest = max(counts) - whole
        sums = None
        if whole:
            sums = self._run(state, jax.tree.map(lambda a: a[:whole], local),
                             np.full(whole, weight, np.float32))
        for start in range(whole, whole + rest, devices):  # one row per device
            real = max(0, min(devices, rows - start))
            pick = np.minimum(np.arange(start, start + devices), rows - 1)
            part = self._run(state, jax.tree.map(lambda a, pick=pick: a[pick], local),
                             np.where(np.arange(devices) < real, weight, 0.0).astype(np.float32))
            sums = part if sums is None else jax.tree.map(jax.numpy.add, sums, part)
        assert sums is not None, "an evaluation batch of no rows"
        return sums

    def _run(self, state: TrainState, local: Any, weights: np.ndarray
             ) -> tuple[jax.Array, jax.Array]:
        strategy = self._acc.strategy
        rows = strategy.sharding(strategy.rows_spec())
        arrays = jax.tree.map(lambda a: jax.make_array_from_process_local_data(rows, a), local)
        return self.jitted(state, arrays, jax.make_array_from_process_local_data(rows, weights))
