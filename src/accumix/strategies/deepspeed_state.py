"""DeepSpeed's engine state in the checkpoint format the other strategies share (DCP).

``save_sharded`` (``checkpoint/dcp_state.py``) writes, for model ``i``, ``model{i}.<fqn>`` (the
plain module's state dict) and ``optim{i}`` in torch's FQN-keyed optimizer form::

    {"state": {fqn: {"step": t, "exp_avg": full tensor, ...}},
     "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}

DeepSpeed's ZeRO optimizers hold none of that in that shape: each rank keeps a flat fp32
partition per param group (ZeRO-3: per sub-group) and the inner torch optimizer's state is keyed
by those flat tensors. So a save builds the plain form, and a load takes it apart again:

save (collective)::

    model   <- full_state(engine): the fp32 master of every parameter the optimizer holds
               (gathered), frozen ones and buffers from the module
    for each user param group g (its FQNs recorded in setup, before deepspeed.initialize
    re-pointed the groups at flat partitions), if the inner optimizer has state for g's flats:
        scalars <- the flat state's entries that are not flat tensors (Adam's "step": one
                   value for the whole flat group)
        for fqn in g (trainable): state[fqn] = scalars + {key: safe_get_full_optimizer_state
                   (param, key)} for every flat tensor key (exp_avg, exp_avg_sq, momentum ...)
    param_groups <- the user's group dicts (hyper-parameters the scheduler moved) + FQN lists
    engine{i} <- the engine's counters (global_steps, global_samples, skipped_steps)
    dcp.save(every rank the same full tensors): DCP writes each entry once.

An optimizer that never stepped has no state in DeepSpeed (its states are created lazily):
``state`` is then empty, as ``load_sharded`` treats a parameter that never had state.

load (collective)::

    read the metadata (through dcp_state's whitelist); with strict, the module's keys must be
    the checkpoint's (named otherwise, as load_sharded does)
    templates <- full-shape empty tensors (shape and dtype from the metadata) for the model keys
                 both have and every saved optim{i} entry; dcp.load fills them (non-tensor
                 entries through weights_only)
    ZeRO-3: partition everything (DeepSpeed's checkpoint prologue)
    module  <- frozen parameters, parameters the optimizer does not hold, buffers
               (ZeRO-3: inside GatheredParameters(modifier_rank=0), which re-partitions them)
    groups  <- the saved hyper-parameters, group by group
    inner optimizer state per flat: created as zeros (DeepSpeed creates it lazily), "step" and
               the other scalars from the group's saved states; no saved state: removed
    fragments relinked to those tensors (ZeRO 1/2), then safe_set_full_optimizer_state and
    safe_set_full_fp32_param per held parameter
    working copies <- the new masters: ZeRO 1/2 keep a bit16 (in fp32 runs an fp32) flat copy
               (update_lp_params); ZeRO-3 copies fp32 -> its partitions per sub-group and
               re-gathers the persistent parameters (DeepSpeed's checkpoint epilogue)

Limits: DeepSpeed keeps one "step" per flat group, so a group whose parameters had different
step counts (some had no gradient in some windows) resumes with the first saved one. The
engine's counters come back only from a DeepSpeed save (other strategies have none).

The fp16 loss scale: DeepSpeed's ``DynamicLossScaler`` state maps onto ``DynamicLossScale``'s
``{"scale", "clean_steps", "budget"}`` one to one: ``cur_scale`` is ``scale``,
``cur_hysteresis`` is ``budget``, and the clean steps since the last overflow are
``cur_iter - last_overflow_iter - 1`` (DeepSpeed's ``stable_interval`` after the update), so a
load sets ``last_overflow_iter`` from ``clean_steps``. DeepSpeed grows after
``growth_interval + 1`` clean steps where accumix's own scaler grows after
``growth_interval``: the count carries over, each side then applies its own rule.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from accumix.checkpoint import dcp_state
from accumix.errors import CheckpointError


# -- names recorded in setup -----------------------------------------------------------------------
def group_fqns(model: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """Each param group's parameter names, as ``get_state_dict`` names them (a tied parameter by
    its first name); read before ``deepspeed.initialize`` re-points the groups."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return [[names[id(p)] for p in group["params"] if id(p) in names]
            for group in optimizer.param_groups]


