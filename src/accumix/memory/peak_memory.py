"""The peak memory of one probed step, per device: what ``micro_batch_size="auto"`` compares
against the limit.

CUDA: the caching allocator's own counter, ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` (every tensor on the device, the model's included).

CPU has no allocator counter and no out-of-memory error before the kernel's OOM killer, so the
peak is counted the way CUDA's allocator counts it: the bytes of every live CPU tensor storage
when the step begins (found through the garbage collector), plus the highest growth during the
step, seen by a ``TorchDispatchMode`` that adds each new storage's bytes when an operator
returns it and subtracts them when the storage is freed (a weak reference's callback). It counts
tensors, not the interpreter, libraries or allocator slack; a test checks the growth against the
process's real peak resident-set growth (``ru_maxrss``) in a fresh process.

Both collect garbage first (a dropped run's tensors held by reference cycles are not the step's)
and leave out what the caller names (``exclude``): the probe's own backup of the parameters is
host memory that a training run never holds.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from accumix.common.hardware import host_memory_bytes


class _StorageGrowth(TorchDispatchMode):
    """Counts the bytes of CPU storages created under it that are still alive, and their peak.

    Args:
        existing: the addresses of the storages alive when it began (counted before).
    """

    def __init__(self, existing: Iterable[int] = ()) -> None:
        super().__init__()
        self.existing = set(existing)
        self.live = 0
        self.peak = 0
        self._alive: dict[int, int] = {}  # data_ptr -> bytes, storages created here, alive
        self._refs: list[weakref.ref[Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        # An in-place result or a view of a storage alive before the measurement (a
        # parameter's ``mul_``, an optimizer state's ``lerp_``) is nothing new; it was counted
        # as new since it was not created here: the steady-state AdamW step counted every
        # state it updates again (2.2x the parameters' bytes on CPU, where the process grew
        # by 0.25x; issue 38). Only where that storage is an input of the op: a storage that
        # FSDP2 re-allocated outside the dispatcher (``resize_``) and an ``out=`` op fills has
        # a new address, and counts when that op returns it.
        inputs = {ptr for leaf in tree_leaves((args, kwargs))
                  if (ptr := _storage_ptr(leaf)) in self.existing}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                self._track(leaf, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        if hasattr(tensor, "to_local"):  # a DTensor: its shard holds the memory
            tensor = tensor.to_local()
        try:
            storage = tensor.untyped_storage()
            size, ptr = storage.nbytes(), storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return
        if not size or ptr in self._alive or ptr in inputs:  # a view or an in-place result
            return
        self._alive[ptr] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        # Storages keep their Python object while C++ holds them: the callback fires when the
        # memory is really freed, not when the last Python name goes away.
        self._refs.append(weakref.ref(storage, lambda _ref, p=ptr: self._free(p)))

    def _free(self, ptr: int) -> None:
        size = self._alive.pop(ptr, 0)
        self.live -= size


def _storage_ptr(leaf: Any) -> int | None:
    """The address of a CPU tensor's storage (a DTensor's shard's), else None."""
    if not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu":
        return None
    if hasattr(leaf, "to_local"):
        leaf = leaf.to_local()
    try:
        return leaf.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def live_cpu_tensor_bytes() -> int:
    """The bytes of every CPU tensor storage alive in this process (each storage once)."""
    return sum(live_cpu_storages().values())


def live_cpu_storages() -> dict[int, int]:
    """Every CPU tensor storage alive in this process: its address -> its bytes."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated lazy module attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" \
                        or obj.is_meta:
                    continue
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError, ReferenceError):
                continue  # a freed storage (FSDP resizes its buffers to 0), a subclass
    return seen


class PeakMeter:
    """``with meter.measure(): step()`` then ``meter.peak``: this rank's peak bytes in the step.

    Args:
        device: the rank's device (cuda or cpu).
        exclude: tensors alive through the step that the measured workload would not hold (the
            probe's own host copy of the parameters, a window's gradients the probe replaces
            with its own): their bytes on ``device`` are left out of ``peak``.
    """

    def __init__(self, device: torch.device, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.device = device
        self.peak = 0
        self.growth = 0  # the peak above the bytes alive when the step began
        self.excluded = storage_bytes(exclude, device)

    @contextmanager
    def measure(self) -> Iterator[None]:
        gc.collect()  # garbage in reference cycles (a dropped run's objects) is not the step's
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.excluded
            self.growth = self.peak + self.excluded - before
            return
        existing = live_cpu_storages()
        before = sum(existing.values())
        mode = _StorageGrowth(existing)
        try:
            with mode:
                yield
        finally:
            self.growth = mode.peak
            self.peak = before + mode.peak - self.excluded


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """The bytes of the distinct storages of ``tensors`` that live on ``device``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        if tensor.device.type != device.type or device.index not in (None, tensor.device.index):
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def release_cached(device: torch.device) -> None:
    """Frees what a failed or finished probe left (cycles holding tensors, the CUDA cache)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def device_total_bytes(device: torch.device, *, local_world_size: int = 1) -> int:
    """All the memory one rank's device has: a GPU's total, or on CPU this process's share of
    the host (the physical memory, or the container's cgroup limit if lower, divided by the
    ranks on this host)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return (host_memory_bytes() or 0) // max(local_world_size, 1)


def device_model(device: torch.device) -> str:
    """What the probe's answer depends on of the hardware: the GPU's name, or ``cpu``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
