"""Issue 33 on 2 ranks (gloo): what gradients travel in, on every torch strategy.

* the default reduction is the code's before ``reduce_dtype`` (``tests/golden``: recorded on
  another machine, so within float rounding);
* a bf16 reduction moves exactly half of float32's gradient bytes per optimizer step, counted
  per collective, and says so in ``acc.effective_dtypes``;
* its result equals plain PyTorch that sums each rank's window in float32 and casts once for
  the reduction (``tests/reduce_jobs.py``), bit for bit: K micro-steps round once (fsdp's
  ``sync_each_microstep`` and ZeRO-2 K times, as they state);
* an fp16 reduction that overflows on one rank skips the step on both;
* the edges: a parameter outside the model, two models (one unused on the boundary micro-step),
  two backward calls through one synced forward (a GAN's discriminator), K=1 and K=16,
  bf16-mixed with a bf16 reduction, resume.

Every check runs in the 2-rank spawn the distributed tests share (``shared_spawn``).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import accumix as ax
from accumix.testing import CollectiveLog
from tests import reduce_jobs as rj
from tests.distributed.shared_spawn import shared_result
from tests.golden import matches_golden
from tests.golden.pre_reduce33 import make as golden

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
GOLDEN = Path(golden.__file__).parent / "weights.safetensors"
BF16, FP32 = torch.bfloat16, torch.float32
WINDOWS, ACCUM = 3, 2


def _strategy(word: str) -> Any:
    return golden.strategy_of(word)


# -- the default is unchanged ---------------------------------------------------------------
def _golden() -> dict[str, bool]:
    from safetensors.torch import load_file

    expected = load_file(str(GOLDEN))
    out = {}
    for case, (word, precision) in golden.CASES.items():
        if word.startswith("deepspeed") and not HAS_DEEPSPEED:
            continue
        _, state = golden.train(_strategy(word), precision)
        if state:  # rank 0 holds the full state dict
            # Recorded on another machine: within its precision's rounding (tests/golden).
            out[case] = all(matches_golden(expected[f"{case}/{k}"], v, precision)
                            for k, v in state.items())
    return out


# -- bytes per optimizer step ------------------------------------------------------------------
BYTES_STRATEGIES = ("ddp", "zero1", "fsdp", "fsdp_sync", "deepspeed1", "deepspeed2",
                    "deepspeed3")


def _visible_ddp(model: nn.Module) -> None:
    # DDP's C++ all-reduce is invisible to CollectiveLog; torch's allreduce_hook is the same
    # reduction through dist.all_reduce (its documentation: results unchanged).
    if hasattr(model, "register_comm_hook"):
        model.register_comm_hook(None, allreduce_hook)


def _bytes() -> dict[str, Any]:
    out = {}
    for word in BYTES_STRATEGIES:
        if word.startswith("deepspeed") and not HAS_DEEPSPEED:
            continue
        for reduce_dtype in (None, "bf16"):
            log = CollectiveLog()
            hook = _visible_ddp if reduce_dtype is None else None
            acc, _, _ = rj.run(_strategy(word), windows=WINDOWS, accum=ACCUM,
                               reduce_dtype=reduce_dtype, log=log, hook=hook)
            nbytes, dtypes = rj.gradient_bytes(log)
            out[f"{word}-{reduce_dtype}"] = {"per_step": nbytes / WINDOWS, "dtypes": dtypes,
                                             "line": acc.effective_dtypes.describe()}
            acc.end()
    return out


# -- equal to plain PyTorch --------------------------------------------------------------------
# name -> (strategy, precision, Accelerator reduce_dtype, reference wire, reference autocast,
# a parameter outside the model, reduced every micro-step)
_TEMP = (1.5,)
EXACT = {
    "ddp": ("ddp", "fp32", "bf16", BF16, None, (), False),
    "zero1": ("zero1", "fp32", "bf16", BF16, None, (), False),
    # FSDPStrategy(reduce_dtype=) predates issue 33: before it, FSDP2 summed the window in bf16.
    "fsdp-strategy-arg": ("fsdp-bf16", "fp32", None, BF16, None, (), False),
    "fsdp": ("fsdp", "fp32", "bf16", BF16, None, (), False),
    "fsdp_sync": ("fsdp_sync", "fp32", "bf16", BF16, None, (), True),
    "ddp-bf16-mixed": ("ddp", "bf16-mixed", "bf16", BF16, BF16, (), False),
    "fsdp-bf16-mixed": ("fsdp", "bf16-mixed", "bf16", BF16, BF16, (), False),
    "ddp-outside": ("ddp", "fp32", None, FP32, None, _TEMP, False),
    "ddp-outside-bf16": ("ddp", "fp32", "bf16", BF16, None, _TEMP, False),
    "zero1-outside-bf16": ("zero1", "fp32", "bf16", BF16, None, _TEMP, False),
    "deepspeed1": ("deepspeed1", "fp32", "bf16", BF16, None, (), False),
    "deepspeed2": ("deepspeed2", "fp32", "bf16", BF16, None, (), True),
}


def _exact() -> dict[str, float]:
    model, out = golden.make_model(), {}
    for name, (word, precision, reduce_dtype, wire, autocast, temp, each) in EXACT.items():
        if word.startswith("deepspeed") and not HAS_DEEPSPEED:
            continue
        strategy = ax.FSDPStrategy(reduce_dtype=BF16) if word == "fsdp-bf16" else _strategy(
            word)
        extra = [nn.Parameter(torch.tensor(t)) for t in temp]
        acc, _, got = rj.run(strategy, windows=WINDOWS, accum=ACCUM, reduce_dtype=reduce_dtype,
                             precision=precision, model=model, extra=extra)
        ref = rj.reference(model, windows=WINDOWS, accum=ACCUM, wire=wire, autocast=autocast,
                           extra=extra, every_micro_step=each)
        out[name] = rj.max_diff(got, ref)
        acc.end()
    return out


# -- an fp16 reduction that overflows on one rank ------------------------------------------------
def _poke_window_sum(acc: ax.Accelerator, model: nn.Module) -> None:
    """Rank 1's window sum beyond fp16's range (1e6, finite in float32) on one element: where
    ddp keeps the window (``param.grad``) or FSDP2 does (its float32 accumulator)."""
    if acc.rank != 1:
        return
    first = next(acc.unwrap(model).parameters())
    if isinstance(first.grad, torch.Tensor) and not hasattr(first.grad, "to_local"):
        first.grad.view(-1)[0] = 1e6
        return
    for unit in acc.unwrap(model).modules():
        state = getattr(unit, "_get_fsdp_state", None)
        for group in state()._fsdp_param_groups if state else ():
            for fsdp_param in group.fsdp_params:
                if fsdp_param.unsharded_accumulated_grad is not None:
                    fsdp_param.unsharded_accumulated_grad.view(-1)[0] = 1e6
                    return


def _overflow(word: str, reduce_dtype: str) -> dict[str, Any]:
    """fp16-mixed, K=2, 4 windows; rank 1's window 1 overflows the fp16 wire."""
    acc = ax.Accelerator(strategy=_strategy(word), precision="fp16-mixed", grad_accum_steps=2,
                         reduce_dtype=reduce_dtype,
                         loss_scale=ax.DynamicLossScale(init_scale=16.0, hysteresis=1))
    model = golden.make_model()
    # A small rate: the control (float32 on the wire) applies the poked gradient and must
    # not blow the model up for the windows after it.
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    model, opt = acc.setup(model, opt)
    skipped = []
    for window in range(4):
        for micro in range(2):
            with acc.accumulate():
                acc.backward(rj.mse(model, rj.batch(acc.rank, window, micro)))
                if window == 1 and micro == 0:
                    _poke_window_sum(acc, model)
                opt.step()
                opt.zero_grad()
        skipped.append(acc.step_was_skipped)
    out = {"skipped": skipped, "steps": acc.optimizer_steps, "scale": acc.loss_scale}
    acc.end()
    return out


