"""Parameters in channels_last (or any strided layout) handed to a backend that flattens them.

FSDP2 refuses a non-contiguous parameter (``fully_shard``) and DeepSpeed's broadcast views each
parameter as bytes (``stride(-1) must be 1``), so a model moved to ``channels_last`` fails in
``setup``. Both keep a parameter as a slice of a flat buffer, where a layout cannot survive:
the sharded strategies store such parameters contiguous (the values are the same). A
convolution picks its memory format from its input too (torch's ``suggest_memory_format``
on either operand), so a ``channels_last`` batch still runs the convolutions in channels_last.
"""

from __future__ import annotations

from torch import nn


def make_parameters_contiguous_(model: nn.Module) -> int:
    """Stores every non-contiguous parameter of ``model`` contiguously, in place (same values,
    same ``Parameter`` objects, so optimizers built over them still hold them).

    Returns:
        How many parameters were re-laid out.
    """
    changed = 0
    for param in model.parameters():
        if not param.is_contiguous():
            param.data = param.data.contiguous()
            changed += 1
    return changed
