"""Parameter counts of a torch model for the memory model: all, trainable, and what full
sharding holds gathered at once (the largest repeated block plus what is outside the blocks).

Works on meta-device modules; torch is only named for types, so importing this loads no torch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def count_params(module: nn.Module, *, trainable_only: bool = False) -> int:
    """Count a module's parameters, each shared (tied) parameter once.

    Works on meta-device modules, so a model can be sized before it is allocated.

    Args:
        module: The model.
        trainable_only: Count only parameters with ``requires_grad``.

    Returns:
        The number of parameter elements.
    """
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """Find the repeated blocks (e.g. transformer layers) that FSDP wraps one unit each.

    A *stack* is a group of at least two children of one parent that share a class and hold
    parameters (the blocks of an ``nn.ModuleList`` or ``nn.Sequential``). Stacks nested inside a
    member of another stack are ignored (a layer's two Linears are not layers), and of the
    remaining stacks those with the most members win: the class that repeats most at the top.

    Args:
        module: The model.

    Returns:
        The blocks, in module order; empty when nothing repeats (the model is one unit).
    """
    stacks: list[list[nn.Module]] = []
    seen: set[int] = set()

    def visit(parent: nn.Module) -> None:
        by_class: dict[type, list[nn.Module]] = defaultdict(list)
        for child in parent.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if count_params(child) > 0:
                by_class[type(child)].append(child)
        # Only a group of a single member is looked into: members of a stack are the units.
        for members in by_class.values():
            if len(members) >= 2:
                stacks.append(members)
            else:
                visit(members[0])

    visit(module)
    if not stacks:
        return []
    most = max(len(members) for members in stacks)
    return [block for members in stacks if len(members) == most for block in members]


def gathered_params(module: nn.Module) -> int:
    """Parameters full sharding (FSDP ``full``, ZeRO-3) holds unsharded at once.

    That is the largest repeated block plus every parameter outside the repeated blocks: FSDP2's
    root unit owns those (embeddings, final norm, head) and keeps them gathered from forward to
    backward. With no repeated blocks the whole model is one unit.

    Args:
        module: The model.

    Returns:
        The number of parameter elements gathered at the peak.
    """
    blocks = repeated_blocks(module)
    if not blocks:
        return count_params(module)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    outside = sum(p.numel() for p in module.parameters() if id(p) not in in_blocks)
    return max(count_params(block) for block in blocks) + outside
