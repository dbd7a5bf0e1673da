"""Which ranks see the same run directory: decided at every save by files, not assumed.

On one machine or a cluster with a shared filesystem every rank sees one directory; on most
cloud clusters each node has its own disk, and the same ``run_dir`` path names a different
directory on each node. A save asks the directory itself::

    every rank writes  run_dir/.probe-rank-<r>-<token>   (its own fresh random token)
    all-gather the tokens                               (also the barrier: all are written)
    every rank opens the file name of every other rank -> the ranks it sees
    all-gather these views                              -> the groups (one per filesystem)
    every rank removes its own file

The views must split the ranks into groups that see each other and nobody else (a rank that
sees a peer that does not see it is refused: a filesystem that shows other nodes' writes late
cannot hold a checkpoint that must be whole). Each group's lowest rank is its leader: it
prepares and publishes that filesystem's copy of the step directory.

Only exact file names are opened, never directory listings: a name made of a fresh random
token was never looked up before, so a client cache (NFS's attribute and negative-lookup
caches) cannot answer for the server; ``close()`` of the writer flushed it there
(close-to-open consistency).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accumix.errors import CheckpointError

PROBE_PREFIX = ".probe-rank-"


@dataclass(frozen=True, kw_only=True)
class NodeLayout:
    """The ranks split by the filesystem their run directory is on.

    Attributes:
        groups: each group's ranks, ascending; groups ordered by their lowest rank.
        rank: this process's rank.
    """

    groups: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def shared(self) -> bool:
        """Every rank sees one directory."""
        return len(self.groups) == 1

    @property
    def group(self) -> tuple[int, ...]:
        """The ranks that see this rank's directory."""
        return self.group_of(self.rank)

    @property
    def leader(self) -> int:
        """The rank that prepares and publishes this rank's directory."""
        return self.group[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(g[0] for g in self.groups)

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)


def one_group(world_size: int, rank: int) -> NodeLayout:
    """Every rank on one directory (one process, or a store every rank reaches by URL)."""
    return NodeLayout(groups=(tuple(range(world_size)),), rank=rank)


def probe(run_dir: Path, *, rank: int, world_size: int,
          all_gather: Callable[[Any], list[Any]]) -> NodeLayout:
    """The groups of ranks that share ``run_dir`` (collective: every rank calls it).

    Creates ``run_dir`` if needed. Two ``all_gather`` rounds of a few bytes each.

    Args:
        run_dir: the run directory, a local path (the same string on every rank).
        rank: this rank.
        world_size: the number of ranks.
        all_gather: gathers one picklable object from every rank, in rank order.

    Returns:
        The layout; ``shared`` when every rank sees one directory.

    Raises:
        CheckpointError: a rank could not write into ``run_dir`` (every rank raises it, naming
            the rank and the error), or the ranks' views do not split them into groups.
    """
    if world_size == 1:
        return one_group(1, 0)
    token, error = uuid.uuid4().hex, None
    mine = run_dir / f"{PROBE_PREFIX}{rank}-{token}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        mine.write_text(token)
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    gathered = all_gather((token, error))
    failed = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
    seen = [] if failed else [r for r, (t, _) in enumerate(gathered)
                              if _holds(run_dir / f"{PROBE_PREFIX}{r}-{t}", t)]
    views = all_gather(seen)
    try:
        mine.unlink(missing_ok=True)
    except OSError:  # never written (the error above)
        pass
    if failed:
        r, message = failed[0]
        raise CheckpointError(f"rank {r} cannot write into the run directory {run_dir} "
                              f"({message}); give a run_dir every rank can write")
    return NodeLayout(groups=_groups(views, run_dir), rank=rank)


def _holds(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:  # absent here: another node's disk
        return False


def _groups(views: Sequence[Sequence[int]], run_dir: Path) -> tuple[tuple[int, ...], ...]:
    groups: list[tuple[int, ...]] = []
    for rank, view in enumerate(views):
        group = tuple(sorted(view))
        consistent = rank in group and all(tuple(sorted(views[r])) == group for r in group)
        if not consistent:
            shown = "; ".join(f"rank {r} sees {sorted(v)}" for r, v in enumerate(views))
            raise CheckpointError(
                f"the ranks disagree on which of them share the run directory {run_dir} "
                f"({shown}): its filesystem shows one node's files to another late or not at "
                "all; give a run_dir on a filesystem every rank sees at once, one on each "
                "node's own disk, or an object store URL (s3://...)")
        if group not in groups:
            groups.append(group)
    return tuple(sorted(groups))


def remove_leftover_probes(run_dir: Path) -> None:
    """Removes probe files a crashed save left (called by a leader while preparing a save,
    after every rank has read the current ones)."""
    for leftover in run_dir.glob(f"{PROBE_PREFIX}*"):
        try:
            os.unlink(leftover)
        except OSError:
            pass
