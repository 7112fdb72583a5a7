"""Framed text tables and HTML tables for ``repr``/``show`` of experiments and handles."""

from __future__ import annotations

import html
import shutil
from collections.abc import Sequence

__all__ = ["text_table", "html_table", "Band", "render_bands_text", "render_bands_html"]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def text_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[object]], width: int | None = None
) -> str:
    """A box-drawn table; the last column is clipped so the table fits ``width`` (terminal width)."""
    width = width or shutil.get_terminal_size((100, 24)).columns
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fixed = sum(widths[:-1]) + 3 * (len(widths) - 1) + 4
    widths[-1] = max(min(widths[-1], width - fixed), 8)
    inner = sum(widths) + 3 * (len(widths) - 1) + 2

    def line(r):
        return "│ " + " │ ".join(_clip(c, w).ljust(w) for c, w in zip(r, widths)) + " │"

    out = [title, "┌" + "─" * inner + "┐", line(cells[0]), "├" + "─" * inner + "┤"]
    out += [line(r) for r in cells[1:]]
    out.append("└" + "─" * inner + "┘")
    return "\n".join(out)


def html_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The same table as HTML."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return (
        f"<div><strong>{html.escape(title)}</strong><table><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    )


class Band:
    """One titled section of a report: a header and rows."""

    def __init__(self, title: str, header: Sequence[str], rows: Sequence[Sequence[object]]):
        self.title, self.header, self.rows = title, tuple(header), [tuple(r) for r in rows]


def render_bands_text(bands: Sequence[Band], width: int | None = None) -> str:
    return "\n".join(text_table(b.title, b.header, b.rows, width) for b in bands if b.rows)


def render_bands_html(bands: Sequence[Band]) -> str:
    return "".join(html_table(b.title, b.header, b.rows) for b in bands if b.rows)
