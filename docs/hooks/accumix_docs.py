"""mkdocs hook: fills the ``<!-- accumix:NAME -->`` markers with parts generated from the code.

``readme`` (the home page is README.md), ``cli`` (the command line, from its parser),
``train-config`` (the keys of ``accumix train``, from the config dataclasses) and
``api-index`` (every public name), ``benchmark-plots`` (pictures of BENCHMARKS.md's tables),
and ``output ARGS`` (what ``accumix ARGS`` prints, run at
the build). The generators are ``generate.py`` and ``plots.py`` beside this file.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_MARKER = re.compile(r"^<!-- accumix:([\w-]+)(?: (.+?))? -->$", re.M)


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"accumix_docs_{name}", _HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def on_config(config: Any) -> Any:
    # The generators import accumix: the tree's src/ first, as the tests run it.
    src = str(_HERE.parents[1] / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- accumix:" not in markdown:
        return markdown
    generate, plots = _load("generate"), _load("plots")
    makers = {
        "readme": lambda: generate.readme_for_site((generate.ROOT / "README.md").read_text()),
        "cli": generate.cli_markdown,
        "train-config": generate.train_config_markdown,
        "api-index": generate.api_index_markdown,
        "benchmark-plots": lambda: plots.benchmark_plots(
            (generate.ROOT / "BENCHMARKS.md").read_text()),
    }

    def fill(match: re.Match[str]) -> str:
        name, arguments = match.group(1), match.group(2)
        if name == "output" and arguments:
            return generate.command_output(arguments)
        if name not in makers or arguments:
            raise ValueError(f"{page.file.src_path}: unknown marker accumix:{name}; "
                             f"known: {', '.join(makers)}")
        return makers[name]()

    return _MARKER.sub(fill, markdown)