# -- the model -------------------------------------------------------------------------------------
def full_state(engine: Any, trained: set[int], stage: int) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter the optimizer holds as its full fp32 master
    (gathered: collective), frozen ones, the others and buffers as the module holds them."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    # Frozen parameters, and trainable ones the optimizer does not hold (they have no fp32
    # master: ZeRO-3's safe_get_full_fp32_param raises KeyError on them), come from the module.
    plain = [p for p in module.parameters() if not _held(p, trained)]
    gather: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if stage == 3 and plain:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(plain)
    with gather:  # ZeRO-3 re-partitions on exit: keep copies
        state = {k: v.detach().clone() if stage == 3 else v.detach()
                 for k, v in module.state_dict().items()}
    for p, names in _names(module).items():
        full = safe_get_full_fp32_param(p) if _held(p, trained) else None
        if full is not None:
            for name in names:
                state[name] = full.detach().reshape(_shape(p)).clone()
    return state


# -- save ------------------------------------------------------------------------------------------
def save(directory: str, engine: Any, optimizer: Optimizer, groups: list[list[str]],
         trained: set[int], stage: int) -> None:
    """Writes the engine's model and optimizer as ``save_sharded`` writes a plain pair
    (collective; see the module docstring)."""
    dcp_state.write(state(engine, optimizer, groups, trained, stage), directory)


