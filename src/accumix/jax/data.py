"""Windows: K micro-batches of this process's rows as one global array, plus a validity mask.

A window is ``[K, rows, ...]`` per leaf, sharded over the mesh's data axis
(``jax.make_array_from_process_local_data``: each process hands only its rows), a ``[K]``
mask, and the ``[K, devices]`` mask the step reads (processes may pass windows of different
lengths). A short window (the end of an epoch) is padded with zeros and masked, so its shapes, and
the compiled step, stay the same. A torch ``DataLoader`` set up with the state goes through
``accumix.data.loader.AcceleratedDataLoader`` (the torch side's sampler rules, epochs, and exact
mid-epoch position) and comes out as windows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from accumix.errors import ConfigError
from accumix.jax.strategies import JaxStrategy

log = logging.getLogger("accumix")


@jax.tree_util.register_dataclass
@dataclass
class Window:
    """One optimizer step's data, as ``acc.window(micro_batches)`` or a set-up loader makes it.

    Attributes:
        batch: the micro-batches stacked: each leaf ``[K, rows, ...]``.
        mask: ``[K]``, this process's real micro-steps (a short window's tail is padding).
        device_mask: ``[K, devices]``, every device's real micro-steps, which the step reads;
            None: ``mask`` holds for every device.
    """

    batch: Any
    mask: jax.Array
    device_mask: jax.Array | None = None


def canonical(value: Any) -> np.ndarray:
    """A numpy array in the dtype JAX will hold it in (int64 -> int32, float64 -> float32
    unless x64 is on), converted here once instead of warned about per leaf."""
    arr = np.asarray(value)
    if not jax.config.jax_enable_x64:
        if arr.dtype == np.int64:
            return arr.astype(np.int32)
        if arr.dtype == np.float64:
            return arr.astype(np.float32)
    return arr


def make_window(micro_batches: list[Any], *, grad_accum_steps: int, strategy: JaxStrategy,
                local_devices: int) -> Window:
    """This process's micro-batches (pytrees of numpy arrays, rows first) as a global window.

    Raises:
        ConfigError: no micro-batch, more than K, shapes that differ, or rows that the local
            devices do not divide.
    """
    k = len(micro_batches)
    if not 1 <= k <= grad_accum_steps:
        raise ConfigError(
            f"a window takes 1 to grad_accum_steps={grad_accum_steps} micro-batches, got {k}")
    leaves0, treedef = jax.tree.flatten(micro_batches[0])
    if not leaves0:
        raise ConfigError("a micro-batch holds no arrays; pass a pytree of numpy arrays")
    stacked = []
    for i, leaf in enumerate(leaves0):
        parts = []
        for j, micro in enumerate(micro_batches):
            leaves = treedef.flatten_up_to(micro)
            arr = canonical(leaves[i])
            if arr.shape != np.shape(leaf):
                raise ConfigError(
                    f"micro-batch {j} has a leaf of shape {arr.shape}, micro-batch 0 "
                    f"{np.shape(leaf)}; every micro-batch of a window needs the same shapes")
            parts.append(arr)
        arr0 = parts[0]
        if arr0.ndim == 0 or arr0.shape[0] % local_devices:
            raise ConfigError(
                f"a micro-batch leaf of shape {arr0.shape} cannot be split over this process's "
                f"{local_devices} devices; use a batch size that {local_devices} divides")
        parts += [np.zeros_like(arr0)] * (grad_accum_steps - k)  # masked: never used
        stacked.append(np.stack(parts))
    mask = np.arange(grad_accum_steps) < k
    rows = strategy.sharding(strategy.rows_spec(1))
    arrays = [jax.make_array_from_process_local_data(rows, a) for a in stacked]
    # One column per device: each process marks its own micro-steps, so processes that pass
    # windows of different lengths (the end of an uneven stream) are each masked right.
    device_mask = np.repeat(mask[:, None], local_devices, axis=1)
    return Window(batch=jax.tree.unflatten(treedef, arrays),
                  mask=jax.make_array_from_process_local_data(strategy.sharding(P()), mask),
                  device_mask=jax.make_array_from_process_local_data(rows, device_mask))


def to_numpy(batch: Any) -> Any:
    """A torch batch (tensors in tuples, lists, dicts) as numpy arrays, without copies on CPU."""
    def convert(x: Any) -> Any:
        if hasattr(x, "detach") and hasattr(x, "numpy"):
            return x.detach().cpu().numpy()
        return np.asarray(x)
    return jax.tree.map(convert, batch)


class WindowLoader:
    """A torch ``DataLoader`` as windows: the last batch of an epoch closes a (short) window.

    Wraps an ``accumix.data.loader.AcceleratedDataLoader`` (sharded over processes, one epoch per
    ``iter()``, resumable mid-epoch). A batch with fewer rows than ``batch_size`` (the epoch's
    tail without ``drop_last``) would change the step's shapes and recompile it: it is dropped,
    with a warning once; the short last window of an epoch is kept, masked.
    """

    def __init__(self, loader: Any, *, grad_accum_steps: int, make: Any) -> None:
        self.loader = loader  # AcceleratedDataLoader
        self.grad_accum_steps = grad_accum_steps
        self._make = make
        self._is_last = False
        self._warned = False
        self.last_samples = 0  # this process's rows in the window last yielded
        loader._on_batch = self._on_batch

    def _on_batch(self, is_last: bool) -> None:
        self._is_last = is_last

    def __len__(self) -> int:
        """The windows one epoch yields (the dropped short batch counts in none of them)."""
        return -(-self.batches_per_epoch // self.grad_accum_steps)

    @property
    def batches_per_epoch(self) -> int:
        """This process's batches that one epoch really uses: a final batch shorter than
        ``batch_size`` is dropped (it would recompile the step)."""
        inner, batches = self.loader.loader, len(self.loader)
        if inner.batch_size is None or inner.drop_last:
            return batches
        sampler = getattr(inner, "sampler", None)
        samples = len(sampler) if hasattr(sampler, "__len__") else len(inner.dataset)
        return batches - (1 if samples % inner.batch_size else 0)

    def __iter__(self) -> Iterator[Window]:
        group: list[Any] = []
        batch_size = self.loader.batch_size
        for batch in self.loader:
            micro = to_numpy(batch)
            rows = jax.tree.leaves(micro)[0].shape[0]
            if batch_size is not None and rows != batch_size:
                if not self._warned:
                    log.warning("dropping a final batch of %d rows (batch_size=%d): a smaller "
                                "batch would recompile the step; pass drop_last=True to silence",
                                rows, batch_size)
                    self._warned = True
            else:
                group.append(micro)
            if group and (len(group) == self.grad_accum_steps or self._is_last):
                window = self._make(group)
                self.last_samples = len(group) * (batch_size or rows)
                yield window
                group = []

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def state_dict(self) -> dict[str, int]:
        return {**self.loader.state_dict(), **self.loader.sampling_state()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
