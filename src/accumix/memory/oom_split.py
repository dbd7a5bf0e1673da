"""The out-of-memory safety net: a micro-batch too big for memory runs as pieces of its window.

``acc.run_micro_batch(step_fn, batch)`` runs one micro-batch's forward (``step_fn(batch)``)
and backward inside ``with acc.accumulate():``. When a forward raises
``torch.OutOfMemoryError`` (a batch longer than the one ``micro_batch_size="auto"`` probed),
the micro-batch is cut in halves, again if a half still does not fit, and each piece runs as
an extra forward + backward of the *same* micro-step:

* the same gradient: item mode (``(loss_sum, num_items)``) backs each piece with its own
  items, so the window's sum and its item count are the unsplit ones; mean mode multiplies a
  piece's mean loss by its share of the rows, so the pieces add up to the micro-batch's mean
  (the loss must be a mean over the batch's first dimension, as ``backward(loss)`` assumes);
* the same window: the micro-step counter, the boundary and ``optimizer_steps`` do not move,
  no row is skipped or repeated, nothing restarts;
* one log line (rank 0) names the rank that ran out, the rows and the pieces.

How the ranks stay matched (the reason for the design). Under ``ddp`` the boundary's backward
all-reduces gradient buckets; under ``fsdp`` every forward all-gathers each block's parameters
and a syncing backward reduce-scatters; under DeepSpeed ZeRO-2 every backward reduces. A rank
that runs out of memory and retries on its own would issue collectives the others never issue
(or the reverse), and every rank would hang or mix tensors. So:

1. In a distributed run each forward is followed by **one agreement before its backward**
   (a 2-element ``all_reduce(max)``: the failing rank, and whether it is down to one row).
   The backward, where the gradient collectives live, starts only once every rank's forward
   fit; a forward's own all-gathers happen in every rank's forward alike.
2. When any rank's forward failed, **every rank** drops its forward (no backward ran, so no
   gradient was touched) and cuts its own micro-batch at the same fractions: the pieces are
   the same on every rank (a rank with fewer rows than pieces runs a one-row piece weighted
   zero), so each rank runs the same forwards and backwards, and the same collectives.
3. A piece's backward keeps the micro-step's gradient communication (``Strategy.piece_sync``):
   off the boundary none; at the boundary each piece reduces, which adds up (DDP re-averages
   gradients already equal on every rank, FSDP adds each reduce-scatter into the sharded
   gradient), and DeepSpeed reduces only with the last piece.
4. A piece of one row that still does not fit raises ``torch.OutOfMemoryError`` on every rank.

What it cannot recover: an out-of-memory error inside a **backward** (autograd has already
added part of that backward into ``.grad``, which cannot be taken back) is re-raised; and an
error in a forward before that forward's last collective on the other ranks (under ``fsdp`` a
block before the last sharded one, ZeRO-3's parameter fetch) leaves them inside that
all-gather, so every rank stops after the Accelerator's ``timeout``. The forward's largest
allocation is usually its end (a language model's logits over the vocabulary), after every
all-gather. One process needs no agreement and pays nothing; a distributed run pays the one
small all-reduce per micro-step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from accumix.errors import ConfigError
from accumix.step import micro_step

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

log = logging.getLogger("accumix")

StepFn = Callable[[Any], Any]


def split_loss(output: Any) -> tuple[torch.Tensor, torch.Tensor | int | float | None]:
    """A step function's result as ``(loss, num_items)``; ``num_items`` is None in mean mode.

    Accepts a 0-dim loss tensor (a mean), a ``(loss_sum, num_items)`` pair, or an object with a
    ``.loss`` attribute (Hugging Face model outputs; a mean).

    Raises:
        ConfigError: anything else.
    """
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output, None
    if isinstance(output, (tuple, list)) and len(output) == 2:
        loss, items = output
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            # A Hugging Face model with return_dict=False returns (loss, logits): a count must
            # be one number, or every row's gradient would be divided by the logits.
            if isinstance(items, torch.Tensor) and items.numel() != 1:
                raise ConfigError(
                    f"the step function returned (loss, a tensor of shape {tuple(items.shape)}); "
                    "return (loss_sum, num_items) with one number as num_items, or the mean "
                    "loss alone (for a model's (loss, logits) tuple: output[0])")
            return loss, items
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss, None
    raise ConfigError(
        f"the step function returned {type(output).__name__}; return a 0-dim mean loss tensor "
        "or a (loss_sum, num_items) pair"
    )


def batch_samples(batch: Any) -> int:
    """The number of samples in a batch: the first tensor's first dimension."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, dict):
        for value in values:
            if isinstance(value, (torch.Tensor, dict, list, tuple)):
                return batch_samples(value)
        return len(batch)
    return 1


