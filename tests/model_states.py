"""The model states one rank holds, counted as ``accumix.memory.model`` counts them: each tensor
storage once, at its peak. Shared by the memory model's multi-rank tests and ``bench/hsdp.py``.

* params: the most parameter storage alive over every module's forward (FSDP2's local shards
  plus its all-gathered buffers, DeepSpeed stage 3's partitions);
* grads: the most gradient storage held after a micro-step's backward, in the window or at its
  boundary: what the strategy steps with, ``param.grad``, FSDP2's unsharded (accumulated)
  gradients and hsdp's partial (reduce-scattered) accumulators;
* optimizer: the optimizer's state tensors after the step, plus any tensor it steps that is not
  a model parameter (DeepSpeed's flat fp32 partitions).

FSDP2's unit and parameter-group attributes are private (torch 2.13): no public API says what
a unit holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a freed FSDP buffer counts 0)."""
    seen = {t.untyped_storage().data_ptr() or id(t): t.untyped_storage().nbytes()
            for t in tensors if t is not None}
    return sum(seen.values())


def _groups(module: nn.Module) -> list[Any]:
    return [group for unit in module.modules() if isinstance(unit, FSDPModule)
            for group in unit._get_fsdp_state()._fsdp_param_groups]


def param_bytes(module: nn.Module) -> int:
    """Parameter storage alive now: shards, FSDP2's gathered buffers, ZeRO-3 partitions."""
    tensors = [_local(p.data) for p in module.parameters()]
    tensors += [p.ds_tensor for p in module.parameters() if hasattr(p, "ds_tensor")]
    for fp in (fp for group in _groups(module) for fp in group.fsdp_params):
        tensors.append(_local(fp.sharded_param))
        tensors.extend(fp.all_gather_outputs)
    return storage_bytes(tensors)


def grad_bytes(strategy: Any, module: nn.Module) -> int:
    """Gradient storage held now (see the module docstring)."""
    params = list(module.parameters())
    tensors: list[torch.Tensor | None] = [_local(g) for g in strategy.local_grads(params)]
    tensors += [_local(p.grad) for p in params if p.grad is not None]
    for group in _groups(module):
        for fp in group.fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            tensors += [fp.unsharded_accumulated_grad,
                        None if unsharded is None else unsharded.grad]
        tensors.append(group._partial_reduce_output)
    return storage_bytes(tensors)


def optimizer_bytes(optimizer: Any, module: nn.Module) -> int:
    """The optimizer's state tensors and the tensors it steps that are not ``module``'s."""
    inner = getattr(optimizer, "optimizer", optimizer)
    states = [_local(t) for s in inner.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.dim()]
    stepped = [p for g in inner.param_groups for p in g["params"]
               if not any(p is q for q in module.parameters())]
    return storage_bytes(states + [_local(p) for p in stepped])


def window_model_states(acc: Any, model: nn.Module, optimizer: Any, batch: torch.Tensor, *,
                        micro_steps: int) -> dict[str, int]:
    """``micro_steps`` micro-steps of the DESIGN.md loop on ``batch`` (one optimizer step when
    it is ``acc.grad_accum_steps``): the peaks of the three terms and their sum, ``total``."""
    module = acc.unwrap(model)
    peak = {"params": 0, "grads": 0}

    def params_now(*_: Any) -> None:
        peak["params"] = max(peak["params"], param_bytes(module))

    # prepended: before FSDP2's own hook reshards the unit
    hooks = [sub.register_forward_hook(params_now, prepend=True) for sub in module.modules()]
    for _ in range(micro_steps):
        with acc.accumulate():
            acc.backward(model(batch).square().mean())
            peak["grads"] = max(peak["grads"], grad_bytes(acc.strategy, module))
            optimizer.step()
            optimizer.zero_grad()
    for hook in hooks:
        hook.remove()
    out = {**peak, "optimizer": optimizer_bytes(optimizer, module)}
    return {**out, "total": sum(out.values())}
