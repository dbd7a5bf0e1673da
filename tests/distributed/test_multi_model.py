"""Issue 15 on 2 ranks with ddp (gloo): the GAN orders, two models' own item counts and an LBFGS
closure (on fsdp too) equal plain PyTorch on the gathered batch; fp16 item mode's first window
does not overflow. Issue 20: overlapping optimizers (ddp), a model unused on the boundary
micro-step (reduced once on ddp and zero1, refused on fsdp unless a zero loss reaches it there)
and stepping after the block (ddp). Two forwards then two backward calls through one model in a
micro-step (the GAN's D on real and fake; one model on two batches) on ddp and zero1, K=1 and
K=2 with a short last window, both orders, both modes. One spawned job runs them all."""

from __future__ import annotations

from typing import Any

import accumix as ax
from accumix.testing import spawn
from tests import multi_model as mm
from tests import split_backward_jobs as sj
from tests import window_jobs as wj

TOL = 1e-6


def _ddp_checks() -> dict[str, Any]:
    world = 2
    out: dict[str, Any] = {}
    data = mm.gan_data(steps=3, batch=8)
    for order, items in (("g_first", False), ("d_first", False), ("d_first", True)):
        ref = mm.gan_reference(order, data, world=world, items=items)
        got, _ = mm.gan_accumix(order, data, strategy="ddp", items=items)
        out[f"gan/{order}/{'items' if items else 'mean'}"] = mm.max_diff(ref, got)
    two = mm.two_model_data(windows=2, micro=3, world=world, steps=2)
    out["two_models"] = mm.max_diff(mm.two_models_reference(two, steps=2),
                                    mm.two_models_accumix(two, steps=2, strategy="ddp"))
    ref_params, ref_losses = mm.lbfgs_reference(steps=2)
    params, losses = mm.lbfgs_accumix(steps=2, strategy="ddp")
    out["lbfgs"] = mm.max_diff(ref_params, params)
    out["lbfgs_losses"] = max(abs(a - b) for a, b in zip(ref_losses, losses, strict=True))
    # fsdp (issue 38 case 2): LBFGS kept stepping the plain parameters fsdp replaced, saw a
    # zero gradient and stopped at once (0.35 off after 2 steps); an LBFGS set up after its
    # model is built over the sharded parameters themselves.
    for late in (False, True):
        params, losses = mm.lbfgs_accumix(steps=2, strategy="fsdp", late=late)
        out[f"lbfgs/fsdp/late={late}"] = mm.max_diff(ref_params, params)
        out[f"lbfgs/fsdp/late={late}/losses"] = max(
            abs(a - b) for a, b in zip(ref_losses, losses, strict=True))
    # fp16 item mode's first window (ranks with 64 and 48 items): no step skipped
    out["fp16_items_skipped"] = float(sum(mm.fp16_item_run(items=True, strategy="ddp")[0]))
    out.update(_issue20_checks(world))
    out.update(_split_backward_checks(world))
    return out


def _split_backward_checks(world: int) -> dict[str, Any]:
    """D forwarded on the real and the fake batch, then one backward per half: DDP's reducer
    reduced only the first, the second stayed each rank's own (d_first/K1/items/ddp was 3.3e-2
    off and the ranks apart; one_model 0.15). K=2 on 5 micro-steps: windows of 2, 2 and 1."""
    out: dict[str, Any] = {}
    full, short = sj.split_data(3, world), sj.split_data(5, world)
    for order, data, steps, items, strategy in (
            ("d_first", full, 1, True, "ddp"), ("d_first", short, 2, False, "ddp"),
            ("g_first", full, 1, False, "zero1"), ("g_first", short, 2, True, "zero1")):
        name = f"split/{order}/K{steps}/{'items' if items else 'mean'}/{strategy}"
        ref, ref_steps = sj.split_reference(order, data, steps=steps, items=items, world=world)
        got, taken = sj.split_accumix(order, data, steps=steps, items=items, strategy=strategy)
        out[name], out[f"{name}/steps"] = mm.max_diff(ref, got), float(taken != ref_steps)
    data = sj.one_model_data(5, world)
    for items, strategy in ((True, "ddp"), (False, "zero1")):
        ref, ref_steps = sj.one_model_reference(data, steps=2, items=items, world=world)
        got, taken = sj.one_model_accumix(data, steps=2, items=items, strategy=strategy)
        name = f"split/one_model/K2/{'items' if items else 'mean'}/{strategy}"
        out[name], out[f"{name}/steps"] = mm.max_diff(ref, got), float(taken != ref_steps)
    return out


def _issue20_checks(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    data = wj.overlap_data(world)
    ref_params, ref_norms = wj.overlap_reference(data, steps=2, clip=0.5)
    params, norms = wj.overlap_accumix(data, steps=2, clip=0.5, strategy="ddp")
    out["overlap"] = mm.max_diff(ref_params, params)
    out["overlap_norms"] = max(abs(a - b) for a, b in zip(ref_norms, norms, strict=True))
    alternate = wj.alternate_data(world)
    ref = wj.alternate_reference(alternate)
    for strategy in ("ddp", "zero1"):
        out[f"alternate/{strategy}"] = mm.max_diff(ref, wj.alternate_accumix(alternate, strategy))
    out["alternate/fsdp/zero_loss"] = mm.max_diff(
        ref, wj.alternate_accumix(alternate, "fsdp", zero_loss=True))
    out["refused/fsdp"] = wj.alternate_accumix(alternate, "fsdp")
    out["refused/fsdp_sync_each"] = mm.max_diff(ref, wj.alternate_accumix(
        alternate, ax.FSDPStrategy(sync_each_microstep=True)))
    after = wj.after_block_data(world)
    for items in (False, True):
        params, steps = wj.after_block_accumix(after, items, strategy="ddp")
        out[f"after_block/{items}"] = mm.max_diff(wj.after_block_reference(after, items), params)
        out[f"after_block/{items}/steps"] = float(steps != 3)
    return out


def test_multi_model_steps_on_two_ddp_ranks() -> None:
    results = spawn(_ddp_checks, nprocs=2)
    for rank, result in enumerate(results):
        refused = result.pop("refused/fsdp")
        assert refused.startswith("strategy='fsdp' reduces gradients only inside a backward"), (
            rank, refused)
        bad = {k: v for k, v in result.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
