"""The out-of-memory safety net: a micro-batch too big for memory runs as pieces of its window.

``acc.run_micro_batch(step_fn, batch)`` runs one micro-batch's forward (``step_fn(batch)``)
and backward inside ``with acc.accumulate():``. When a forward raises
``torch.OutOfMemoryError`` (a batch longer than the one ``micro_batch_size="auto"`` probed),
the micro-batch is cut in halves, again if a half still does not fit, and each piece runs as
an extra forward + backward of the *same* micro-step:

* the same gradient: item mode (``(loss_sum, num_items)``) backs each piece with its own
  items, so the window's sum and its item count are the unsplit ones; mean mode multiplies a
  piece's mean loss by its share of the rows, so the pieces add up to the micro-batch's mean
  (a 0-dim loss must be a mean over the batch's rows, as ``backward(loss)`` assumes). A model
  output's ``.loss`` (Hugging Face) is a mean over tokens, or rows, whose count the split cannot
  know: weighing it by rows would be wrong for a padded batch, so a split refuses it in one
  line and asks for ``(loss_sum, num_items)``;
* the same window: the micro-step counter, the boundary and ``optimizer_steps`` do not move,
  no row is skipped or repeated, nothing restarts;
* the same batch structure: a piece is the same type as the micro-batch, cut along its rows
  (``batch_rows``: tensors, Mappings such as a tokenizer's ``BatchEncoding``, dataclasses,
  tuples, lists of samples such as a detection batch's images); a batch with no rows to cut
  is refused in one line when a split is due;
* one log line (rank 0) names the rank that ran out, the rows and the pieces.

**BatchNorm.** A forward that ran out of memory has already updated the running statistics of
the batch-statistics layers in training mode; they are put back before the pieces run, so only
forwards that completed count. The pieces themselves are normalised by their own batch
statistics, as every micro-batch of an accumulation window already is (accumulation never
equals one large batch for BatchNorm), and each piece updates the running statistics once: the
gradient of a split micro-batch differs from the unsplit one's, and the log line says so. A
split is kept rather than refused: the safety net exists to keep a run alive past a batch that
does not fit, and a smaller micro-batch is what the user would otherwise choose by hand.

How the ranks stay matched (the reason for the design). Under ``ddp`` the boundary's backward
all-reduces gradient buckets; under ``fsdp`` every forward all-gathers each block's parameters
and a syncing backward reduce-scatters; under DeepSpeed ZeRO-2 every backward reduces. A rank
that runs out of memory and retries on its own would issue collectives the others never issue
(or the reverse), and every rank would hang or mix tensors. So:

1. In a distributed run each forward is followed by **one agreement before its backward**
   (a 3-element ``all_reduce(max)``: the failing rank, whether it is down to one row, and
   whether some rank's batch has no rows to cut).
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
all-gather. One process needs no agreement and pays nothing but a copy of its BatchNorm
buffers, if any; a distributed run pays the one small all-reduce per micro-step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import numbers
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

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


_PLAIN = (str, bytes, numbers.Number, type(None))


def batch_samples(batch: Any, expected: int | None = None) -> int:
    """The number of samples (rows) in a batch, best effort (1 when no part has rows or the
    parts disagree): see ``batch_rows``."""
    counts = _counts(batch)
    if not counts:
        return 1
    return expected if expected in counts else counts[0]


def batch_rows(batch: Any, expected: int | None = None) -> int:
    """The rows of a batch that ``run_micro_batch`` must cut (``slice_batch`` cuts the same).

    Every part with rows must agree: a tensor or numpy array (its first dimension), a Mapping's
    values (``dict``, a tokenizer's ``BatchEncoding``, a model output), a dataclass's fields, a
    namedtuple's fields; a list or tuple is either *columns* (its parts agree on the rows:
    ``default_collate``'s ``[x, y]``) or *samples* (one entry a row: images of different sizes,
    a detection batch's targets, texts). When both readings fit, ``expected`` (the rows the
    set-up loader yielded, else the micro-batch size) decides; without it, columns. A list of
    exactly as many images as they have channels, the one case neither can tell, is read as
    columns: batch such data as a dict.

    Raises:
        ConfigError: no part has rows, or the parts disagree.
    """
    counts = _counts(batch)
    if counts is None:
        raise ConfigError(f"cannot split a {type(batch).__name__} batch into rows: its parts "
                          "disagree on the number of rows; batch rows-first tensors in a dict, "
                          "tuple or dataclass, or a list with one entry per sample")
    if not counts:
        raise ConfigError(f"cannot split a {type(batch).__name__} batch into rows: no part of it "
                          "has rows (a tensor, array, mapping, dataclass, tuple or list of "
                          "samples); pass the batch as one of those")
    return expected if expected in counts else counts[0]


def _counts(batch: Any) -> list[int] | None:
    """The row counts a batch can be read with, the likelier first ([]: no rows, None: parts
    that disagree)."""
    if isinstance(batch, torch.Tensor | np.ndarray):
        return [int(batch.shape[0])] if batch.ndim else []
    fields = _fields(batch)
    if fields is not None:
        return _agreed([_counts(v) for v in fields])
    if isinstance(batch, list | tuple):
        if not batch:
            return []
        if all(isinstance(v, _PLAIN) for v in batch):
            return [len(batch)]
        columns = _columns(batch)
        return columns + [len(batch)] if len(batch) not in columns else columns
    return []


def _columns(batch: list[Any] | tuple[Any, ...]) -> list[int]:
    """The row counts of a list read as columns: every entry has rows, and they agree."""
    counts = [_counts(v) for v in batch]
    if any(not c for c in counts):  # an entry without rows, or one whose parts disagree
        return []
    return _agreed(counts) or []


def _agreed(counts: list[list[int] | None]) -> list[int] | None:
    """The counts every part allows (parts without rows aside), in the first part's order."""
    if any(c is None for c in counts):
        return None
    known = [c for c in counts if c]
    if not known:
        return []
    common = [n for n in known[0] if all(n in c for c in known[1:])]
    return common or None


