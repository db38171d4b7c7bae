"""Tables of `apcscore compare`'s terminal report laid out to the console's width, so that no number, option name
or word is cut with an ellipsis (at 80 columns, and in a CI log, where Rich takes 80).

Each column's width is chosen before Rich sees the table: its widest cell when the table fits so; else the widest
columns narrowed first, each down to its longest unbreakable word (a number, an option name, a word of at most
`FOLD` characters; longer ones fold); else a one-row table is transposed and a wider one split into tables that
each repeat the first column. Cells fold (`overflow="fold"`) rather than end in `…`."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

Row = tuple[str, ...]
FOLD = 12  # a word longer than this that is neither a number nor an option name may fold across lines
GAP = 3  # the characters between two columns (padding 1 + the box's divider + padding 1); the edges have none
_NUMBER = re.compile(r"[\[(]?[+-]?(\d[\d,]*\.?\d*|\.\d+)(e[+-]?\d+)?%?[\]),;:]*|[+-]?(inf|nan)", re.IGNORECASE)


def unbreakable(word: str) -> bool:
    """Whether a word must stay whole: a number or an option name (at any length), or a short word."""
    return cell_len(word) <= FOLD or word.startswith("--") or _NUMBER.fullmatch(word) is not None


def _min_width(text: str) -> int:
    """The narrowest a cell may be: its longest unbreakable word (a breakable one counts FOLD)."""
    return max((cell_len(w) if unbreakable(w) else FOLD for w in text.split()), default=1)


def _natural(text: str) -> int:
    return max((cell_len(line) for line in text.splitlines()), default=0)


def widths(head: Row, rows: Sequence[Row], avail: int) -> list[int] | None:
    """Column widths (content, without padding) that fit `avail` columns without cutting a number or an option
    name; None when no such widths exist."""
    cols = list(zip(head, *rows))
    natural = [max(_natural(x) for x in col) for col in cols]
    least = [max(_min_width(x) for x in col) for col in cols]
    room = avail - GAP * (len(cols) - 1)
    if sum(natural) <= room:
        return natural
    if sum(least) > room:
        return None
    out = list(natural)
    while sum(out) > room:  # narrow the widest column that may still narrow, one character at a time
        i = max((j for j in range(len(out)) if out[j] > least[j]), key=lambda j: out[j])
        out[i] -= 1
    return out


def _table(head: Row, rows: Sequence[Row], styles: Sequence[str | None] | None, fixed: list[int] | None) -> Table:
    columns = [Column(h, width=None if fixed is None else w, overflow="fold") for h, w in
               zip(head, fixed or [None] * len(head))]
    t = Table(*columns, box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=False)
    for i, row in enumerate(rows):
        t.add_row(*(escape(x) for x in row), style=styles[i] if styles else None)
    return t


def _print(console: Console, title: str, table: Table) -> None:
    """A blank line, the title (wrapped at the console's width, not the table's) and the table."""
    console.print()
    if title:
        console.print(title, style="italic", markup=False, highlight=False)
    console.print(table)


def print_table(console: Console, title: str, head: Row, rows: Sequence[Row],
                styles: Sequence[str | None] | None = None) -> None:
    """Print a table that fits the console's width (see the module's docstring); `styles`: one per row."""
    avail = console.width
    fit = widths(head, rows, avail)
    if fit is not None:
        _print(console, title, _table(head, rows, styles, fit))
        return
    if len(rows) == 1 and len(head) > 2:  # transposed: one row per column
        pairs = list(zip(head, rows[0]))
        print_table(console, title, ("", "value"), pairs, [styles[0]] * len(pairs) if styles else None)
        return
    if len(head) < 3:  # nothing to split: Rich's own layout (a console narrower than two words)
        _print(console, title, _table(head, rows, styles, None))
        return

    def pick(cols: list[int]) -> tuple[Row, list[Row]]:
        return tuple(head[i] for i in cols), [tuple(r[i] for i in cols) for r in rows]

    rest, part = list(range(1, len(head))), 0
    while rest:  # the first column, then as many of the others as fit
        cols = [0, rest.pop(0)]
        while rest and widths(*pick([*cols, rest[0]]), avail) is not None:
            cols.append(rest.pop(0))
        sub_head, sub_rows = pick(cols)
        part += 1
        _print(console, title if part == 1 else f"{title} (continued)",
               _table(sub_head, sub_rows, styles, widths(sub_head, sub_rows, avail)))
