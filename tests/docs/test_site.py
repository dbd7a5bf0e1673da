"""The docs site builds with ``mkdocs build --strict`` (no broken link, anchor or reference), and
the built pages hold what the generators promise: every CLI flag, every train key, every public
name, the README as the home page, illustrations rendered as highlighted code."""

from __future__ import annotations

import html
import importlib.util
import os
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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The strict build, once for this module's tests (in process: torch and accumix are
    imported already, which the generators need)."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    out = tmp_path_factory.mktemp("site")
    saved = os.getcwd()
    os.chdir(ROOT)  # mkdocs.yml's paths (src, docs, the snippets' base) are the repository's
    try:
        build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True))
    finally:
        os.chdir(saved)
    return out


def _article(page: Path) -> str:
    text = page.read_text()
    return text[text.find("<article"):text.find("</article>")]


def _visible(page: Path) -> str:
    """The page's text outside code, tags dropped."""
    article = re.sub(r"<code.*?</code>|<pre.*?</pre>", " ", _article(page), flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", article))


def _code(page: Path) -> str:
    """The text inside the page's code elements, tags dropped."""
    parts = re.findall(r"<code[^>]*>(.*?)</code>", _article(page), flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", "\n".join(parts)))


def test_every_cli_flag_is_on_the_built_page(site: Path) -> None:
    code = _code(site / "reference/cli/index.html")
    for command, flags in _generate().cli_flags().items():
        assert f"accumix {command}" in _visible(site / "reference/cli/index.html")
        for flag in flags:
            assert flag in code, (command, flag)


def test_every_train_key_is_on_the_built_page(site: Path) -> None:
    from accumix.recipes.default import TrainConfig
    from accumix.trainer.config import to_dict

    code = _code(site / "reference/train-config/index.html")
    keys = [k for k, *_ in _generate().config_keys(TrainConfig, to_dict(TrainConfig()))]
    assert len(keys) > 40
    assert [k for k in keys if k not in code] == []


def test_every_public_name_is_documented_on_a_page(site: Path) -> None:
    """Each public name is in the index, and its object has a heading (an anchor) on the page
    the index links to."""
    generate = _generate()
    index = site / "reference/api/index.html"
    anchors = {p: set(re.findall(r'id="([\w.]+)"', p.read_text()))
               for p in (site / "reference").rglob("*.html")}
    every = set().union(*anchors.values())
    for module, names in generate.public_names().items():
        for name in names:
            assert name in _code(index), (module, name)
            path = generate.canonical_path(module, name)
            if path == f"{module}.{name}":  # a constant: its page names the defining module
                path = next(a for a in every if a.endswith("." + name))
            assert path in every, path


def test_illustrations_render_as_highlighted_code(site: Path) -> None:
    """``python notest`` (and ``continuation``, ``bash test``) fences render as code of their
    language, the extra word not shown: a fence superfences did not read would leave its
    backticks and words in the page's text."""
    pages = list(site.rglob("*.html"))
    assert not [p for p in pages if "```" in _visible(p)]
    assert not [p for p in pages if re.search(r"\b(notest|continuation)\b", _visible(p))]
    guide = _article(site / "guides/compile/index.html")  # its first block is `python notest`
    assert '<span class="s2">"max-autotune"</span>' in guide  # a Python string token


def test_the_home_page_is_the_readme(site: Path) -> None:
    home = _visible(site / "index.html")
    readme = (ROOT / "README.md").read_text()
    first = next(line for line in readme.splitlines()[2:] if line.strip())
    assert first.split("—")[0].strip() in home
    assert "acc.backward(loss_sum, num_items=num_items)" in _code(site / "index.html")


def test_the_benchmarks_page_includes_benchmarks_md(site: Path) -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "BENCHMARKS.md").read_text(), flags=re.M)
    page = _visible(site / "benchmarks/index.html")
    missing = [h for h in headings if h.split("`")[0][:40] not in page]
    assert len(headings) > 10 and missing == []
    pictures = _article(site / "benchmarks/index.html")
    assert pictures.count("<svg") == 3 and "hsdp (full)" in pictures  # drawn from the tables


def test_the_security_page_includes_security_md(site: Path) -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "SECURITY.md").read_text(), flags=re.M)
    page = _visible(site / "security/index.html")
    assert len(headings) >= 4 and [h for h in headings if h not in page] == []
    assert "postgresql://alice:***@host/db" in _code(site / "security/index.html")
