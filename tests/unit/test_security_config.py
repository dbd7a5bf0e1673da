"""Issue 45, case 7: recipe and CLI values that crashed with a traceback or spun are one line
and exit 2, before any process starts (``--print-config`` reads the config as a run does)."""

from __future__ import annotations

from pathlib import Path

import pytest

from accumix.cli.main import main
from accumix.recipes.gpt import GPT, GPTConfig


def _error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert main(args) == 2, args
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    return captured.err


@pytest.mark.parametrize(("override", "message"), [
    # Before: ValueError tracebacks from AdamW on every rank (exit 1).
    ("optimizer.lr=.nan", "optimizer.lr=nan is invalid; use a finite number"),
    ("optimizer.lr=-1", "optimizer.lr=-1.0 is invalid; use a number >= 0"),
    ("optimizer.betas=[0.9,.nan]", "optimizer.betas=nan is invalid; use a finite number"),
    ("optimizer.betas=[0.9,1.5]", "optimizer.betas=[0.9, 1.5] is invalid; use two numbers in"),
    ("grad_clip=.inf", "grad_clip=inf is invalid; use a finite number"),
    ("sample.top_k=0", "sample.top_k=0 is invalid"),
    # Before: the allocator's failure (the position table, 1e13 x 256 floats) as a traceback.
    ("model.block_size=10000000000000", "model: GPTConfig gives 2.56e+15 parameters, more "
                                        "than 1e+15"),
    # Before: built blocks until killed (accumix estimate-memory too, on the meta device).
    ("model.n_layer=100000000000000000000000", "model: GPTConfig.n_layer must be <= 10,000"),
])
def test_bad_recipe_values_are_one_line(override: str, message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["train", override, "--print-config"])
    assert message in err, err


def test_init_from_must_be_a_safetensors_file(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``SafetensorError: Error while deserializing header`` on every rank."""
    text = tmp_path / "notes.txt"
    text.write_text("not weights\n")
    err = _error(capsys, ["train", f"init_from={text}", "--print-config"])
    assert f"init_from='{text}' is not a safetensors file" in err
    err = _error(capsys, ["train", f"init_from={tmp_path}", "--print-config"])
    assert "is not a file" in err


def test_nproc_is_bounded_by_the_machine_unless_forced(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from accumix.cli.launch import local_cpus

    monkeypatch.delenv("ACCUMIX_OVERSUBSCRIBE", raising=False)
    for name in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    cores = local_cpus()
    err = _error(capsys, ["train", "nproc=100000"])
    assert f"nproc=100000 is more than this machine's {cores} CPU cores" in err
    err = _error(capsys, ["launch", "--nproc", "100000", __file__])
    assert f"nproc=100000 is more than this machine's {cores} CPU cores" in err
    err = _error(capsys, ["launch", "--nproc", "1", "--master-port", "70000", __file__])
    assert "master-port=70000 is invalid; use a port in 1..65535" in err
    # Forced: the next check speaks (the batch does not divide over 100000 ranks).
    monkeypatch.setenv("ACCUMIX_OVERSUBSCRIBE", "1")
    err = _error(capsys, ["train", "nproc=100000"])
    assert "data-parallel world size 100000" in err


def test_a_model_larger_than_the_host_is_refused_before_it_is_built(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``RuntimeError: DefaultCPUAllocator: can't allocate memory`` (a traceback, exit
    1) for a GPT whose position table alone exceeds the host (here 1e10 x 32 floats)."""
    from accumix.common.hardware import host_memory_bytes

    memory = host_memory_bytes()
    assert memory is not None and memory < 4 * 10**10 * 32  # 1.28 TB
    err = _error(capsys, ["train", "nproc=1", "model.block_size=10000000000", "model.n_embd=32",
                          "model.n_head=2", "model.n_layer=1"])
    assert "model.* gives a GPT of 3.2e+11 parameters (1.19e+03 GiB in float32" in err
    assert "more than this machine's memory" in err
    # What held: the config itself takes such a model (`accumix estimate-memory` reads it to
    # size models this host cannot hold: 412 GB of float32 here).
    from accumix.cli.train import load_train_config

    config = load_train_config(["model.n_layer=2", "model.n_embd=65536", "model.n_head=64"])
    e = 65536  # tables, 2 blocks (12 E^2 weights, 13 E norms and biases), the final norm
    assert config.model.num_parameters() == (256 + 128) * e + 2 * (12 * e * e + 13 * e) + 2 * e


def test_the_model_size_check_counts_what_the_gpt_holds() -> None:
    from accumix.recipes.config_checks import check_model_fits

    for config in (GPTConfig(n_layer=2, n_embd=48, n_head=3, block_size=17),
                   GPTConfig(n_layer=1, n_embd=32, n_head=2, bias=False, tie_weights=False)):
        assert config.num_parameters() == GPT(config).num_parameters(non_embedding=False)
    config = GPTConfig(n_layer=2, n_embd=48, n_head=3, block_size=17)
    check_model_fits(config, memory=4 * config.num_parameters())  # exactly fits
    with pytest.raises(Exception, match="more than this machine's memory"):
        check_model_fits(config, memory=4 * config.num_parameters() - 1)
