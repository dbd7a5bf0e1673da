"""``acc.gather`` and ``acc.gather_for_metrics``: every rank's rows, exact on unequal sizes.

Two all-gathers of plain tensors per call, whatever the nesting (no object gather: it pickles
and adds collectives of its own): each rank's payload length, then each rank's payload padded
to the longest, a header (the leaves' paths, shapes and dtypes; for metrics, where the current
batch's rows sit in the epoch) followed by the leaves' bytes (``common.gather_specs``). Every
rank checks every rank's header alike (a mismatch is one line on every rank, never a gloo abort
or rows of zeros) and cuts each rank's real rows back out. Bytes travel, not the dtype: every
dtype (bool, int64, bfloat16, complex) crosses every backend unchanged.

``gather_for_metrics`` then keeps, for a batch of a set-up loader, only the rows that are real
samples (``DistributedSampler`` pads the epoch with repeats, ``data.batch_place``), ordered by
their epoch position: over an epoch the results are the dataset (in the sampler's order)
exactly once, on any world size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from accumix.common.gather_specs import (
    LeafSpec,
    check_specs,
    decode_header,
    encode_header,
    flatten,
    payload_layout,
    rebuild,
    rows_of,
)
from accumix.data.batch_place import BatchPlace, merged_order
from accumix.errors import ConfigError
from accumix.runtime import fault

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

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
    if place is not None and not place.sharded:
        place = None  # the newest batch is of a loader accumix did not shard: its rows as they are
    return _gather(run, data, "acc.gather_for_metrics", place)


def current_place(run: RunState) -> BatchPlace | None:
    """The place of the batch a set-up loader of this run yielded last, if one is current (the
    newest decides: a loop over another loader inside a training batch gathers its own rows)."""
    places = [loader.place for loader in (*run.loaders, *run.eval_loaders)
              if getattr(loader, "place", None) is not None]
    return max(places, key=lambda p: p.seq) if places else None


def _gather(run: RunState, data: Any, what: str, place: BatchPlace | None) -> Any:
    leaves = flatten(data, _is_tensor)
    specs = [_spec(path, value) for path, value in leaves]
    tensors = [value.detach() for _, value in leaves if _is_tensor(value)]
    if run.strategy.world_size > 1:
        with fault.phase(run, what):
            every, places, payloads = _exchange(run, specs, tensors, place)
        check_specs(every, what)
        parts = [_unpack(payload, specs_r, tensors) for payload, specs_r in
                 zip(payloads, every, strict=True)]
    else:
        every, places = [specs], [place]
        check_specs(every, what)
        parts = [[t if t.dim() else t.reshape(1) for t in tensors]]
    keep = _rows_to_keep(every, places, what)
    out = [_merge([rank_parts[i] for rank_parts in parts], keep, stack=not specs[i].shape)
           for i in range(len(specs))]
    return rebuild(data, out, _is_tensor)


def _exchange(run: RunState, specs: list[LeafSpec], tensors: list[torch.Tensor],
              place: BatchPlace | None
              ) -> tuple[list[list[LeafSpec]], list[BatchPlace | None], list[tuple[int, Any]]]:
    """Every rank's leaves, place and payload (its header's length, its bytes), through two
    all-gathers of plain tensors: the payloads' lengths, then the payloads padded to the
    longest (``common.gather_specs``)."""
    strategy, device = run.strategy, run.device
    header = encode_header(specs, _as_dict(place))
    offsets, size = payload_layout(len(header), [t.numel() * t.element_size() for t in tensors])
    lengths = strategy.all_gather(torch.tensor([len(header), size], device=device))
    lengths = torch.stack(lengths).tolist()  # one copy to the host
    payload = torch.zeros(max(n for _, n in lengths), dtype=torch.uint8, device=device)
    payload[:len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for tensor, offset in zip(tensors, offsets, strict=True):
        flat = tensor.to(device).contiguous().reshape(-1).view(torch.uint8)
        payload[offset:offset + flat.numel()] = flat
    payloads = strategy.all_gather(payload)
    headers = torch.cat([part[:h] for part, (h, _) in zip(payloads, lengths, strict=True)])
    raw = headers.cpu().numpy().tobytes()  # one copy to the host
    every, places, start = [], [], 0
    for h, _ in lengths:
        rank_specs, rank_place = decode_header(raw[start:start + h])
        every.append(rank_specs)
        places.append(None if rank_place is None else BatchPlace(**rank_place))
        start += h
    return every, places, [(h, part) for part, (h, _) in zip(payloads, lengths, strict=True)]


def _unpack(payload: tuple[int, torch.Tensor], specs: list[LeafSpec],
            tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One rank's leaves cut from its payload (after ``check_specs``: each leaf's dtype and
    trailing shape are this rank's, only the rows differ)."""
    header, part = payload
    rows = [rows_of(spec) for spec in specs]
    row_bytes = [t.element_size() * math.prod(t.shape[1:]) for t in tensors]
    offsets, _ = payload_layout(header, [n * b for n, b in zip(rows, row_bytes, strict=True)])
    return [part[offset:offset + n * b].view(t.dtype).reshape(n, *t.shape[1:])
            for t, offset, n, b in zip(tensors, offsets, rows, row_bytes, strict=True)]


def _as_dict(place: BatchPlace | None) -> dict[str, Any] | None:
    return None if place is None else dataclasses.asdict(place)


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