def slice_batch(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every part of ``batch`` that has ``rows`` rows.

    Tensors whose first dimension is ``rows`` are sliced (views, no copy); dicts, lists and
    tuples (named ones too) are sliced part by part; a list or tuple of plain values with
    ``rows`` entries (the texts of a batch) is sliced too; anything else is kept whole.
    """
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == rows else batch
    if isinstance(batch, dict):
        return type(batch)((k, slice_batch(v, start, stop, rows)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        if len(batch) == rows and not any(
                isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch):
            return batch[start:stop]
        parts = [slice_batch(v, start, stop, rows) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def run_micro_batch(run: RunState, step_fn: StepFn, batch: Any) -> Any:
    """Forward and backward of one micro-batch, split into pieces if it runs out of memory.

    See the module's docstring for the guarantees and how the ranks stay matched.

    Args:
        acc: the Accelerator, inside ``with acc.accumulate():``.
        step_fn: ``step_fn(batch) -> mean_loss | (loss_sum, num_items)``, the forward.
        batch: the micro-batch (a tensor, or dicts/lists/tuples of tensors, rows first).

    Returns:
        What ``step_fn`` returned for the whole micro-batch: unsplit, its own result; split,
        the pieces' combined (detached) result: the row-weighted mean loss, or the summed
        ``(loss_sum, num_items)``.

    Raises:
        torch.OutOfMemoryError: one row does not fit on some rank (raised on every rank).
    """
    rows = batch_samples(batch)
    distributed = run.world_size > 1
    pieces: list[tuple[Fraction, Fraction]] = [(Fraction(0), Fraction(1))]
    losses: list[tuple[torch.Tensor, Any, Fraction]] = []
    failed_rank = -1
    result: Any = None
    while pieces:
        start, stop = (int(f * rows) for f in pieces[0])
        filler = stop <= start  # this rank has no row for this piece: one row, weight zero
        part = batch if len(pieces) == 1 and not losses and stop - start == rows else (
            slice_batch(batch, 0, 1, rows) if filler else slice_batch(batch, start, stop, rows))
        out_of_memory = False
        try:
            output = step_fn(part)
        except torch.OutOfMemoryError:
            out_of_memory, output = True, None
        worst, single_row = _agree(run, out_of_memory, stop - start <= 1, distributed)
        if worst >= 0:
            del output
            failed_rank = worst
            if single_row:
                raise torch.OutOfMemoryError(
                    f"out of memory on rank {worst} with a piece of one row (accumix's safety "
                    "net split the micro-batch down to it): the model does not fit one row; use "
                    "less memory (a smaller model, activation checkpointing, fsdp)"
                )
            low, high = pieces.pop(0)
            middle = (low + high) / 2
            pieces[:0] = [(low, middle), (middle, high)]
            continue
        pieces.pop(0)
        loss, num_items = split_loss(output)
        share = Fraction(0) if filler else Fraction(stop - start, rows)
        if failed_rank < 0 and not pieces:  # the common case: the plain loop's backward
            _backward(run, loss, num_items, 1)
            return output
        with run.strategy.piece_sync(run.models[0] if run.models else None,
                                     boundary=run.is_boundary, last=not pieces):
            _backward(run, loss, num_items, share)
        losses.append((loss.detach(), num_items, share))
        result = losses
    if run.is_main_process:
        log.warning("out of memory on rank %d in micro-step %d of %d (optimizer step %d): every "
                    "rank ran its micro-batch as %d pieces of the same window; the gradient is "
                    "unchanged", failed_rank, run.window.micro_step, run.grad_accum_steps,
                    run.optimizer_steps + 1, len(result))
    return _combined(result)


def _agree(run: RunState, out_of_memory: bool, single_row: bool, distributed: bool
           ) -> tuple[int, bool]:
    """The highest rank whose forward ran out of memory (-1: none) and whether one of them
    was down to one row: one all-reduce, so every rank takes the same branch."""
    if not distributed:
        return (run.rank if out_of_memory else -1), out_of_memory and single_row
    flags = torch.tensor([run.rank + 1 if out_of_memory else 0,
                          1 if out_of_memory and single_row else 0],
                         dtype=torch.float32, device=run.device)
    worst, one_row = run.strategy.all_reduce(flags, "max").tolist()
    return int(worst) - 1, bool(one_row)


def _backward(run: RunState, loss: torch.Tensor, num_items: Any, share: Fraction | int
              ) -> None:
    if num_items is None:
        micro_step.backward(run, loss if share == 1 else loss * float(share))
    elif share == 0:  # a filler row: no loss, no items
        micro_step.backward(run, loss * 0.0, num_items=0)
    else:
        micro_step.backward(run, loss, num_items=num_items)


def _combined(losses: list[tuple[torch.Tensor, Any, Fraction]]) -> Any:
    """The pieces' results as one micro-batch's: row-weighted mean, or summed items."""
    if losses[0][1] is None:
        return sum(loss * float(share) for loss, _, share in losses)
    real = [(loss, items) for loss, items, share in losses if share]
    loss_sum = sum(loss for loss, _ in real)
    items = sum(items.detach() if isinstance(items, torch.Tensor) else items for _, items in real)
    return loss_sum, items