def _fields(batch: Any) -> list[Any] | None:
    """The values of a batch read as named columns (a Mapping, dataclass or namedtuple)."""
    if isinstance(batch, Mapping):
        return list(batch.values())
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return list(batch)
    return None


def slice_batch(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every part of ``batch`` that has ``rows`` rows (``batch_rows``).

    Tensors and arrays whose first dimension is ``rows`` are sliced (views, no copy);
    Mappings, dataclasses and namedtuples are sliced field by field into a copy of their type;
    a list or tuple is sliced part by part when its parts have ``rows`` rows (columns), else
    by its entries when it has ``rows`` of them (samples, texts); anything else is kept whole.

    Raises:
        ConfigError: a Mapping that cannot be copied or rebuilt with its sliced values.
    """
    if isinstance(batch, torch.Tensor | np.ndarray):
        return batch[start:stop] if batch.ndim and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return _rebuilt(batch, {k: slice_batch(v, start, stop, rows) for k, v in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        part = copy.copy(batch)
        for field in dataclasses.fields(batch):
            object.__setattr__(part, field.name,
                               slice_batch(getattr(batch, field.name), start, stop, rows))
        return part
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, start, stop, rows) for v in batch))
    if isinstance(batch, list | tuple):
        if not all(isinstance(v, _PLAIN) for v in batch) and rows in _columns(batch):
            return type(batch)(slice_batch(v, start, stop, rows) for v in batch)
        return batch[start:stop] if len(batch) == rows else batch
    return batch


def _rebuilt(batch: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """A copy of a Mapping with other values: a ``dict`` subclass, ``UserDict`` or
    ``BatchEncoding`` keeps its type (and a defaultdict its factory)."""
    try:
        part = copy.copy(batch)
        for key, value in values.items():
            part[key] = value  # type: ignore[index]
        return part
    except TypeError:
        try:
            return type(batch)(values)  # type: ignore[call-arg]
        except TypeError:
            raise ConfigError(f"cannot split a {type(batch).__name__} batch: it can be neither "
                              "copied nor built from a dict; pass a dict") from None


def run_micro_batch(run: RunState, step_fn: StepFn, batch: Any) -> Any:
    """Forward and backward of one micro-batch, split into pieces if it runs out of memory.

    See the module's docstring for the guarantees and how the ranks stay matched.

    Args:
        acc: the Accelerator, inside ``with acc.accumulate():``.
        step_fn: ``step_fn(batch) -> mean_loss | (loss_sum, num_items)``, the forward.
        batch: the micro-batch: rows-first tensors in a dict (or any Mapping: a tokenizer's
            ``BatchEncoding``), tuple, list, namedtuple or dataclass, or a list of samples
            (``batch_rows``).

    Returns:
        What ``step_fn`` returned for the whole micro-batch: unsplit, its own result; split,
        the pieces' combined (detached) result: the row-weighted mean loss, or the summed
        ``(loss_sum, num_items)``.

    Raises:
        torch.OutOfMemoryError: one row does not fit on some rank (raised on every rank).
        ConfigError: a split is due but the batch has no rows to cut (``batch_rows``), or the
            step returned a mean of unknown weight (a model output's ``.loss``) (on every
            rank).
    """
    try:
        rows, unsplittable = batch_rows(batch, _expected_rows(run, batch)), ""
    except ConfigError as exc:  # raised only if a split is due (on every rank then)
        rows, unsplittable = 1, str(exc)
    norms = _batch_statistics(run)
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
        kept = [b.clone() for b in norms]  # a forward that runs out of memory updated them
        out_of_memory = False
        try:
            output = step_fn(part)
        except torch.OutOfMemoryError:
            out_of_memory, output = True, None
        worst, single_row, cannot = _agree(run, out_of_memory, stop - start <= 1,
                                           bool(unsplittable), distributed)
        if worst >= 0:
            del output
            with torch.no_grad():
                for buffer, value in zip(norms, kept, strict=True):
                    buffer.copy_(value)
            failed_rank = worst
            if cannot:  # the rank whose batch has no rows says why; the others point to it
                why = unsplittable or "cannot split another rank's batch into rows (its log)"
                raise ConfigError(f"out of memory on rank {worst}, and acc.run_micro_batch "
                                  f"{why}")
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
        if num_items is None and not isinstance(output, torch.Tensor):
            raise ConfigError(
                f"out of memory on rank {failed_rank}: acc.run_micro_batch must split the "
                f"micro-batch, but the step returned {type(output).__name__}.loss, a mean whose "
                "weight (its tokens, or rows) the pieces cannot know; return (loss_sum, "
                "num_items) instead, e.g. (out.loss * n, n) with n the tokens the loss averages")
        with run.strategy.piece_sync(run.models[0] if run.models else None,
                                     boundary=run.is_boundary, last=not pieces):
            _backward(run, loss, num_items, share)
        losses.append((loss.detach(), num_items, share))
        result = losses
    if run.is_main_process:
        effect = ("batch-statistics layers in training mode (BatchNorm) normalised each piece "
                  "by its own statistics and updated their running statistics once a piece: "
                  "the gradient differs from the unsplit micro-batch's" if norms else
                  "the gradient is unchanged")
        log.warning("out of memory on rank %d in micro-step %d of %d (optimizer step %d): every "
                    "rank ran its micro-batch as %d pieces of the same window; %s", failed_rank,
                    run.window.micro_step, run.grad_accum_steps, run.optimizer_steps + 1,
                    len(result), effect)
    return _combined(result)


def _expected_rows(run: RunState, batch: Any) -> int | None:
    """The rows ``batch`` should have: those a set-up loader yielded it with, else the micro
    batch size."""
    for loader in run.loaders:
        rows = loader.rows_of(batch)
        if rows is not None:
            return rows
    micro = run.batch_sizes[2]
    if isinstance(micro, int):
        return micro
    return next((loader.batch_size for loader in run.loaders if loader.batch_size), None)


def _batch_statistics(run: RunState) -> list[torch.Tensor]:
    """The running statistics a forward updates: the buffers of the batch-statistics layers
    (BatchNorm, InstanceNorm with ``track_running_stats``) in training mode."""
    return [buffer for model in run.models for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.training
            and module.track_running_stats for buffer in module.buffers(recurse=False)
            if buffer is not None]


def _agree(run: RunState, out_of_memory: bool, single_row: bool, unsplittable: bool,
           distributed: bool) -> tuple[int, bool, bool]:
    """The highest rank whose forward ran out of memory (-1: none), whether one of them was
    down to one row, and whether some rank's batch cannot be split: one all-reduce, so every
    rank takes the same branch."""
    if not distributed:
        return (run.rank if out_of_memory else -1), out_of_memory and single_row, unsplittable
    flags = torch.tensor([run.rank + 1 if out_of_memory else 0,
                          1 if out_of_memory and single_row else 0, 1 if unsplittable else 0],
                         dtype=torch.float32, device=run.device)
    worst, one_row, cannot = run.strategy.all_reduce(flags, "max").tolist()
    return int(worst) - 1, bool(one_row), bool(cannot)


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
