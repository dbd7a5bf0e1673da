"""``torch.compile`` applied after the strategy: the user's options, on what really runs.

A model handed to ``acc.setup`` as ``torch.compile(model, **opts)`` is an ``OptimizedModule``
around the user's module. Wrapping or sharding that wrapper loses the compilation (FSDP2's hooks
sit on the outer module and dynamo never sees a frame) and leaks ``_orig_mod.`` into state-dict
keys. So setup takes the user's module out, lets the strategy wrap or shard it, and compiles the
modules the strategy names (``Strategy.compile_module``) *in place*, as ``nn.Module.compile``
does: the compiled ``_call_impl`` replaces the module's call, the module object, its class,
parameters and state-dict keys stay the user's, and ``acc.unwrap`` has nothing to strip.

The compiled call is wrapped once more so that a compile failure (no C++ compiler, an op
inductor cannot lower, a graph break under ``fullgraph=True``) is one ``CompileError`` line that
says to pass ``compile=False``; nothing falls back to eager silently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accumix.errors import CompileError, ConfigError

if TYPE_CHECKING:
    from accumix.strategies.base import Strategy

CompileSetting = bool | dict[str, Any] | None

# torch.compile's keyword arguments (torch 2.13); anything else is a user's typo.
_COMPILE_KWARGS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


@dataclass(kw_only=True, frozen=True, slots=True)
class Compiler:
    """How to compile a callable: the user's ``torch.compile`` options, or the dynamo context of
    the ``OptimizedModule`` they built (its options are baked into it and not readable back).

    Attributes:
        options: ``torch.compile`` keyword arguments, when known.
        context: the user's ``OptimizedModule.dynamo_ctx``, when the model came compiled.
    """

    options: dict[str, Any] | None = None
    context: Any = None

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if self.context is not None:
            return self.context(fn)
        return torch.compile(fn, **(self.options or {}))

    def compile_in_place(self, module: nn.Module) -> nn.Module:
        """Compiles ``module``'s call (hooks and forward) in place, as ``nn.Module.compile``.

        A module whose forward is torch's own (``nn.Sequential``, ``nn.TransformerEncoderLayer``
        as FSDP units) gets its forward compiled instead: dynamo never traces a frame that
        starts in torch's files (``_call_impl``, then ``Sequential.forward``), so compiling the
        call converted frames but captured no graph and the block ran eagerly. A frame of ours
        around the forward is traced and inlines it (``torch.compile(nn.Sequential(...))``
        does the same); the module's hooks (FSDP2's all-gather) run around it, eagerly.
        """
        name = type(module).__name__
        if torch._dynamo.trace_rules.check(module.forward):
            forward = functools.partial(_call, module.forward)
            module.forward = reporting_failures(self(forward), name)  # type: ignore[method-assign]
            return module
        module._compiled_call_impl = reporting_failures(self(module._call_impl), name)
        return module


def _call(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The frame dynamo starts tracing at for a torch module's forward (see above)."""
    return forward(*args, **kwargs)


def resolve_compile(setting: CompileSetting) -> Compiler | None | bool:
    """``Accelerator(compile=...)`` checked once: a ``Compiler``, None (not asked: a model that
    comes compiled is compiled) or False (asked off: a compiled model runs eagerly).

    Raises:
        ConfigError: not a bool, None or a dict of ``torch.compile`` keyword arguments.
    """
    if setting is None:
        return None
    if setting is False:
        return False
    if setting is True:
        return Compiler(options={})
    if isinstance(setting, dict):
        unknown = [k for k in setting if k not in _COMPILE_KWARGS]
        if unknown:
            raise ConfigError(f"compile={setting!r} has unknown key(s) {unknown}; use "
                              f"torch.compile's: {', '.join(_COMPILE_KWARGS)}")
        return Compiler(options=dict(setting))
    raise ConfigError(f"compile={setting!r} is invalid; use True, False or a dict of "
                      "torch.compile keyword arguments such as {'mode': 'max-autotune'}")


def is_compiled_wrapper(module: Any) -> bool:
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def strip_compiled(module: nn.Module) -> nn.Module:
    """The module inside ``torch.compile``'s wrapper(s), or ``module`` itself."""
    while is_compiled_wrapper(module):
        module = module._orig_mod
    return module


def unwrap(strategy: Strategy, module: nn.Module) -> nn.Module:
    """``acc.unwrap``: the user's module inside the strategy's wrapper and ``torch.compile``'s."""
    return strip_compiled(strategy.unwrap(strip_compiled(module)))


def split_compiled(model: nn.Module, asked: Compiler | None | bool
                   ) -> tuple[nn.Module, Compiler | None]:
    """The user's plain module and how to compile it after the strategy (None: eagerly).

    ``asked`` is ``resolve_compile``'s answer. A model that comes compiled keeps its own options
    unless ``compile=False``; with ``compile=True|dict`` as well, the two must not disagree.

    Raises:
        ConfigError: ``Accelerator(compile={...})`` and a ``torch.compile``'d model together.
    """
    if not is_compiled_wrapper(model):
        return model, asked if isinstance(asked, Compiler) else None
    if asked is False:
        return strip_compiled(model), None
    if isinstance(asked, Compiler) and asked.options:
        raise ConfigError(f"the model came torch.compile'd and Accelerator(compile="
                          f"{asked.options!r}) was given too; pass the plain model, or "
                          "compile=None to keep the model's own options")
    return strip_compiled(model), Compiler(context=model.dynamo_ctx)


def reporting_failures(compiled: Callable[..., Any], where: str) -> Callable[..., Any]:
    """``compiled`` whose compile failures are one ``CompileError`` line; the user's own errors
    (a shape mismatch in their forward, which dynamo reports as ``TorchRuntimeError``) pass
    through unchanged: eager would raise them too."""
    exc_module = torch._dynamo.exc

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except exc_module.TorchRuntimeError:
            raise
        except exc_module.TorchDynamoException as exc:
            raise CompileError(f"torch.compile failed on {where}: {_summary(exc)}; pass "
                               "compile=False to train without it") from exc

    return call


def _summary(exc: BaseException) -> str:
    """The failure and its cause in one line (a backend's own error is the useful part)."""
    cause = getattr(exc, "inner_exception", None) or exc.__cause__
    text = f"{type(exc).__name__}"
    for err in (cause, exc) if cause is not None else (exc,):
        line = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
        if line:
            return f"{text} ({type(err).__name__}: {line[:300]})"
    return text