# -- two models, the second unused on the boundary micro-step ---------------------------------
def _two_models() -> float:
    """ddp, bf16 reduction: model b's window is reduced by accumix itself at the boundary
    (``reduce_deferred_grads``), in bf16 too."""
    a, b = golden.make_model(), nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    refs = [copy.deepcopy(a), copy.deepcopy(b)]
    acc = ax.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=ACCUM,
                         reduce_dtype="bf16")
    opt_a = torch.optim.SGD(a.parameters(), lr=rj.LR)
    opt_b = torch.optim.SGD(b.parameters(), lr=rj.LR)
    ma, oa, mb, ob = acc.setup(a, opt_a, b, opt_b)
    for window in range(WINDOWS):
        for micro in range(ACCUM):
            with acc.accumulate():
                loss = rj.mse(ma, rj.batch(acc.rank, window, micro))
                if micro == 0:
                    loss = loss + rj.mse(mb, rj.batch(acc.rank, window, micro + 7))
                acc.backward(loss)
                oa.step()
                ob.step()
                oa.zero_grad()
                ob.zero_grad()
    got = rj.full_params(acc, ma) + rj.full_params(acc, mb)
    acc.end()
    # Plain PyTorch: each rank's window (b: its first micro-step only), reduced in bf16.
    ref_opts = [torch.optim.SGD(m.parameters(), lr=rj.LR) for m in refs]
    params = [p for m in refs for p in m.parameters()]
    for window in range(WINDOWS):
        per_rank = []
        for rank in range(rj.WORLD):
            for p in params:
                p.grad = None
            for micro in range(ACCUM):
                loss = rj.mse(refs[0], rj.batch(rank, window, micro))
                if micro == 0:
                    loss = loss + rj.mse(refs[1], rj.batch(rank, window, micro + 7))
                (loss * (1.0 / ACCUM)).backward()
            per_rank.append([p.grad.clone() for p in params])
        for p, grads in zip(params, zip(*per_rank, strict=True), strict=True):
            p.grad = rj.wire_mean(list(grads), BF16)
        for opt in ref_opts:
            opt.step()
    return rj.max_diff(got, [p.detach() for p in params])


