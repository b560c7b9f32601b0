"""`flag` fields: comma-separated lists, factories, unset flags and torch-side field types."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING

import pytest

from kvsplice.common.config_flags import build_config, flag, flag_fields

if TYPE_CHECKING:
    from decimal import Decimal  # a type only type checkers import


def two() -> tuple[str, ...]:
    return ("a", "b")


@dataclass(frozen=True)
class Knobs:
    sizes: tuple[int, ...] = flag((1, 8), "Sizes.", csv=True, min=1, max=64)
    names: tuple[str, ...] = flag(
        MISSING, "Names.", default_factory=two, csv=True, cli_default=None
    )
    limit: int = flag(48, "Limit.", cli_default=None)
    note: str | None = flag("x", "Note.")
    hidden: Decimal | None = None
    rest: list[int] = field(default_factory=list)


def test_a_list_flag_shows_its_text_and_sets_a_tuple() -> None:
    sizes, names, *_ = flag_fields(Knobs)
    assert (sizes.default, names.default) == ("1,8", None)
    assert sizes.split_csv("2,64") == (2, 64) and sizes.split_csv("") == ()
    assert names.split_csv("dense,exact") == ("dense", "exact")
    with pytest.raises(ValueError, match="'2,x' is not a comma-separated list of integers"):
        sizes.split_csv("2,x")
    with pytest.raises(ValueError, match="every value must be >= 1 and <= 64"):
        sizes.split_csv("2,65")


def test_an_unset_flag_keeps_the_field_default_unless_the_field_may_be_none() -> None:
    values = {"sizes": (4,), "names": None, "limit": None, "note": None}
    assert build_config(Knobs, values) == Knobs(sizes=(4,), names=("a", "b"), note=None)


def test_a_field_of_a_type_only_type_checkers_import_holds_no_flag() -> None:
    assert [f.name for f in flag_fields(Knobs)] == ["sizes", "names", "limit", "note"]
