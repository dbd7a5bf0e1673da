"""Where the collectives of a compiled step are: inside a loop body (once per micro-step) or not,
over which devices, in which dtype, and how many bytes.

The contract (JAX.md, semantics 1) is one gradient reduction per window, outside the scan. This
reads HLO text: the optimized module (``step.lower(state, window).compile().as_text()``) for
what runs, or the lowered one (``step.lower(...).compiler_ir("hlo").as_hlo_text()``) for the
dtypes a program asks for (XLA's CPU backend promotes 16-bit reductions to float32 when it
compiles). Computations reachable from a ``while``'s body (through calls, fusions,
conditionals) are "in a loop". Device ids in replica groups are positions in the mesh's
flattened device order (``use_global_device_ids``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
               "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_OPCODE = re.compile(r"=\s*[^=]*?\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collective_counts(hlo_text: str) -> dict[str, Counter[str]]:
    """Collective instructions of an HLO module, split into ``"in_loop"`` and ``"outside"``.

    Returns:
        ``{"in_loop": Counter(kind -> n), "outside": Counter(kind -> n)}``.
    """
    counts: dict[str, Counter[str]] = {"in_loop": Counter(), "outside": Counter()}
    for op in collective_ops(hlo_text):
        counts["in_loop" if op.in_loop else "outside"][op.kind] += 1
    return counts


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_RESULT = re.compile(r"=\s*(.*?)\s(?:" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_GROUPS = re.compile(r"replica_groups=(\{(?:\{[\d,]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\]"
                     r"(?:T\([\d,]+\))?|mesh\[[^\]]*\], device_ids=\(\[[\d,]+\]"
                     r"(?:T\([\d,]+\))?\) \{[^}]*\})")


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction.

    Attributes:
        kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``, ...
        dtypes: its result's element types (several for a combined tuple), e.g. ``("bf16",)``.
        result_bytes: the bytes of its result(s) on one device.
        groups: the device groups it runs over (positions in the mesh), or None if unread.
        in_loop: inside a loop body (once per micro-step).
    """

    kind: str
    dtypes: tuple[str, ...]
    result_bytes: int
    groups: tuple[tuple[int, ...], ...] | None
    in_loop: bool

    @property
    def payload_bytes(self) -> int:
        """What one device hands in: an all-gather delivers its result, a reduce-scatter
        reduces its result times the group, an all-reduce its result (the torch bench's
        count, ``accumix.testing.CollectiveLog``)."""
        if self.kind == "reduce-scatter" and self.groups:
            return self.result_bytes * len(self.groups[0])
        return self.result_bytes

    def spans(self, node_of: dict[int, int]) -> bool:
        """Whether a group holds devices of several nodes (``node_of``: device -> node)."""
        return self.groups is None or any(len({node_of[d] for d in g}) > 1
                                          for g in self.groups)


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """Every collective instruction of an HLO module (see ``CollectiveOp``)."""
    bodies: dict[str, list[str]] = {}
    current: str | None = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            bodies[current] = []
        elif line.strip() == "}":
            current = None
        elif current is not None:
            bodies[current].append(line)
    calls = {name: _callees(lines) for name, lines in bodies.items()}
    loop_roots = {m.group(1) for lines in bodies.values() for line in lines
                  if (m := _WHILE_BODY.search(line))}
    in_loop: set[str] = set()
    stack = list(loop_roots)
    while stack:
        name = stack.pop()
        if name in in_loop:
            continue
        in_loop.add(name)
        stack.extend(calls.get(name, ()))
    ops = []
    for name, lines in bodies.items():
        for line in lines:
            match = _OPCODE.search(line)
            if match:
                ops.append(_op(match.group(1), line, name in in_loop))
    return ops


def _op(kind: str, line: str, in_loop: bool) -> CollectiveOp:
    result = _RESULT.search(line)
    arrays = _ARRAY.findall(result.group(1)) if result else []
    dtypes = tuple(dtype for dtype, _ in arrays)
    nbytes = sum(_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d],
                                                     dtype=np.int64))
                 for dtype, dims in arrays)
    groups = _GROUPS.search(line)
    return CollectiveOp(kind=kind, dtypes=dtypes, result_bytes=nbytes,
                        groups=_groups(groups.group(1)) if groups else None, in_loop=in_loop)


def _groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Replica groups in any of XLA's three spellings: ``{{0,1},{2,3}}``, the iota
    ``[2,2]<=[4]`` / ``[2,2]<=[2,2]T(1,0)``, or the mesh ``mesh['a'=2,'b'=2],
    device_ids=([2,2]T(1,0)) {'a'}`` (groups along the named axes)."""
    if text.startswith("{"):
        return tuple(tuple(int(d) for d in g.split(",") if d)
                     for g in re.findall(r"\{([\d,]*)\}", text[1:-1]))
    if text.startswith("["):
        shape, dims, perm = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                     text).groups()
        ids = _iota(dims, perm)
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(_ints(shape)))
    axes = re.findall(r"'(\w+)'=(\d+)", text)
    dims, perm = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", text).groups()
    ids = _iota(dims, perm).reshape([int(n) for _, n in axes])
    chosen = re.findall(r"'(\w+)'", text.rsplit("{", 1)[1])
    names = [a for a, _ in axes]
    along = [names.index(a) for a in chosen]
    rest = [i for i in range(len(names)) if i not in along]
    moved = np.transpose(ids, rest + along).reshape(-1, int(np.prod(
        [ids.shape[i] for i in along])))
    return tuple(tuple(int(d) for d in g) for g in moved)


def _ints(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(int(np.prod(_ints(dims)))).reshape(_ints(dims))
    return ids.transpose(_ints(perm)) if perm else ids


def node_map(devices: int, per_node: int) -> dict[int, int]:
    """Device position -> node, nodes holding ``per_node`` consecutive positions (hsdp's mesh
    rows)."""
    return {d: d // per_node for d in range(devices)}




def _callees(lines: list[str]) -> set[str]:
    found: set[str] = set()
    for line in lines:
        found.update(_CALLED.findall(line))
        for group in _BRANCHES.findall(line):
            found.update(n.strip().lstrip("%") for n in group.split(","))
    return found
