"""A torch ``DataLoader`` set up on JAX (``acc.setup(params, optimizer, loader)``,
``acc.setup_loader``): checked against the micro-batch size, re-batched to the size ``auto``
chose, sharded over processes by the torch side's ``AcceleratedDataLoader`` (its sampler rules,
epochs and exact mid-epoch position) and yielded as windows (``data.WindowLoader``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from accumix.common.micro_batch_search import MicroBatchChoice, is_auto
from accumix.errors import ConfigError
from accumix.jax.data import Window, WindowLoader
from accumix.jax.micro_batch import rebatched


def checked_loader(loader: Any, *, micro_batch_size: int | str | None,
                   choice: MicroBatchChoice | None) -> Any:
    """``loader`` at the micro-batch size the run uses (``auto``'s choice, if it chose).

    Raises:
        ConfigError: not a torch DataLoader, ``micro_batch_size="auto"`` not chosen yet, or a
            batch size other than ``micro_batch_size``.
    """
    if not (hasattr(loader, "dataset") and hasattr(loader, "batch_sampler")):
        raise ConfigError(f"cannot set up a {type(loader).__name__} as a loader; pass a "
                          "torch DataLoader, or build windows with acc.window([...])")
    if is_auto(micro_batch_size):
        raise ConfigError("micro_batch_size='auto' is chosen before the loader: call "
                          "acc.find_micro_batch_size(state, loss_fn, make_batch), then "
                          "acc.setup_loader(loader)")
    loader = rebatched(choice, loader)  # to the size 'auto' chose
    if micro_batch_size is not None and loader.batch_size not in (None, micro_batch_size):
        raise ConfigError(f"DataLoader batch_size={loader.batch_size} differs from "
                          f"micro_batch_size={micro_batch_size}; make them equal")
    return loader


def window_loader(loader: Any, *, grad_accum_steps: int, seed: int,
                  make: Callable[[list[Any]], Window]) -> WindowLoader:
    """``loader`` sharded over processes, as windows of ``grad_accum_steps`` batches."""
    import torch

    from accumix.data.loader import AcceleratedDataLoader

    wrapped = AcceleratedDataLoader(
        loader, device=torch.device("cpu"), rank=jax.process_index(),
        world_size=jax.process_count(), seed=seed, on_batch=lambda _: None)
    return WindowLoader(wrapped, grad_accum_steps=grad_accum_steps, make=make)
