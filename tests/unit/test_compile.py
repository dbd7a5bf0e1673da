"""torch.compile under accumix on one process: really compiled (dynamo's counters), no
recompilation across sync toggles, the short last window and autocast, equal to eager, clean
unwrap and keys, checkpoints across eager/compiled, errors in one line. Dynamo's ``eager``
backend keeps this cheap: its frame and graph counters are the ones inductor would show."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

import accumix as ax
from accumix.recipes.default import TrainConfig
from accumix.trainer.config import from_dict, parse_overrides
from tests import compile_workloads as cw
from tests import workloads as w


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_single_compiles_once_and_equals_eager(precision: str) -> None:
    eager = cw.train(strategy="single", how="eager", precision=precision)
    assert eager["frames_end"] == 0
    for how in ("wrapped", "flag"):
        got = cw.check(cw.train(strategy="single", how=how, precision=precision), eager)
        assert got["diff"] <= 1e-6, (how, got)
        assert got["frames"] >= 1 and got["graphs"] >= 1, (how, got)
        assert got["recompiles"] == 0, (how, got)  # 4 windows of 3, 3, 3, 1 micro-steps
        assert got["steps"] == (4, 4)
        assert got["keys_clean"] and got["unwrap_is_user"], (how, got)


def test_compile_false_runs_a_compiled_model_eagerly() -> None:
    cw.reset_dynamo()
    user = cw.BlockNet()
    acc = ax.Accelerator(strategy="single", precision="fp32", compile=False)
    model = acc.setup(torch.compile(user, backend="eager"))
    model(torch.randn(4, 6)).sum().backward()
    assert model is user and acc.unwrap(model) is user
    assert cw.frames() == 0
    assert not any("_orig_mod" in k for k in acc.unwrap(model).state_dict())


def test_unwrap_of_the_users_compiled_module_is_the_users_module() -> None:
    user = cw.BlockNet()
    compiled = torch.compile(user, backend="eager")
    acc = ax.Accelerator(strategy="single", precision="fp32")
    model = acc.setup(compiled)
    assert acc.unwrap(compiled) is user and acc.unwrap(model) is user
    assert sorted(model.state_dict()) == sorted(cw.BlockNet().state_dict())


def _failing_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
    raise RuntimeError("no C++ compiler found\n(second line of the details)")


def test_a_compile_failure_is_one_line_and_never_silent() -> None:
    cw.reset_dynamo()
    acc = ax.Accelerator(strategy="single", precision="fp32",
                         compile={"backend": _failing_backend})
    model = acc.setup(cw.BlockNet())
    with pytest.raises(ax.CompileError) as info:
        model(torch.randn(4, 6))
    assert str(info.value) == ("torch.compile failed on BlockNet: BackendCompilerFailed "
                               "(RuntimeError: no C++ compiler found); pass compile=False to "
                               "train without it")
    assert isinstance(info.value, ax.ConfigError)  # the CLI prints it as one line, exit 2


def test_the_users_own_error_is_not_called_a_compile_failure() -> None:
    acc = ax.Accelerator(strategy="single", precision="fp32", compile={"backend": "eager"})
    model = acc.setup(cw.BlockNet())
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="same reduction dim"):
        model(torch.randn(4, 5))  # 5 features for a Linear(6, ...): eager raises it too


@pytest.mark.parametrize(("setting", "message"), [
    ("yes", "compile='yes' is invalid; use True, False or a dict of torch.compile keyword"),
    ({"mood": "fast"}, "compile={'mood': 'fast'} has unknown key(s) ['mood']; use "
                       "torch.compile's: fullgraph, dynamic, backend, mode, options, disable"),
])
def test_bad_compile_settings_name_what_works(setting: object, message: str) -> None:
    with pytest.raises(ax.ConfigError) as info:
        ax.Accelerator(strategy="single", compile=setting)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_compiled_model_and_compile_options_together_is_an_error() -> None:
    acc = ax.Accelerator(strategy="single", precision="fp32", compile={"mode": "max-autotune"})
    with pytest.raises(ax.ConfigError, match="came torch.compile'd and Accelerator"):
        acc.setup(torch.compile(cw.BlockNet(), backend="eager"))


def _run(run_dir: Path, *, compiled: bool, save_after: int | None, resume: bool
         ) -> tuple[list[torch.Tensor], int]:
    """One epoch of 10 micro-batches, K=3; saves after window ``save_after`` or resumes."""
    cw.reset_dynamo()
    user = cw.BlockNet()
    model: nn.Module = torch.compile(user, backend="eager") if compiled else user
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=cw.K)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(w.regression_data(40), batch_size=cw.MICRO_BATCH, shuffle=True)
    model, opt, loader = acc.setup(model, opt, loader)
    if resume:
        acc.load_state(run_dir)
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            opt.step()
            opt.zero_grad()
        if acc.sync_gradients and acc.optimizer_steps == save_after:
            acc.save_state(run_dir)
            acc.save_model(run_dir)
    return [p.detach().clone() for p in acc.unwrap(model).parameters()], cw.frames()


@pytest.mark.parametrize("saver_compiled", [True, False], ids=["compiled-to-eager",
                                                               "eager-to-compiled"])
def test_resume_across_eager_and_compiled(tmp_path: Path, saver_compiled: bool) -> None:
    straight, frames = _run(tmp_path, compiled=saver_compiled, save_after=2, resume=False)
    assert (frames > 0) == saver_compiled
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == set(cw.BlockNet().state_dict())  # no _orig_mod.
    resumed, frames = _run(tmp_path, compiled=not saver_compiled, save_after=None, resume=True)
    assert (frames > 0) != saver_compiled
    assert w.max_diff(resumed, straight) <= 1e-6


def test_recipe_and_cli_take_compile() -> None:
    assert from_dict(TrainConfig, parse_overrides(["compile=true"])).compile is True
    assert TrainConfig().compile is False
    with pytest.raises(ax.ConfigError, match="compile='fast' is invalid; use true/false"):
        from_dict(TrainConfig, parse_overrides(["compile=fast"]))