# -- two backward calls through one synced forward (a GAN's discriminator) -------------------
def _second_backward(word: str) -> float:
    """bf16 reduction, K=2: on every micro-step the model is forwarded on a "real" and a "fake"
    batch before either backward, then ``acc.backward(real)``, ``acc.backward(fake)``. DDP's
    reducer reduces only the boundary's first backward (in bf16, through the hook); accumix
    reduces the model once more at the boundary (``ddp_reducer_turns``), in bf16 too. Returns
    the largest difference from plain PyTorch doing exactly that (0: bitwise)."""
    model = golden.make_model()
    ref = copy.deepcopy(model)
    acc = ax.Accelerator(strategy=_strategy(word), precision="fp32", grad_accum_steps=ACCUM,
                         reduce_dtype="bf16")
    opt = torch.optim.SGD(model.parameters(), lr=rj.LR, momentum=rj.MOMENTUM)
    model, opt = acc.setup(model, opt)
    for window in range(WINDOWS):
        for micro in range(ACCUM):
            with acc.accumulate():
                real = rj.mse(model, rj.batch(acc.rank, window, micro))
                fake = rj.mse(model, rj.batch(acc.rank, window, micro + 7))
                acc.backward(real)
                acc.backward(fake)
                opt.step()
                opt.zero_grad()
    got = rj.full_params(acc, model)
    acc.end()

    params = list(ref.parameters())
    ref_opt = torch.optim.SGD(params, lr=rj.LR, momentum=rj.MOMENTUM)

    def grads_of(*losses: torch.Tensor) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        for loss in losses:
            (loss * (1.0 / ACCUM)).backward()
        return [p.grad.clone() for p in params]

    for window in range(WINDOWS):
        first, second = [], []  # per rank: the window up to the boundary's first backward; its
        for rank in range(rj.WORLD):  # second backward alone
            losses = [rj.mse(ref, rj.batch(rank, window, m + fake))
                      for m in range(ACCUM) for fake in (0, 7)]
            first.append(grads_of(*losses[:-1]))
            second.append(grads_of(losses[-1]))
        reduced = [rj.wire_mean(list(g), BF16) for g in zip(*first, strict=True)]
        again = [[w + s for w, s in zip(reduced, mine, strict=True)] for mine in second]
        for p, grads in zip(params, zip(*again, strict=True), strict=True):
            p.grad = rj.wire_mean(list(grads), BF16)
        ref_opt.step()
    return rj.max_diff(got, [p.detach() for p in params])


