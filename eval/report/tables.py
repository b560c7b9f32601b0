"""The one layout rule of the benches' rich tables: label columns left, figures right.

Owns column alignment only; what each row says is its report's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rich.table import Table


def figures_table(
    columns: Sequence[str], labels: Collection[str], *, title: str, caption: str | None = None
) -> Table:
    """An empty table of `columns`: those in `labels` left-aligned (names), the rest right
    (numbers line up by their last digit)."""
    table = Table(title=title, caption=caption)
    for column in columns:
        table.add_column(column, justify="left" if column in labels else "right")
    return table
