"""The reference is complete: every public name documented, every CLI flag and train key listed,
every error the troubleshooting page quotes really raised somewhere in the code.

These read the code and the generators (no site build: ``test_site.py`` checks the built pages).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs/hooks/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _generate()


def _own_doc(obj: object) -> str | None:
    return obj.__doc__ if isinstance(obj, property) else inspect.getdoc(obj)


def public_members(cls: type) -> dict[str, object]:
    """The public methods and properties a user reaches on ``cls``: its own and those of its
    accumix bases (``Accelerator`` gets its properties from ``RunView``)."""
    members: dict[str, object] = {}
    for base in reversed(cls.__mro__):
        if not base.__module__.startswith("accumix"):
            continue
        for name, value in vars(base).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                members[name] = value
    return members


def _inherited_doc(cls: type, name: str, value: object) -> str | None:
    """A member's docstring, or the one of the member it overrides (the base documents the
    interface: ``DDPStrategy.setup`` is ``Strategy.setup``)."""
    for base in cls.__mro__:
        candidate = vars(base).get(name)
        if candidate is None:
            continue
        if isinstance(candidate, (staticmethod, classmethod)):
            candidate = candidate.__func__
        if _own_doc(candidate):
            return _own_doc(candidate)
    return None


def undocumented() -> list[str]:
    missing = []
    seen: set[int] = set()
    for module_name, names in generate.public_names().items():
        module = importlib.import_module(module_name)
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or callable(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            if not (obj.__doc__ or "").strip():
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                for member, value in public_members(obj).items():
                    if id(value) not in seen and not _inherited_doc(obj, member, value):
                        missing.append(f"{module_name}.{name}.{member}")
                    seen.add(id(value))  # an inherited member: named once, where first met
    return missing


def test_every_public_name_and_member_has_a_docstring() -> None:
    assert undocumented() == []


def test_the_docstring_check_finds_a_missing_docstring(monkeypatch: pytest.MonkeyPatch) -> None:
    import accumix.trainer.schedules as schedules

    monkeypatch.setattr(schedules.scale_lr, "__doc__", None)
    assert "accumix.scale_lr" in undocumented()


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments):\s*$", re.M)


def test_public_functions_document_each_argument() -> None:
    """A public function or class that takes arguments names each in ``Args:``."""
    missing = []
    seen: set[int] = set()
    for module_name, names in generate.public_names().items():
        module = importlib.import_module(module_name)
        for name in names:
            obj = getattr(module, name)
            if id(obj) in seen or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            seen.add(id(obj))
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            try:
                signature = inspect.signature(obj)
            except (TypeError, ValueError):
                continue
            params = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
            if not params:
                continue
            documented = generate.docstring_args(obj)
            init = getattr(obj, "__init__", None)
            if inspect.isclass(obj) and init is not None:
                documented |= generate.docstring_args(init)
            for param in params:
                if param not in documented and f"*{param}" not in documented:
                    missing.append(f"{module_name}.{name}({param})")
    assert missing == []


def test_every_cli_flag_is_in_the_generated_reference() -> None:
    page = generate.cli_markdown()
    flags = generate.cli_flags()
    assert set(flags) == {"launch", "train", "env", "estimate-memory", "plot"} | set(flags)
    for command, names in flags.items():
        assert f"## accumix {command}" in page
        for flag in names:
            assert f"`{flag}" in page, (command, flag)


def test_the_flag_check_sees_a_new_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from accumix.cli import env

    original = env.add_parser

    def with_a_flag(subparsers):  # type: ignore[no-untyped-def]
        original(subparsers)
        subparsers.choices["env"].add_argument("--json", action="store_true", help="as JSON")

    monkeypatch.setattr(env, "add_parser", with_a_flag)
    assert "--json" in generate.cli_flags()["env"]
    assert "`--json`" in generate.cli_markdown()


def test_every_train_key_is_described() -> None:
    from accumix.recipes.default import TrainConfig
    from accumix.trainer.config import to_dict

    keys = list(generate.config_keys(TrainConfig, to_dict(TrainConfig())))
    assert {k for k, *_ in keys} >= {"max_steps", "model.n_layer", "optimizer.lr", "data.path"}
    assert [k for k, _, _, meaning in keys if not meaning] == []
    page = generate.train_config_markdown()
    for key, *_ in keys:
        assert f"| `{key}` |" in page


def test_every_error_the_troubleshooting_page_quotes_is_raised_in_the_code() -> None:
    """Each entry's quoted message (a ``> `...` `` line; ``<...>`` for a value, ``...`` for a
    cut) is made of literal runs found in a string of src/: the page cannot quote a message
    the code does not raise (any more)."""
    page = (ROOT / "docs/troubleshooting.md").read_text()
    quoted = [m[1] for m in re.findall(r"^> (`{1,2}) ?(.+?) ?\1$", page, flags=re.M)]
    assert len(quoted) >= 40
    code = "\n".join(p.read_text() for p in (ROOT / "src/accumix").rglob("*.py"))
    code = re.sub(r"\"\s*\n\s*f?\"", "", code)  # implicitly joined string literals
    missing = []
    for message in quoted:
        pieces = [p.strip() for p in re.split(r"<[^>]+>|\.\.\.", message)]
        long = [p for p in pieces if len(p) >= 8]
        if sum(map(len, long)) < 20 or not all(p in code for p in long):
            missing.append(message)
    assert missing == []


# The classes users call methods of (or override, for Callback and MetricLogger). The
# strategies' methods are the interface for writing a strategy and are documented on
# ``Strategy`` as a whole, not argument by argument.
USER_FACING = ("accumix.Accelerator", "accumix.jax.Accelerator", "accumix.Trainer",
               "accumix.Callback", "accumix.MetricLogger", "accumix.CSVLogger",
               "accumix.JSONLLogger", "accumix.TensorBoardLogger", "accumix.MLflowLogger",
               "accumix.WandbLogger", "accumix.ClearMLLogger", "accumix.DynamicLossScale",
               "accumix.trainer.WeightAveraging", "accumix.jax.TrainStep",
               "accumix.testing.CollectiveLog")


def _method_doc(cls: type, name: str) -> str:
    """The docstrings of ``cls.name`` and of the base methods it overrides (a base documents
    the interface's arguments: ``MetricLogger.open``'s are every logger's)."""
    docs = [getattr(vars(base).get(name), "__doc__", None) for base in cls.__mro__]
    return "\n\n".join(inspect.cleandoc(d) for d in docs if d)


def undocumented_arguments() -> list[str]:
    missing = []
    for dotted in USER_FACING:
        module_name, _, name = dotted.rpartition(".")
        cls = getattr(importlib.import_module(module_name), name)
        for member, value in public_members(cls).items():
            if isinstance(value, property):
                continue
            doc = _method_doc(cls, member)
            described = generate.docstring_args(doc) if doc else {}
            for param in inspect.signature(value).parameters:
                if param in ("self", "cls", "trainer", "args", "kwargs"):
                    continue  # a Callback event's ``trainer`` is the Trainer calling it
                if param not in described and f"``{param}``" not in doc:
                    missing.append(f"{dotted}.{member}({param})")
    return missing


def test_user_facing_methods_document_each_argument() -> None:
    """Each argument of the methods users call is in ``Args:`` or named in the text."""
    assert undocumented_arguments() == []