# -- K=1 and K=16 --------------------------------------------------------------------------------
def _k_edges() -> dict[str, float]:
    """bf16 reduction at K=1 (every micro-step a boundary, no ``no_sync``) and K=16 against
    plain PyTorch: bitwise, the window summed in float32 and rounded once."""
    model, out = golden.make_model(), {}
    for word in ("ddp", "fsdp"):
        for accum in (1, 16):
            acc, _, got = rj.run(_strategy(word), windows=2, accum=accum, reduce_dtype="bf16",
                                 model=model)
            acc.end()
            ref = rj.reference(model, windows=2, accum=accum, wire=BF16)
            out[f"{word}-K{accum}"] = rj.max_diff(got, ref)
    return out


# -- resume ------------------------------------------------------------------------------------
def _resume(word: str, run_dir: str) -> bool:
    """bf16 reduction: 4 windows straight, against 2, save, a new Accelerator, load, 2 more."""
    def train(windows: range, load: bool, save: bool) -> list[torch.Tensor]:
        acc = ax.Accelerator(strategy=_strategy(word), precision="fp32", grad_accum_steps=ACCUM,
                             reduce_dtype="bf16")
        model = golden.make_model()
        opt = torch.optim.SGD(model.parameters(), lr=rj.LR, momentum=rj.MOMENTUM)
        model, opt = acc.setup(model, opt)
        if load:
            acc.load_state(run_dir)
        for window in windows:
            for micro in range(ACCUM):
                with acc.accumulate():
                    acc.backward(rj.mse(model, rj.batch(acc.rank, window, micro)))
                    opt.step()
                    opt.zero_grad()
        if save:
            acc.save_state(run_dir)
        params = rj.full_params(acc, model)
        acc.end()
        return params

    straight = train(range(4), load=False, save=False)
    train(range(2), load=False, save=True)
    resumed = train(range(2, 4), load=True, save=False)
    return all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def _all_checks(tmp: str) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")  # fp16 on a CPU, DeepSpeed's chatter
    return {
        "golden": _golden(),
        "bytes": _bytes(),
        "exact": _exact(),
        "overflow": {f"{word}-{r}": _overflow(word, r) for word in ("ddp", "zero1", "fsdp")
                     for r in ("fp16", "fp32")},
        "two_models": _two_models(),
        "second_backward": {word: _second_backward(word) for word in ("ddp", "zero1")},
        "k_edges": _k_edges(),
        "resume": {word: _resume(word, f"{tmp}/{word}") for word in ("ddp", "fsdp")},
    }


