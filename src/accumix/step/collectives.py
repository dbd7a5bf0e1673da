"""The façade's calls that involve the other ranks: ``reduce``, ``gather``,
``gather_for_metrics``, ``barrier`` (collectives) and ``print`` (the main process only).
``Accelerator`` inherits them; each reads the run state (``run_state.py``) and hands the work to
the strategy's collectives (``gather.py`` for the rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accumix.errors import ConfigError
from accumix.step import gather

if TYPE_CHECKING:
    import torch

    from accumix.step.run_state import RunState


class Collectives:
    """``acc.reduce``, ``acc.gather``, ``acc.gather_for_metrics`` and ``acc.barrier`` (every
    rank calls each of them) and ``acc.print``."""

    _run: RunState

    def reduce(self, tensor: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """A copy of ``tensor`` reduced over all ranks (``"mean"`` or ``"sum"``).

        Sums of a metric's parts (correct predictions, true positives, a loss sum and its item
        count) over ``acc.setup_eval_loader``'s loader, reduced with ``"sum"``, are the
        one-process values on any world size.

        Args:
            tensor: this rank's value.
            reduction: ``"mean"`` or ``"sum"``.

        Raises:
            ConfigError: another reduction.
        """
        if reduction not in ("mean", "sum"):
            raise ConfigError(f"reduction={reduction!r} is invalid; use 'mean' or 'sum'")
        return self._run.strategy.all_reduce(tensor.detach().clone(), reduction)

    def gather(self, data: Any) -> Any:
        """Every rank's tensors concatenated along dim 0 in rank order (0-dim ones stacked).

        ``data`` is a tensor or tensors nested in dicts, lists and tuples (the same nesting on
        every rank); the first dimension may differ between ranks (each is padded to the
        longest, gathered and trimmed: exact), the other dimensions and the dtype may not.

        Args:
            data: this rank's tensor, or its tensors nested in dicts, lists and tuples.

        Returns:
            ``data``'s nesting, each tensor replaced by the gathered one (on ``acc.device``).

        Raises:
            ConfigError: on every rank alike, a non-tensor leaf, nestings that differ, or a
                tensor whose trailing shape or dtype differs between ranks (the message names
                each rank's shape).
        """
        return gather.gather(self._run, data)

    def gather_for_metrics(self, data: Any) -> Any:
        """``gather`` for the current batch of a set-up loader: its padding removed.

        A set-up loader pads each epoch so that every rank has as many batches (the first
        samples repeated at the end, as ``DistributedSampler`` does); gathering predictions
        of every batch would evaluate those twice. Here each tensor's rows (one per sample of
        the batch) are kept only where they are real samples, ordered by their place in the
        epoch: over an epoch the results are every sample once, in the loader's order (the
        dataset's without a shuffle), on any world size. For rows of a loader accumix did not
        shard (an IterableDataset) it is ``gather``.

        Args:
            data: this rank's rows of the current batch (a tensor or a nesting of them, as
                ``gather`` takes).

        Raises:
            ConfigError: a tensor without one row per sample of the batch (on every rank), a
                batch of ``acc.setup_eval_loader``'s loader (gather once after its loop), or
                what ``gather`` raises.
        """
        return gather.gather_for_metrics(self._run, data)

    def barrier(self) -> None:
        """Waits until every rank gets here."""
        self._run.strategy.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only.

        Args:
            *args: what ``print`` takes.
            **kwargs: what ``print`` takes (``sep``, ``end``, ``file``, ``flush``).
        """
        if self._run.launch.rank == 0:
            print(*args, **kwargs)
