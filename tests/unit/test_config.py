"""YAML configs into dataclasses: overrides, unknown keys and bad values, through the CLI too."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from accumix.cli.main import main
from accumix.errors import ConfigError
from accumix.recipes.default import TrainConfig
from accumix.trainer.config import from_dict, load_config, parse_overrides, to_dict


@dataclass(kw_only=True, frozen=True, slots=True)
class Inner:
    width: int = 8
    ratio: float = 0.5


@dataclass(kw_only=True, frozen=True, slots=True)
class Outer:
    name: str = "x"
    steps: int | None = 10
    mode: Literal["a", "b"] = "a"
    betas: tuple[float, float] = (0.9, 0.95)
    flag: bool = False
    inner: Inner = field(default_factory=Inner)


def test_overrides_are_typed_and_nested() -> None:
    cfg = from_dict(Outer, parse_overrides(
        ["steps=null", "mode=b", "betas=[0.8, 0.99]", "flag=true", "inner.ratio=1e-3",
         "name=123", "inner.width=4"]))
    assert cfg == Outer(steps=None, mode="b", betas=(0.8, 0.99), flag=True, name="123",
                        inner=Inner(width=4, ratio=0.001))
    # A nested mapping keeps the defaults of the keys it leaves out.
    assert from_dict(Outer, {"inner": {"width": 2}}).inner == Inner(width=2, ratio=0.5)


@pytest.mark.parametrize(("overrides", "message"), [
    (["stepz=3"], "unknown key stepz at the top level; valid keys: name, steps, mode, betas, "
                  "flag, inner"),
    (["inner.depth=3"], "unknown key inner.depth in inner; valid keys: width, ratio"),
    (["steps=ten"], "steps='ten' is invalid; use an integer or null"),
    (["steps=2.5"], "steps=2.5 is invalid; use an integer or null"),
    (["mode=c"], "mode='c' is invalid; use one of a, b"),
    (["flag=maybe"], "flag='maybe' is invalid; use true/false"),
    (["betas=[1]"], "betas=[1] is invalid; use a list [a number, a number]"),
    (["inner=3"], "inner must be a mapping of width, ratio"),
    (["steps"], "override 'steps' is invalid; write key=value"),
])
def test_unknown_keys_and_bad_values_name_what_works(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(Outer, parse_overrides(overrides))
    assert str(info.value).startswith(message)


def test_yaml_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("max_steps: 7\nmodel:\n  n_layer: 2\noptimizer:\n  lr: 3.0e-4\n")
    cfg = load_config(TrainConfig, path, ["model.n_layer=3", "output_dir=out"])
    assert (cfg.max_steps, cfg.model.n_layer, cfg.model.n_embd, cfg.optimizer.lr) == (
        7, 3, 256, 3e-4)
    assert cfg.run_dir == Path("out") and TrainConfig().run_dir == Path("runs/gpt-stdlib")
    # The printed config reads back to the same config.
    dumped = tmp_path / "dumped.yaml"
    import yaml

    dumped.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(TrainConfig, dumped) == cfg
    (tmp_path / "bad.yaml").write_text("max_steps: [1\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line 2"):
        load_config(TrainConfig, tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(TrainConfig, tmp_path / "list.yaml")


def test_recipe_checks_its_own_values() -> None:
    for overrides, message in [
        (["precision=fp8"], "precision='fp8' is invalid; use one of fp32, bf16-mixed"),
        (["strategy=zero9"], "strategy='zero9' is invalid; use one of auto, single, ddp"),
        (["model.n_head=3"], "model: GPTConfig.n_embd (256) must be divisible by n_head (3)"),
        (["max_steps=null"], "max_steps and max_epochs are both null"),
        (["nproc=0"], "nproc=0 is invalid"),
        (["optimizer.decay=step"], "optimizer.decay='step' is invalid; use one of cosine"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(TrainConfig, None, overrides)


def test_cli_config_errors_exit_2_with_one_line(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # Through a real process: the exit status, one stderr line, no traceback.
    for args, message in [
        (["train", "max_stepz=5"], "accumix train: error: unknown key max_stepz at the top "
                                   "level; valid keys: name, backend, init_from, "
                                   "output_dir, nproc"),
        (["train", "model.n_layer=two"], "accumix train: error: model.n_layer='two' is "
                                         "invalid; use an integer"),
    ]:
        done = subprocess.run([sys.executable, "-m", "accumix.cli.main", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stdout == "" and done.stderr.count("\n") == 1
        assert done.stderr.startswith(message) and "Traceback" not in done.stderr
    # In process, the same path: a missing file, a second positional, the config printed.
    assert main(["train", str(tmp_path / "none.yaml")]) == 2
    assert main(["train", "a.yaml", "b.yaml"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"accumix train: error: config file '{tmp_path / 'none.yaml'}' does not exist",
                   "accumix train: error: unexpected argument 'b.yaml'; give one CONFIG.yaml "
                   "first, then key=value overrides"]
    assert main(["train", "--print-config", "max_steps=9", "model.n_layer=1"]) == 0
    printed = capsys.readouterr().out
    assert "max_steps: 9\n" in printed and "  n_layer: 1\n" in printed


def test_loggers_take_one_word_or_a_comma_list_and_refuse_repeats(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``loggers=mlflow`` said "use [a string, Ellipsis] or null"; ``[csv,csv,mlflow,mlflow]``
    logged every row twice."""
    for given in ("loggers=mlflow", "loggers=[mlflow]", "loggers=csv,mlflow"):
        expected = ("mlflow",) if "csv" not in given else ("csv", "mlflow")
        assert load_config(TrainConfig, None, [given]).loggers == expected
    (tmp_path / "job.yaml").write_text("loggers: mlflow\n")
    assert load_config(TrainConfig, tmp_path / "job.yaml").loggers == ("mlflow",)
    assert main(["train", "loggers=[csv,csv,mlflow,mlflow]", "--print-config"]) == 2
    assert main(["train", "loggers=5", "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "accumix train: error: loggers: logger 'csv' is given twice, which would log every "
        "row twice; list each logger once",
        "accumix train: error: loggers=5 is invalid; use a list of strings, e.g. [x,y] or null"]
    from accumix.trainer.loggers import resolve_loggers

    with pytest.raises(ConfigError, match="logger 'jsonl' is given twice"):
        resolve_loggers(["jsonl", "csv", "jsonl"])