def shared_job(root: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's job, run in the spawn it shares with other modules (conftest.py)."""
    return _all_checks, (str(root),)


@pytest.fixture(scope="module")
def results(shared_spawn: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return shared_result(shared_spawn, __name__)


def test_default_reduction_is_the_code_before(results: list[dict[str, Any]]) -> None:
    expected = {c for c, (w, _) in golden.CASES.items()
                if HAS_DEEPSPEED or not w.startswith("deepspeed")}
    assert set(results[0]["golden"]) == expected
    assert all(results[0]["golden"].values()), results[0]["golden"]


def test_bf16_reduction_moves_half_the_gradient_bytes(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        for word in BYTES_STRATEGIES:
            if f"{word}-None" not in res["bytes"]:
                continue
            fp32, bf16 = res["bytes"][f"{word}-None"], res["bytes"][f"{word}-bf16"]
            assert fp32["dtypes"] == ["torch.float32"], (word, rank, fp32)
            assert bf16["dtypes"] == ["torch.bfloat16"], (word, rank, bf16)
            assert fp32["per_step"] > 0 and bf16["per_step"] * 2 == fp32["per_step"], (
                word, rank, fp32, bf16)
            assert "reduction bfloat16" in bf16["line"] and "reduction float32" in fp32["line"]
            assert "gradient accumulation float32" in bf16["line"], bf16["line"]
    lines = results[0]["bytes"]
    # ddp and zero1: each gradient once per optimizer step, 2 bytes each (nothing travels on
    # the off-boundary micro-steps, under DDP's no_sync, through the hook either)
    numel = sum(p.numel() for p in golden.make_model().parameters())
    assert lines["ddp-bf16"]["per_step"] == lines["zero1-bf16"]["per_step"] == 2 * numel
    # Where the reduction runs every micro-step, it says so (and moves K times the bytes).
    assert "every micro-step: sync_each_microstep" in lines["fsdp_sync-bf16"]["line"]
    assert lines["fsdp_sync-bf16"]["per_step"] == ACCUM * lines["fsdp-bf16"]["per_step"]
    assert "once per optimizer step" in lines["ddp-bf16"]["line"]
    if HAS_DEEPSPEED:
        assert "every micro-step: ZeRO stage 2" in lines["deepspeed2-bf16"]["line"]
        assert "once per optimizer step" in lines["deepspeed1-bf16"]["line"]


def test_bf16_reduction_equals_plain_pytorch_rounding_once(results: list[dict[str, Any]]
                                                           ) -> None:
    """Bitwise: the window in float32, one cast for the reduction (every micro-step where the
    mode reduces every micro-step); also with a parameter outside the model (ddp and zero1
    reduce it too) and with bf16-mixed compute."""
    exact = results[0]["exact"]
    assert exact and all(diff == 0.0 for diff in exact.values()), exact


def test_fp16_overflow_on_one_rank_skips_on_both(results: list[dict[str, Any]]) -> None:
    for key in results[0]["overflow"]:
        runs = [res["overflow"][key] for res in results]
        assert runs[0] == runs[1], (key, runs)  # same skips, steps and scale on both ranks
        if key.endswith("fp16"):  # 1e6 / 2 ranks is beyond fp16's 65504: inf on the wire
            assert runs[0]["skipped"] == [False, True, False, False], (key, runs[0])
            assert runs[0]["steps"] == 3 and runs[0]["scale"] == 8.0, (key, runs[0])
        else:  # float32 carries it: no skip (the control)
            assert runs[0]["skipped"] == [False] * 4 and runs[0]["steps"] == 4, (key, runs[0])


def test_two_models_and_resume(results: list[dict[str, Any]]) -> None:
    assert results[0]["two_models"] == 0.0
    for res in results:  # every rank equals the reference: the second backward was reduced
        assert res["second_backward"] == {"ddp": 0.0, "zero1": 0.0}, res["second_backward"]
        assert res["k_edges"] == dict.fromkeys(("ddp-K1", "ddp-K16", "fsdp-K1", "fsdp-K16"),
                                               0.0), res["k_edges"]
    for res in results:
        assert res["resume"] == {"ddp": True, "fsdp": True}, res["resume"]
