"""``acc.gather`` and ``acc.gather_for_metrics``: every rank's rows, exact on unequal sizes.

Two collectives per call, whatever the nesting: one small object all-gather of every rank's
leaves (paths, shapes, dtypes; for metrics, where the current batch's rows sit in the epoch),
checked alike on every rank (``common.gather_specs``: a mismatch is one line on every rank,
never a gloo abort or rows of zeros), then one all-gather of a byte buffer that holds each leaf
padded to the longest rank's rows; each rank's real rows are cut back out. Bytes travel, not
the dtype: every dtype (bool, int64, bfloat16, complex) crosses every backend unchanged.

``gather_for_metrics`` then keeps, for a batch of a set-up loader, only the rows that are real
samples (``DistributedSampler`` pads the epoch with repeats, ``data.batch_place``), ordered by
their epoch position: over an epoch the results are the dataset (in the sampler's order)
exactly once, on any world size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from accumix.common.gather_specs import LeafSpec, check_specs, flatten, rebuild, rows_of
from accumix.data.batch_place import BatchPlace, merged_order
from accumix.errors import ConfigError
from accumix.runtime import fault

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

_ALIGN = 16  # every leaf's bytes start here, so that a view as its dtype is aligned


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _spec(path: str, value: Any) -> LeafSpec:
    if isinstance(value, torch.Tensor):
        return LeafSpec(path, tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return LeafSpec(path, None, type(value).__name__)


def gather(run: RunState, data: Any) -> Any:
    """``acc.gather(data)``: see ``Accelerator.gather``."""
    return _gather(run, data, "acc.gather", None)


def gather_for_metrics(run: RunState, data: Any) -> Any:
    """``acc.gather_for_metrics(data)``: see ``Accelerator.gather_for_metrics``."""
    place = current_place(run)
    if place is not None and not place.padded:
        raise ConfigError(
            "acc.gather_for_metrics got a batch of acc.setup_eval_loader's loader, whose "
            "uneven shards repeat no sample (nothing to remove) and may give the ranks different "
            "numbers of batches (a gather per batch would wait for a rank that has finished); "
            "keep this rank's rows and call acc.gather once after the loop (rank order is the "
            "loader's order), or acc.reduce the sums")
    return _gather(run, data, "acc.gather_for_metrics", place)


def current_place(run: RunState) -> BatchPlace | None:
    """The place of the batch a set-up loader of this run yielded last, if one is current."""
    places = [loader.place for loader in (*run.loaders, *run.eval_loaders)
              if getattr(loader, "place", None) is not None]
    return max(places, key=lambda p: p.seq) if places else None


def _gather(run: RunState, data: Any, what: str, place: BatchPlace | None) -> Any:
    leaves = flatten(data, _is_tensor)
    specs = [_spec(path, value) for path, value in leaves]
    strategy = run.strategy
    distributed = strategy.world_size > 1
    every, places = [specs], [place]
    if distributed:
        with fault.phase(run, what):
            shared = strategy.all_gather_object(
                ([(s.path, s.shape, s.dtype) for s in specs], _as_dict(place)))
        every = [[LeafSpec(*s) for s in rank_specs] for rank_specs, _ in shared]
        places = [None if p is None else BatchPlace(**p) for _, p in shared]
    check_specs(every, what)
    keep = _rows_to_keep(every, places, what)
    tensors = [value.detach() for _, value in leaves]
    if distributed:
        with fault.phase(run, what):
            parts = _exchange(run, tensors, every)
    else:
        parts = [[t if t.dim() else t.reshape(1) for t in tensors]]
    out = [_merge([rank_parts[i] for rank_parts in parts], keep, stack=not specs[i].shape)
           for i in range(len(specs))]
    return rebuild(data, out, _is_tensor)


def _as_dict(place: BatchPlace | None) -> dict[str, Any] | None:
    if place is None:
        return None
    return {"seq": place.seq, "rows": place.rows, "first": place.first,
            "stride": place.stride, "samples": place.samples, "padded": place.padded}


def _rows_to_keep(every: list[list[LeafSpec]], places: list[BatchPlace | None], what: str
                  ) -> list[tuple[int, int]] | None:
    """``(rank, row)`` in output order for a batch of a set-up loader on every rank; None to
    keep every row in rank order (``acc.gather``, or rows accumix did not shard).

    Raises:
        ConfigError: a leaf whose rows are not the batch's rows on some rank (a per-token or
            per-batch value cannot be told apart from padding).
    """
    if any(p is None for p in places):
        return None
    known = [p for p in places if p is not None]
    for index, spec in enumerate(every[0]):
        got = [specs[index].shape for specs in every]
        if any(not shape or shape[0] != p.rows for shape, p in zip(got, known, strict=True)):
            where = f" at {spec.path}" if spec.path else ""
            listed = ", ".join(f"rank {r} {list(shape or ())} for {p.rows} rows"
                               for r, (shape, p) in enumerate(zip(got, known, strict=True)))
            raise ConfigError(
                f"{what} drops the padding rows of the current batch, so each tensor needs one "
                f"row per sample of it{where}: {listed}; gather per-sample values (a "
                "per-token or per-batch value with acc.gather or acc.reduce)")
    return merged_order(known)


def _exchange(run: RunState, tensors: list[torch.Tensor], every: list[list[LeafSpec]]
              ) -> list[list[torch.Tensor]]:
    """Each rank's leaves, through one all-gather of equal byte buffers."""
    layout = []  # per leaf: (offset, bytes per row, the longest rank's rows)
    size = 0
    for index, tensor in enumerate(tensors):
        row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
        longest = max(rows_of(specs[index]) for specs in every)
        layout.append((size, row_bytes, longest))
        size += -(-row_bytes * longest // _ALIGN) * _ALIGN
    buffer = torch.zeros(size, dtype=torch.uint8, device=run.device)
    for tensor, (offset, _, _) in zip(tensors, layout, strict=True):
        flat = tensor.to(run.device).contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()] = flat
    gathered = run.strategy.all_gather(buffer)
    out: list[list[torch.Tensor]] = []
    for r, part in enumerate(gathered):
        leaves = []
        for tensor, (offset, row_bytes, _), spec in zip(tensors, layout, every[r],
                                                        strict=True):
            rows = rows_of(spec)
            raw = part[offset:offset + rows * row_bytes]
            leaves.append(raw.view(tensor.dtype).reshape(rows, *tensor.shape[1:]))
        out.append(leaves)
    return out


def _merge(parts: list[torch.Tensor], keep: list[tuple[int, int]] | None, *, stack: bool
           ) -> torch.Tensor:
    """One leaf's rows from every rank: all in rank order, or ``keep``'s rows in its order."""
    if keep is None:
        whole = torch.cat(parts)
        return whole if not stack else whole.reshape(len(parts), *parts[0].shape[1:])
    starts, total = [], 0
    for part in parts:
        starts.append(total)
        total += part.shape[0]
    index = torch.tensor([starts[r] + i for r, i in keep], dtype=torch.long,
                         device=parts[0].device)
    return torch.cat(parts).index_select(0, index)
