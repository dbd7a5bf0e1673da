"""Where the rows of a loader's batch sit in its epoch's sample order, on every rank.

``acc.gather_for_metrics`` reads it. A set-up loader shards like ``DistributedSampler``: the
epoch's indices are padded by repeating the first ones until every rank has as many, and rank
``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...``; so row ``i`` of a batch whose first row
is the ``o``-th of the rank's shard is position ``(o + i) * W + r``, and a position past the
epoch's real samples is a padding duplicate (always the last rows of a rank's batch). Gathered
rows ordered by position are the epoch's samples in the sampler's order (the dataset's order
without a shuffle), each once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

_YIELDS = itertools.count(1)  # which loader yielded last, across the loaders of this process


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlace:
    """A yielded batch's rows on this rank.

    Attributes:
        seq: increases with every batch any loader of this process yields (the newest wins).
        rows: the batch's rows on this rank.
        first: the epoch position of its row 0.
        stride: the step between its rows' positions (the world size; 1 for a block).
        samples: the epoch's real samples; positions from here on are padding.
        padded: the loader pads its shards to equal length (a set-up loader) rather than
            splitting them unevenly (``acc.setup_eval_loader``).
    """

    seq: int
    rows: int
    first: int
    stride: int
    samples: int
    padded: bool = True

    def real_rows(self) -> int:
        """The rows before the first padding duplicate."""
        if self.first >= self.samples:
            return 0
        return min(self.rows, (self.samples - self.first + self.stride - 1) // self.stride)


def next_seq() -> int:
    return next(_YIELDS)


def strided_place(*, rows: int, offset: int, rank: int, world_size: int, samples: int
                  ) -> BatchPlace:
    """The place of a batch of a ``DistributedSampler``-sharded loader whose first row is the
    ``offset``-th of this rank's shard; ``samples`` is the epoch's real sample count."""
    return BatchPlace(seq=next_seq(), rows=rows, first=offset * world_size + rank,
                      stride=world_size, samples=samples)


def merged_order(places: Sequence[BatchPlace]) -> list[tuple[int, int]]:
    """``(rank, row)`` of every real row of the ranks' batches, by epoch position."""
    rows = [(place.first + i * place.stride, rank, i) for rank, place in enumerate(places)
            for i in range(place.real_rows())]
    return [(rank, i) for _, rank, i in sorted(rows)]
