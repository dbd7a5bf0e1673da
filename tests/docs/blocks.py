"""The code blocks of README.md, the docs pages and the public docstrings, and how each is run.

The conventions (``docs/contributing/docs.md`` says the same for the docs' writers):

* ```` ```python ````: run, in process, in a fresh namespace, with a scratch directory as the
  working directory (the page's: a later block sees the files an earlier one wrote).
  ```` ```python continuation ```` runs in the previous block's namespace (pytest-markdown-docs'
  word). ```` ```python notest ```` is an illustration: never run.
* A ``python`` or ``yaml`` block whose first line is ``# <name>.py`` (or ``.yaml``) is a file:
  written under that name before the page's commands run. A file that no command names is run
  at the end, as ``python <name>.py`` would (in process, ``__name__ == "__main__"``).
* ```` ```bash test ```` (or ``sh test``): each line is a command, run in the page's directory.
  ``accumix <command>`` runs in process (``launch`` as a real process), and so does
  ``python <name>.py`` for a file of the page; any other line runs in a shell; a trailing
  ``&`` runs it in the background until a ``wait`` line; ``make`` lines are left out (the
  project's own entry points: CI runs them). Every command must exit 0.
  ``accumix train`` runs shortened (``SHORT``: 4 steps of a one-layer model, one process);
  a ``--master-port N`` becomes a free port (the same for the whole page).
* ```` ```text test ````: each ``$ accumix ...`` line is run and must fail with exit status 2
  and the line below it on stderr.
* Any other block (``bash`` without ``test``, ``yaml`` without a file name, ``text``) is not run.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
FILE_HEADER = re.compile(r"^# ([\w.-]+\.(?:py|yaml))\b")
RUN_LANGUAGES = {"py", "python", "python3"}
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, the words after it, its text and its first line."""

    language: str
    words: frozenset[str]
    body: str
    line: int

    @property
    def file_name(self) -> str | None:
        match = FILE_HEADER.match(self.body)
        if match and self.language in (*RUN_LANGUAGES, "yaml"):
            return match.group(1)
        return None

    @property
    def runs(self) -> bool:
        """Whether the docs tests run (or check) this block."""
        if self.language in RUN_LANGUAGES:
            return "notest" not in self.words
        return "test" in self.words and self.language in (*SHELL_LANGUAGES, "text")


@dataclass
class Source:
    """A page (or a docstring) and its blocks."""

    name: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def runnable(self) -> bool:
        return any(b.runs for b in self.blocks)


def parse(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order (indented ones in lists too)."""
    blocks = []
    for token in MarkdownIt("commonmark").parse(text):
        if token.type != "fence" or not token.map:
            continue
        info = token.info.split()
        language = info[0] if info else ""
        blocks.append(Block(language, frozenset(info[1:]), token.content, token.map[0] + 1))
    return blocks


def _google_sections_dedented(doc: str) -> str:
    """A Google-style docstring with each section's body dedented, as mkdocstrings renders it
    (an ``Example:`` section's fence is indented in the docstring, not in the page)."""
    import textwrap

    out: list[str] = []
    body: list[str] = []
    for line in [*doc.splitlines(), "End:"]:
        if body and (not line.startswith(" ") and line.strip()):
            out.extend(textwrap.dedent("\n".join(body)).splitlines())
            body = []
        if body or (line.startswith(" ") and out and re.match(r"^\w[\w ]*:$", out[-1])):
            body.append(line)
        else:
            out.append(line)
    return "\n".join(out[:-1])


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def docstring_sources() -> list[Source]:
    """The public API's docstrings that hold a fenced block."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs/hooks/generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    found: dict[str, Source] = {}
    for module_name, names in generate.public_names().items():
        module = __import__(module_name, fromlist=["_"])
        for name in names:
            obj = getattr(module, name)
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{m}", v) for m, v in vars(obj).items()
                            if not m.startswith("_") and (inspect.isfunction(v)
                                                          or isinstance(v, property))]
            for label, member in members:
                doc = inspect.getdoc(member) if not isinstance(member, (str, tuple)) else None
                blocks = parse(_google_sections_dedented(doc or ""))
                key = f"{getattr(obj, '__module__', module_name)}.{label}"
                if blocks and key not in found:
                    found[key] = Source(f"docstring of {key}", blocks)
    return list(found.values())


def sources() -> list[Source]:
    """Every page and docstring with its blocks."""
    out = [Source(str(p.relative_to(ROOT)), parse(p.read_text())) for p in pages()]
    return out + docstring_sources()
