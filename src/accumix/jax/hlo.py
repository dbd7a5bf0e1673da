"""Where the collectives of a compiled step are: inside a loop body (once per micro-step) or not.

The contract (JAX.md, semantics 1) is one gradient reduction per window, outside the scan. This
reads the optimized HLO text (``step.lower(state, window).compile().as_text()``): computations
reachable from a ``while``'s body (through calls, fusions, conditionals) are "in a loop".
"""

from __future__ import annotations

import re
from collections import Counter

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
               "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
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
    counts: dict[str, Counter[str]] = {"in_loop": Counter(), "outside": Counter()}
    for name, lines in bodies.items():
        where = "in_loop" if name in in_loop else "outside"
        for line in lines:
            match = _OPCODE.search(line)
            if match:
                counts[where][match.group(1)] += 1
    return counts


def _callees(lines: list[str]) -> set[str]:
    found: set[str] = set()
    for line in lines:
        found.update(_CALLED.findall(line))
        for group in _BRANCHES.findall(line):
            found.update(n.strip().lstrip("%") for n in group.split(","))
    return found
