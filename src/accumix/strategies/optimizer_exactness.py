"""Which optimizers a sharded optimizer keeps exact, and the refusal of the others.

A sharded optimizer steps each rank's part of the parameters. ``zero1`` (torch's
``ZeroRedundancyOptimizer``) gives each rank whole parameters: an update that reads only its
own parameter (element-wise like Adam, or per-parameter like Lamb's trust ratio or Adafactor's
factored moments) is unchanged, but one that reads across parameters (a global gradient-norm
clip inside the optimizer, timm's ``Lamb(max_grad_norm=...)``; L-BFGS) sees only the rank's
share. DeepSpeed flattens the parameters into partitions cut anywhere: only element-wise
updates are unchanged (its ``zero_allow_untested_optimizer`` lets anything else run on the
slices). ddp and single step whole parameters; fsdp steps DTensor shards, whose norms reduce
over the mesh (timm's Lamb is exact there; torch's Adafactor fails inside DTensor), and
L-BFGS is made exact over them (``sharded_lbfgs``: its flat vectors are gathered whole).
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from accumix.errors import ConfigError

# Updates that read each element alone (accumix tests these under every strategy).
ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Rprop, torch.optim.ASGD,
)
# DeepSpeed's own Adam-family kernels (element-wise as well).
_DEEPSPEED_ELEMENTWISE = ("FusedAdam", "DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "FusedLion",
                          "DeepSpeedCPULion")


def is_elementwise(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s update of each element reads only that element's values."""
    cls = type(optimizer)
    return cls in ELEMENTWISE or (cls.__module__.startswith("deepspeed.ops")
                                  and cls.__name__ in _DEEPSPEED_ELEMENTWISE)


def is_per_parameter(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is one accumix knows to read only its own parameter, as a whole
    (torch's Adafactor, timm's Lamb and Lars without an in-optimizer clip): exact under zero1,
    not under flat partitions."""
    cls = type(optimizer)
    adafactor = getattr(torch.optim, "Adafactor", None)
    return (adafactor is not None and isinstance(optimizer, adafactor)) or (
        cls.__module__.startswith("timm.optim") and cls.__name__ in ("Lamb", "Lars"))


def reads_across_parameters(optimizer: Optimizer) -> str | None:
    """Why ``optimizer``'s update of one parameter reads others, or None when it does not."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return "L-BFGS's line search reads every parameter"
    clips = [g.get("max_grad_norm") for g in optimizer.param_groups if g.get("max_grad_norm")]
    if clips:
        return f"max_grad_norm={clips[0]} clips by the norm over all parameters"
    return None


def check_zero1(optimizer: Optimizer) -> None:
    """Refuses an optimizer whose update reads across parameters (zero1 steps whole
    parameters per rank, so each rank's optimizer would see only its share).

    Raises:
        ConfigError: naming the reason and the strategies where it is exact.
    """
    why = reads_across_parameters(optimizer)
    if why is not None:
        raise ConfigError(
            f"strategy='zero1' would change {type(optimizer).__name__}'s update ({why}, and "
            "each rank steps only its share of the parameters); use strategy='ddp' or 'fsdp', "
            "or clip with acc.clip_grad_norm_ and max_grad_norm=None"
        )


def check_deepspeed(optimizer: Optimizer, user_allows_untested: bool) -> None:
    """Refuses an optimizer whose update is not element-wise under DeepSpeed's flat
    partitions, unless the user's DeepSpeed config sets ``zero_allow_untested_optimizer``.

    Raises:
        ConfigError: naming the strategies where it is exact.
    """
    if is_elementwise(optimizer) or user_allows_untested:
        return
    name = type(optimizer).__name__
    if reads_across_parameters(optimizer):
        where = f"strategy='ddp' or 'fsdp', where {name} is exact"
    elif is_per_parameter(optimizer):
        where = f"strategy='zero1' or 'ddp', where {name} is exact"
    else:  # zero1 runs it unchecked: it is exact there only if it reads its own parameter
        where = (f"strategy='ddp', where any optimizer is exact (or 'zero1' if {name}'s update "
                 "reads only its own parameter: zero1 does not check it)")
    raise ConfigError(
        f"strategy='deepspeed' cuts parameters into flat partitions, which changes {name}'s "
        f"update unless it is element-wise (as SGD and Adam are); use {where}, or set "
        "zero_allow_untested_optimizer: true in the DeepSpeed config to accept the difference"
    )
