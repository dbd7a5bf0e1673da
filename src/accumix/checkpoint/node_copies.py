"""torch.distributed.checkpoint on run directories that are not shared: a whole copy per node.

DCP writes each tensor chunk once, from whichever rank its de-duplication picks, and one
``.metadata`` on the coordinator's disk. With a run directory on each node's own disk that
leaves every other node without ``.metadata`` and without the replicated entries (a DDP
model, an optimizer's step counts) that another node's rank happened to write: no node could
load on its own. Here, when the ranks' directories are not one (``common/shared_dir.py``):

* the global plan stays DCP's (de-duplicated, validated: its ``.metadata`` is the same), and
  each group of ranks that shares a disk gets a write of every entry its ranks hold that DCP
  gave to a rank outside the group, by the group's lowest rank holding it. A node's files then
  hold everything its ranks hold: a DDP model is written once per node (what a node needs to
  resume on its own), a sharded FSDP model once in all (each shard is one rank's);
* the coordinator builds one ``.metadata`` per group, pointing each entry at the group's own
  file when it has one, writes its own and broadcasts the others; each group's leader writes
  its copy.

A load reads the ``.metadata`` of its own disk. Resumed on the same ranks, every rank finds
what it holds in its node's files; on another world size a rank may need a shard that another
node wrote, and the reader names the files its directory lacks (``dcp_state.SafeReader``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from accumix.common.run_dir import fsync
from accumix.common.shared_dir import NodeLayout

METADATA = ".metadata"  # DCP's file name


@dataclasses.dataclass(kw_only=True)
class PerNode:
    """A save in progress on run directories that are not shared."""

    layout: NodeLayout
    group: Any = None  # the process group of the save (None: the default one)
    written: list[str] = dataclasses.field(default_factory=list)  # the DCP directories


_ACTIVE: ContextVar[PerNode | None] = ContextVar("accumix_per_node", default=None)


@contextlib.contextmanager
def per_node(layout: NodeLayout, group: Any = None) -> Iterator[PerNode]:
    """While active, ``dcp_state.write`` gives every group of ranks a whole copy (nothing
    changes for a shared directory). Yields the record of the directories written."""
    record = PerNode(layout=layout, group=group)
    token = _ACTIVE.set(None if layout.shared else record)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def active() -> PerNode | None:
    """The save in progress on directories that are not shared, or None."""
    return _ACTIVE.get()


class NodeCopiesPlanner(DefaultSavePlanner):
    """DCP's save planner plus, per group, the entries DCP gave to ranks outside it."""

    def __init__(self, layout: NodeLayout) -> None:
        super().__init__()
        self._layout = layout

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = super().create_global_plan(all_plans)
        owner: dict[MetadataIndex, int] = {}
        written: dict[MetadataIndex, WriteItem] = {}  # with DCP's rewritten index hints
        for rank, plan in enumerate(global_plan):
            for item in plan.items:
                owner[item.index] = rank
                written[item.index] = item
        extra: list[list[WriteItem]] = [[] for _ in global_plan]
        for group in self._layout.groups:
            holder: dict[MetadataIndex, int] = {}
            for rank in group:  # ascending: the group's lowest rank holding an entry writes it
                for item in all_plans[rank].items:
                    holder.setdefault(item.index, rank)
            for index, rank in holder.items():
                if owner[index] not in group:
                    extra[rank].append(written[index])
        plans = [dataclasses.replace(plan, items=[*plan.items, *more])
                 for plan, more in zip(global_plan, extra, strict=True)]
        self.global_plan = plans
        return plans, metadata


def own_results_last(results: list[list[WriteResult]], group: tuple[int, ...]
                     ) -> list[list[WriteResult]]:
    """``results`` reordered so that the group's own writes win DCP's merge (last wins)."""
    return ([r for rank, r in enumerate(results) if rank not in group]
            + [r for rank, r in enumerate(results) if rank in group])


def metadata_copies(metadata: Metadata, results: list[list[WriteResult]], layout: NodeLayout
                    ) -> dict[int, bytes]:
    """The pickled ``.metadata`` of every group but the coordinator's, by its leader."""
    copies = {}
    for group in layout.groups:
        if 0 in group:
            continue
        storage = {}
        for written in own_results_last(results, group):
            storage.update({r.index: r.storage_data for r in written})
        copies[group[0]] = pickle.dumps(dataclasses.replace(metadata, storage_data=storage))
    return copies


def distribute(directory: str, copies: dict[int, bytes] | None, record: PerNode) -> None:
    """Sends the coordinator's ``copies`` to every rank; each other group's leader writes its
    own (collective on the save's process group)."""
    box: list[Any] = [copies]
    dist.broadcast_object_list(box, src=0, group=record.group)
    layout = record.layout
    if layout.is_leader and 0 not in layout.group:
        target = Path(directory) / METADATA
        tmp = target.with_name(f"{METADATA}.tmp")
        with open(tmp, "wb") as f:
            f.write(box[0][layout.rank])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync(target.parent)
    record.written.append(directory)