def state(engine: Any, optimizer: Optimizer, groups: list[list[str]], trained: set[int],
          stage: int) -> dict[str, Any]:
    """What ``save`` writes: full fp32 masters and optimizer states (gathered copies)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero = engine.optimizer
    _relink(zero)
    params = dict(engine.module.named_parameters())
    per_group = _flat_group_states(zero)
    states: dict[str, Any] = {}
    for index, names in enumerate(groups):
        if index not in per_group:
            continue  # never stepped: no state, as a torch optimizer has none
        scalars, keys = per_group[index]
        for name in names:
            p = params[name]
            if not _held(p, trained):
                continue
            entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
            for key in keys:
                entry[key] = safe_get_full_optimizer_state(p, key).reshape(_shape(p)).clone()
            states[name] = entry
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
                    for group, names in zip(optimizer.param_groups, groups, strict=True)]
    return {
        "model0": full_state(engine, trained, stage),
        "optim0": {"state": states, "param_groups": param_groups},
        "engine0": {"global_steps": int(engine.global_steps),
                    "global_samples": int(engine.global_samples),
                    "skipped_steps": int(engine.skipped_steps)},
    }


# -- load ------------------------------------------------------------------------------------------
def load(directory: str, engine: Any, optimizer: Optimizer, groups: list[list[str]],
         trained: set[int], stage: int, *, strict: bool = True) -> None:
    """Reads a checkpoint of any strategy and world size into the engine (collective; see the
    module docstring).

    Raises:
        CheckpointError: with ``strict``, keys one side has and the other lacks, or param
            groups whose parameters differ (named).
    """
    reader = dcp_state.SafeReader(directory)
    metadata = reader.read_metadata().state_dict_metadata
    module = engine.module
    own = module.state_dict()
    missing = set(dcp_state.check_model_keys(directory, 0, own, set(metadata), strict=strict))
    model_tpl = {key: _template(metadata.get(f"model0.{key}")) if torch.is_tensor(value) else value
                 for key, value in own.items() if key not in missing}
    optim_tpl = {key[len("optim0."):]: _template(md) for key, md in metadata.items()
                 if key.startswith("optim0.")}
    sd: dict[str, Any] = {"model0": model_tpl, "optim0": optim_tpl}
    if "engine0.global_steps" in metadata:
        sd["engine0"] = {"global_steps": None, "global_samples": None, "skipped_steps": None}
    dcp_state.read(sd, reader)
    saved_groups, saved_states = _unflatten_optim(sd["optim0"])
    _check_groups(directory, saved_groups, groups, strict)
    zero = engine.optimizer
    if stage == 3:
        zero.checkpoint_event_prologue()  # every parameter partitioned
    _load_module(module, model_tpl, trained, stage)
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=False):
        group.update((k, v) for k, v in saved.items() if k != "params")
    _load_optimizer(zero, module, groups, saved_states, trained)
    for p, names in _names(module).items():
        if _held(p, trained) and names[0] in model_tpl:
            _set_full(zero, p, model_tpl[names[0]])
    if stage == 3:
        for sub_group in range(len(zero.fp16_partitioned_groups_flat)):
            zero._reassign_or_swap_out_partitioned_parameters(sub_group)
        zero.checkpoint_event_epilogue()  # persistent parameters gathered again
    else:
        zero.update_lp_params()
    if "engine0" in sd:
        for key, value in sd["engine0"].items():
            setattr(engine, key, int(value))


def _load_module(module: nn.Module, state: dict[str, Any], trained: set[int], stage: int
                 ) -> None:
    """Copies the checkpoint into the module's own tensors: every parameter (ZeRO-3: only those
    the optimizer does not hold, gathered and re-partitioned) and buffer."""
    params = {id(p): p for p in module.parameters()}
    plain = [p for p in params.values() if stage != 3 or not _held(p, trained)]
    gather: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if stage == 3 and plain:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(plain, modifier_rank=0)
    copy = {id(p) for p in plain}
    with gather, torch.no_grad():
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in copy and name in state:
                p.data.copy_(state[name].reshape(p.shape))
        for name, b in module.named_buffers():
            if name in state:
                b.copy_(state[name])


def _load_optimizer(zero: Any, module: nn.Module, groups: list[list[str]],
                    saved: dict[str, dict[str, Any]], trained: set[int]) -> None:
    inner = zero.optimizer
    params = dict(module.named_parameters())
    flats = _flats(zero)
    keys_of: dict[int, set[str]] = {}
    for index, names in enumerate(groups):
        states = [saved[n] for n in names if n in saved and _held(params[n], trained)]
        for flat in flats.get(index, []):
            if not states:  # the saving run never stepped these: no state here either
                inner.state.pop(flat, None)
                continue
            flat_state = inner.state[flat]
            for key, value in states[0].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    flat_state.setdefault(key, torch.zeros_like(flat)).zero_()
                else:
                    flat_state[key] = value.clone() if torch.is_tensor(value) else value
        if states:
            keys_of[index] = {k for k, v in states[0].items()
                              if torch.is_tensor(v) and v.dim() > 0}
    _relink(zero)
    for index, names in enumerate(groups):
        for name in names:
            p = params[name]
            if index not in keys_of or not _held(p, trained):
                continue
            for key in sorted(keys_of[index]):  # the same order on every rank: collectives
                value = saved.get(name, {}).get(key)
                full = torch.zeros(_shape(p)) if value is None else value
                _set_full(zero, p, full, key)


def _set_full(zero: Any, p: nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """This rank's part of ``value`` into the fp32 master (``key`` None) or optimizer state of
    ``p``. ZeRO 1/2: ``safe_set_full_*``. ZeRO-3 writes its partition itself: DeepSpeed 0.19.8's
    ``set_full_hp_param`` asserts the unpadded size and then slices the padded partition out
    of it, so a parameter whose size does not divide by the ranks fails on the last rank."""
    value = value.detach().to(torch.float32).flatten()
    if not hasattr(p, "ds_id"):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if key is None:
            safe_set_full_fp32_param(p, value.reshape(p.shape))
        else:
            safe_set_full_optimizer_state(p, value.reshape(p.shape), key)
        return
    part, _ = zero._get_fp32_opt_state_partition(p, release_swap_buffers=False,
                                                 optim_state_key=key)
    part = part.data  # a view of the flat master, a leaf that requires grad
    start = part.numel() * zero._get_param_partition_rank(p)
    chunk = value[start:start + part.numel()]
    part.zero_()  # the padding past the parameter's end stays zero, as DeepSpeed keeps it
    part[:chunk.numel()].copy_(chunk)


def _check_groups(directory: str, saved: list[dict[str, Any]], groups: list[list[str]],
                  strict: bool) -> None:
    if len(saved) != len(groups):
        raise CheckpointError(
            f"{directory} holds an optimizer with {len(saved)} param group(s), this run's has "
            f"{len(groups)}; build the optimizer with the groups it was saved with"
        )
    for index, (group, names) in enumerate(zip(saved, groups, strict=True)):
        if strict and list(group.get("params", names)) != names:
            raise CheckpointError(
                f"{directory}: param group {index} holds {list(group['params'])[:4]} in the "
                f"checkpoint, {names[:4]} in this run; load it into the optimizer it was "
                "saved from, or pass strict=False"
            )


def _unflatten_optim(flat: dict[str, Any]) -> tuple[list[dict[str, Any]],
                                                      dict[str, dict[str, Any]]]:
    """DCP's flat ``optim0`` entries (``state.<fqn>.<key>``, ``param_groups.<g>.<key>``) as
    torch's lists and dicts."""
    groups: dict[int, dict[str, Any]] = {}
    states: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        head, rest = key.split(".", 1)
        if head == "param_groups":
            index, name = rest.split(".", 1)
            groups.setdefault(int(index), {})[name] = value
        elif head == "state":
            fqn, name = rest.rsplit(".", 1)
            states.setdefault(fqn, {})[name] = value
    return [groups[i] for i in sorted(groups)], states


