"""Precision words, the Policy they give, and what "auto" picks."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import accumix as ax
from accumix.precision import policy as policy_mod
from accumix.precision import resolve_policy
from accumix.precision.autocast import autocast_forward, cast_floating

CPU = torch.device("cpu")


@pytest.mark.parametrize("word,param,compute,scaled", [
    ("fp32", torch.float32, torch.float32, False),
    ("bf16-mixed", torch.float32, torch.bfloat16, False),
    ("fp16-mixed", torch.float32, torch.float16, True),
    ("bf16-true", torch.bfloat16, torch.bfloat16, False),
])
def test_words(word, param, compute, scaled) -> None:
    with mock.patch.object(policy_mod, "cpu_has_native_bf16", return_value=True):
        p = resolve_policy(word, CPU) if word != "fp16-mixed" else None
    if p is None:
        with pytest.warns(UserWarning, match="slower"):
            p = resolve_policy(word, CPU)
    assert (p.name, p.param_dtype, p.compute_dtype, p.needs_loss_scaling) == (
        word, param, compute, scaled)
    assert p.autocast == (word.endswith("-mixed"))


def test_unknown_word_lists_valid_ones() -> None:
    with pytest.raises(ax.ConfigError, match="fp32, bf16-mixed, fp16-mixed, bf16-true, auto"):
        resolve_policy("bf16", CPU)


@pytest.mark.parametrize("native,expected", [(True, "bf16-mixed"), (False, "fp32")])
def test_auto_on_cpu(native, expected) -> None:
    with mock.patch.object(policy_mod, "cpu_has_native_bf16", return_value=native):
        assert resolve_policy("auto", CPU).name == expected


@pytest.mark.parametrize("major,expected", [(9, "bf16-mixed"), (8, "bf16-mixed"),
                                            (7, "fp16-mixed")])
def test_auto_on_cuda(major, expected) -> None:
    with mock.patch("torch.cuda.get_device_capability", return_value=(major, 0)), \
         mock.patch("torch.cuda.get_device_name", return_value="FakeGPU"):
        assert resolve_policy("auto", torch.device("cuda", 0)).name == expected


def test_bf16_on_gpu_without_it_is_a_config_error() -> None:
    with mock.patch("torch.cuda.get_device_capability", return_value=(7, 0)), \
         mock.patch("torch.cuda.get_device_name", return_value="Tesla V100"), \
         pytest.raises(ax.ConfigError, match="V100 lacks; use precision='fp16-mixed'"):
        resolve_policy("bf16-mixed", torch.device("cuda", 0))


def test_cpu_flag_override(monkeypatch) -> None:
    policy_mod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setenv("ACCUMIX_CPU_BF16", "0")
    assert policy_mod.cpu_has_native_bf16() is False
    policy_mod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setenv("ACCUMIX_CPU_BF16", "1")
    assert policy_mod.cpu_has_native_bf16() is True
    policy_mod.cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize(("flags", "machine", "native"), [
    ("fpu sse2 avx avx2 fma", "x86_64", False),        # this suite's machine: AVX2, no bf16
    ("avx512f avx512_bf16 avx512_vnni", "x86_64", True),  # AMD Zen 4, Intel Cooper Lake
    ("avx512f amx_bf16 amx_tile", "x86_64", True),     # Intel Sapphire Rapids
    ("fp asimd sve bf16 i8mm", "aarch64", True),       # Arm (Neoverse V1, Graviton 3)
    (None, "arm64", True),                             # no /proc/cpuinfo: Apple silicon
    (None, "x86_64", False),                           # no /proc/cpuinfo elsewhere
])
def test_the_cpu_bf16_probe_gives_both_answers(monkeypatch, flags, machine, native) -> None:
    """The probe itself on faked CPUs (issue 38: nothing in the suite may hold only on the
    CPU it runs on); then both answers' consequences on the torch side: "auto" and the
    "emulated" warning (tests/conftest.py pins the answer for every other test)."""
    import io
    import warnings

    from accumix.precision import words

    def fake_open(path, *args, **kwargs):
        if flags is None:
            raise FileNotFoundError(path)
        return io.StringIO(f"processor\t: 0\nflags\t\t: {flags}\n")

    monkeypatch.delenv("ACCUMIX_CPU_BF16")
    monkeypatch.setattr(words, "open", fake_open, raising=False)
    monkeypatch.setattr(words.platform, "machine", lambda: machine)
    words.cpu_has_native_bf16.cache_clear()
    try:
        assert words.cpu_has_native_bf16() is native
        assert resolve_policy("auto", CPU).name == ("bf16-mixed" if native else "fp32")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            resolve_policy("bf16-mixed", CPU)
        assert ["emulated" in str(w.message) for w in said] == ([] if native else [True])
    finally:
        words.cpu_has_native_bf16.cache_clear()


def test_autocast_forward_computes_in_bf16_returns_fp32() -> None:
    policy = ax.Policy(name="custom", compute_dtype=torch.bfloat16)
    model = autocast_forward(torch.nn.Sequential(torch.nn.Linear(4, 3)), policy, CPU)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.ones(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert list(model.state_dict()) == ["0.weight", "0.bias"]
    assert autocast_forward(model, policy, CPU) is model  # a second call is a no-op


def test_output_dtype_none_keeps_half_outputs() -> None:
    policy = ax.Policy(name="raw", compute_dtype=torch.bfloat16, output_dtype=None)
    model = autocast_forward(torch.nn.Linear(4, 3), policy, CPU)
    assert model(torch.ones(2, 4)).dtype == torch.bfloat16


def test_cast_floating_nested() -> None:
    h = torch.ones(2, dtype=torch.bfloat16)
    out = cast_floating({"a": (h, [h]), "b": torch.ones(2, dtype=torch.long)}, torch.float32)
    assert out["a"][0].dtype == torch.float32 and out["a"][1][0].dtype == torch.float32
    assert out["b"].dtype == torch.long
    d = torch.ones(2, dtype=torch.float64)
    assert cast_floating([d, h], torch.float32, only=(torch.bfloat16,))[0].dtype == torch.float64
