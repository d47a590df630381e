"""One formatter for every plain-text table the tools print.

Hand-written ``f"{x:<62}"`` widths break as soon as a cell is longer than its guess (a plan's options
with offloads, a long layout), and every table then guessed differently. Here a column's width is the
widest of its title and cells, so rows always line up; callers format the cell values themselves (units
and precision are theirs to choose) and say only how each column aligns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Column:
    """A column's title and alignment: ``"<"`` for words, ``">"`` for numbers."""

    title: str
    align: Literal["<", ">"] = "<"


def format_table(columns: Sequence[Column], rows: Iterable[Sequence[str]], *, indent: str = "",
                 gap: str = "  ") -> list[str]:
    """The header and one line per row, every column as wide as its widest cell; trailing blanks trimmed.

    A row shorter than the columns leaves the rest empty; a longer one is a caller's bug and raises.
    """
    body = [list(row) for row in rows]
    for row in body:
        if len(row) > len(columns):
            raise ValueError(f"a row has {len(row)} cells for {len(columns)} columns: {row!r}")
        row.extend([""] * (len(columns) - len(row)))
    widths = [max([len(c.title), *(len(row[i]) for row in body)]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        parts = [f"{cell:{col.align}{width}}" for cell, col, width in zip(cells, columns, widths)]
        return (indent + gap.join(parts)).rstrip()

    return [line([c.title for c in columns]), *(line(row) for row in body)]
