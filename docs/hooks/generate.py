"""The docs' generated parts, built from the code at each build so that they cannot drift.

* ``cli_markdown()``: every ``accumix`` subcommand, argument and flag, from the argparse parser
  the command itself runs (``accumix.cli.main.build_parser``).
* ``train_config_markdown()``: every key ``accumix train`` reads, from the config dataclasses
  (type, default as ``--print-config`` prints it, and the docstring's ``Args:`` line).
* ``api_index_markdown(pages)``: every public name with its summary and the reference page
  that documents it; a name that no page documents yet is documented right there.
* ``command_output(arguments)``: what ``accumix <arguments>`` prints, run in this process.
* ``readme_for_site(text)``: README.md as the site's home page (links into ``docs/`` made
  relative to the site).

The benchmark pictures are ``plots.py``'s.

``accumix_docs.py`` (the mkdocs hook) puts them in place of ``<!-- accumix:NAME -->`` markers;
``tests/docs`` calls them directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# The modules whose public names the API reference documents (``__all__``, or for a module
# without one, the names it defines that do not start with an underscore).
PUBLIC_MODULES = ("accumix", "accumix.jax", "accumix.trainer", "accumix.checkpoint",
                  "accumix.testing")

# ----------------------------------------------------------------------------------------------
# The command line


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _argument_rows(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, str]]:
    """``(names, default, help)`` of each argument a user can give, positional ones first."""
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    for action in sorted(actions, key=lambda a: bool(a.option_strings)):
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            takes_value = action.nargs != 0
            metavar = action.metavar or action.dest.upper()
            names = ", ".join(f"`{s} {metavar}`" if takes_value else f"`{s}`"
                              for s in action.option_strings)
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                default = ""
            else:
                default = "" if action.default is None else f"`{action.default}`"
        else:
            names = f"`{action.metavar or action.dest}`"
            default = ""
        choices = f" (one of: {', '.join(map(str, action.choices))})" if action.choices else ""
        yield names, default, _cell((action.help or "") + choices)


def cli_markdown() -> str:
    """The reference of the ``accumix`` command, from its parser."""
    from accumix.cli.main import build_parser

    parser = build_parser()
    helps = _subcommand_help(parser)
    out = [f"```text\n{parser.format_usage().strip()}\n```", "", parser.description or "", ""]
    out += ["| command | what it does |", "| --- | --- |"]
    out += [f"| [`accumix {name}`](#accumix-{name}) | {_cell(helps.get(name, ''))} |"
            for name in _subcommands(parser)]
    for name, sub in _subcommands(parser).items():
        out += ["", f"## accumix {name}", "", sub.description or helps.get(name, ""), "",
                f"```text\n{sub.format_usage().strip()}\n```", ""]
        rows = list(_argument_rows(sub))
        if rows:
            out += ["| argument | default | meaning |", "| --- | --- | --- |"]
            out += [f"| {n} | {d} | {h} |" for n, d, h in rows]
        else:
            out += ["No arguments."]
    return "\n".join(out) + "\n"


def cli_flags() -> dict[str, list[str]]:
    """Every subcommand's option strings and positional names, for the test."""
    from accumix.cli.main import build_parser

    flags = {}
    for name, sub in _subcommands(build_parser()).items():
        flags[name] = [s for a in sub._actions if not isinstance(a, argparse._HelpAction)
                       for s in (a.option_strings or [a.metavar or a.dest])]
    return flags


# ----------------------------------------------------------------------------------------------
# accumix train's keys


def docstring_args(obj: Any) -> dict[str, str]:
    """The ``Args:`` (or ``Attributes:``) section of a Google-style docstring, one line each.

    ``obj`` is an object (its docstring is read) or a docstring's text.
    """
    doc = inspect.cleandoc(obj) if isinstance(obj, str) else inspect.getdoc(obj) or ""
    args: dict[str, str] = {}
    section = False
    name = None
    for line in doc.splitlines():
        if re.match(r"^(Args|Arguments|Attributes|Parameters):\s*$", line):
            section, name = True, None
            continue
        if section and line and not line.startswith(" "):
            section = False  # the next section
        if not section or not line.strip():
            continue
        match = re.match(r"^    (\*{0,2}\w+)(?: \(.*?\))?:\s*(.*)$", line)
        if match:
            name = match.group(1)
            args[name] = match.group(2)
        elif name is not None:
            args[name] += " " + line.strip()
    return args