def _template(md: Any) -> Any:
    size = getattr(md, "size", None)
    if size is None:
        return None  # a non-tensor entry: DCP replaces it with the saved value
    return torch.empty(size, dtype=md.properties.dtype)


# -- DeepSpeed's flat groups -----------------------------------------------------------------------
def _flats(zero: Any) -> dict[int, list[torch.Tensor]]:
    """The flat fp32 partitions the inner optimizer steps, by the user's param group."""
    out: dict[int, list[torch.Tensor]] = {}
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3: sub-groups
        for sub, flat in enumerate(zero.fp32_partitioned_groups_flat):
            out.setdefault(zero.sub_group_to_group_id[sub], []).append(flat)
        return out
    flats = getattr(zero, "single_partition_of_fp32_groups", None)  # ZeRO 1/2
    if flats is None:
        flats = zero.fp32_groups_flat_partition  # BF16_Optimizer (stage 1, bf16)
    return {index: [flat] for index, flat in enumerate(flats)}


def _flat_group_states(zero: Any) -> dict[int, tuple[dict[str, Any], list[str]]]:
    """Per user param group with state: (its scalar entries, its flat tensor keys)."""
    out = {}
    for index, flats in _flats(zero).items():
        flat = next((f for f in flats if zero.optimizer.state.get(f)), None)
        if flat is None:
            continue
        entries = zero.optimizer.state[flat]
        keys = sorted(k for k, v in entries.items()
                      if torch.is_tensor(v) and v.shape == flat.shape and v.dim() > 0)
        out[index] = ({k: v for k, v in entries.items() if k not in keys}, keys)
    return out


def _relink(zero: Any) -> None:
    """Points ZeRO 1/2's per-parameter fragments at the inner optimizer's current state tensors.

    DeepSpeed links them once, after its first step; a load replaces or removes the tensors
    (and torch's ``state.clear()`` of an un-stepped optimizer drops them). Groups without state
    stay unlinked, and DeepSpeed links everything again after its next step.
    """
    lp_groups = getattr(zero, "bit16_groups", None) or getattr(zero, "bf16_groups", None)
    if lp_groups is None:
        return  # ZeRO-3 reads the inner optimizer's state directly
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for index, flats in _flats(zero).items():
        if zero.optimizer.state.get(flats[0]):
            lazy_init_hp_params_optimizer_state(lp_groups[index], flats[0], zero.optimizer.state)
    zero._hp_optimizer_states_linked = False


def _held(p: nn.Parameter, trained: set[int]) -> bool:
    return p.requires_grad and id(p) in trained


def _shape(p: nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _names(module: nn.Module) -> dict[nn.Parameter, list[str]]:
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return names


# -- the fp16 loss scale ---------------------------------------------------------------------------
def scaler_state(scaler: Any) -> dict[str, Any]:
    """DeepSpeed's ``DynamicLossScaler`` as ``DynamicLossScale.state_dict()``."""
    return {"scale": float(scaler.cur_scale),
            "clean_steps": int(scaler.cur_iter - scaler.last_overflow_iter - 1),
            "budget": int(scaler.cur_hysteresis)}


def load_scaler_state(scaler: Any, state: dict[str, Any]) -> None:
    """``DynamicLossScale.state_dict()`` into DeepSpeed's ``DynamicLossScaler``."""
    scaler.cur_scale = float(state["scale"])
    scaler.last_overflow_iter = scaler.cur_iter - int(state["clean_steps"]) - 1
    scaler.cur_hysteresis = int(state["budget"])
