"""MkDocs hooks (``hooks:`` in mkdocs.yml): lay the package out as the wheel lays it out.

The editable install maps ``jaxnitro`` to ``core/`` and ``jaxnitro.plugins``,
``jaxnitro.loggers``, ``jaxnitro.checkpointers`` to their folders through an import hook
([tool.setuptools.package-dir] in pyproject.toml). mkdocstrings reads the source statically
(griffe), which finds ``jaxnitro`` but not its mapped subpackages. Before the build, this
hook builds ``build/api-src/jaxnitro/`` from symlinks (the same mapping, read from
pyproject.toml, as the import-linter step of ``.ci/run`` uses), and mkdocs.yml points the
python handler there (``paths: [build/api-src]``). Nothing is copied, so the reference
always shows the checkout's docstrings.

The docstrings use Sphinx roles (``:class:`Nitro```); mkdocstrings renders the quoted name as
code and leaves the role's prefix as text, which ``on_page_content`` removes.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "build" / "api-src"


def build_layout(root: Path = ROOT, target: Path = LAYOUT) -> Path:
    """Symlink each package of ``[tool.setuptools.package-dir]`` to its dotted place."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    if target.exists():
        shutil.rmtree(target)
    for package, folder in sorted(mapping.items()):  # parents before their subpackages
        dest = target / package.replace(".", "/")
        dest.mkdir(parents=True, exist_ok=True)
        for entry in sorted((root / folder).iterdir()):
            if entry.name == "__pycache__" or (dest / entry.name).exists():
                continue
            (dest / entry.name).symlink_to(entry)
    return target


def on_startup(command, dirty, **kwargs):
    # before any plugin reads its configuration: mkdocstrings drops search paths that do not
    # exist yet when it starts
    build_layout()


def on_config(config, **kwargs):
    if not LAYOUT.exists():  # a build started without on_startup (mkdocs as a library)
        build_layout()
    return config


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|term):(?=<code>)")


def on_page_content(html, page, **kwargs):
    return _ROLE.sub("", html)