def _type_text(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_text(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_text(args[0])}"
        return "[" + ", ".join(_type_text(a) for a in args) + "]"
    if hint is type(None):
        return "null"
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def _yaml_value(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def config_keys(cls: type, defaults: dict[str, Any], prefix: str = ""
                ) -> Iterator[tuple[str, str, str, str]]:
    """``(key, type, default, meaning)`` of every key, sections after the plain keys."""
    hints = typing.get_type_hints(cls)
    described = docstring_args(cls)
    sections = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            sections.append((f.name, hint))
            continue
        yield (prefix + f.name, _type_text(hint), _yaml_value(defaults[f.name]),
               described.get(f.name, ""))
    for name, hint in sections:
        yield from config_keys(hint, defaults[name], prefix + name + ".")


def train_config_markdown() -> str:
    """Tables of every key of ``accumix train``, a table per section."""
    from accumix.recipes.default import TrainConfig
    from accumix.trainer.config import to_dict

    out: list[str] = []
    section = None
    for key, type_text, default, meaning in config_keys(TrainConfig, to_dict(TrainConfig())):
        head = key.rsplit(".", 1)[0] if "." in key else ""
        if head != section:
            section = head
            title = f"`{head}:`" if head else "Top level"
            out += ["", f"## {title}", "", "| key | type | default | meaning |",
                    "| --- | --- | --- | --- |"]
        out.append(f"| `{key}` | {type_text} | `{_cell(default)}` | {_cell(meaning)} |")
    return "\n".join(out).lstrip() + "\n"


# ----------------------------------------------------------------------------------------------
# The public API


def public_names() -> dict[str, list[str]]:
    """Each public module's public names, in its order."""
    names = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        listed = getattr(module, "__all__", None)
        if listed is None:
            listed = [n for n, v in vars(module).items() if not n.startswith("_")
                      and getattr(v, "__module__", None) == module_name]
        names[module_name] = [n for n in listed if not n.startswith("__")]
    return names


def canonical_path(module_name: str, name: str) -> str:
    """Where the object ``module_name.name`` is defined (what ``:::`` needs)."""
    obj = getattr(importlib.import_module(module_name), name)
    defined_in = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if defined_in and qualname and (inspect.isclass(obj) or inspect.isfunction(obj)):
        return f"{defined_in}.{qualname}"
    return f"{module_name}.{name}"  # a constant: its page names it by the module it is in


DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.M)


def documented_paths(docs: Path = DOCS) -> dict[str, str]:
    """``{object path: page}`` of every ``::: path`` directive in the reference pages, each page
    relative to ``reference/api/`` (where the index is)."""
    import os

    found = {}
    api = docs / "reference" / "api"
    for page in sorted((docs / "reference").rglob("*.md")):
        for path in DIRECTIVE.findall(page.read_text()):
            found.setdefault(path, os.path.relpath(page, api))
    return found


def _summary(module_name: str, name: str) -> str:
    obj = getattr(importlib.import_module(module_name), name)
    doc = inspect.getdoc(obj) if not isinstance(obj, (str, int, tuple, list, dict)) else None
    return _cell((doc or "").split("\n\n")[0].replace("\n", " "))


def _anchor(path: str) -> str:
    return path  # mkdocstrings' heading ids are the object's full path


def api_index_markdown(docs: Path = DOCS) -> str:
    """A table per public module: name, summary, where it is documented."""
    documented = documented_paths(docs)
    out: list[str] = []
    undocumented: list[str] = []
    for module_name, names in public_names().items():
        out += ["", f"## `{module_name}`", "", "| name | what it is |", "| --- | --- |"]
        for name in names:
            path = canonical_path(module_name, name)
            page = documented.get(path)
            if page is None and path == f"{module_name}.{name}":  # a constant
                path, page = next(((p, pg) for p, pg in documented.items()
                                   if p.startswith(module_name + ".")
                                   and p.endswith("." + name)), (path, None))
            if page is None:
                undocumented.append(path)
                link = f"[`{name}`](#{_anchor(path)})"
            else:
                link = f"[`{name}`]({page}#{_anchor(path)})"
            out.append(f"| {link} | {_summary(module_name, name)} |")
    if undocumented:
        out += ["", "## Not yet on a themed page", ""]
        out += [f"::: {path}\n" for path in dict.fromkeys(undocumented)]
    return "\n".join(out).lstrip() + "\n"


# ----------------------------------------------------------------------------------------------
# A command's output


def command_output(arguments: str) -> str:
    """What ``accumix <arguments>`` prints, run in this process, as a text block."""
    import contextlib
    import io
    import shlex

    from accumix.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(shlex.split(arguments))
    if status != 0:
        raise RuntimeError(f"accumix {arguments} exited {status}: {err.getvalue()[-2000:]}")
    return f"```text\n$ accumix {arguments}\n{out.getvalue().rstrip()}\n```\n"


# ----------------------------------------------------------------------------------------------
# README as the home page

_DOCS_LINK = re.compile(r"\]\(docs/")


def readme_for_site(text: str) -> str:
    """README.md for ``docs/index.md``: links into ``docs/`` become site-relative."""
    return _DOCS_LINK.sub("](", text)
