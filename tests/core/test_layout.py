"""core/layout.py: the one registry of KV layout names, and every user of layout names takes them from it."""

import pytest

from omnitide_mlx.core.layout import (
    LAYOUT_NAMES,
    LAYOUTS,
    OMNIPAGE_MIGRATIONS,
    layout_spec,
    make_layout,
    migration_variants,
)
from omnitide_mlx.core.page import MIGRATION_MODES, PLACEMENTS, LayoutError
from omnitide_mlx.core.pick import POLICIES, RetentionError, make_policy


def test_layouts_by_name():
    t, p = make_layout("omnipage", migration="ordered_suffix", min_gain_pages=3)
    assert t.placement == "first_fit" and p.mode == "ordered_suffix" and p.min_gain_pages == 3
    t, p = make_layout("omnipage")
    assert t.placement == "class_aware" and p.mode == "class_aware"
    t, p = make_layout("native", 32, 16, migration="ordered_suffix")  # one migration mode only: ignored
    assert (t.placement, p.mode, t.page_size, t.subblock_size) == ("first_fit", "native", 32, 16)
    t, p = make_layout("eager")
    assert t.placement == "first_fit" and p.mode == "eager"
    with pytest.raises(LayoutError, match="unknown layout"):
        make_layout("vattention")
    with pytest.raises(LayoutError, match="migration"):
        make_layout("omnipage", migration="eager")


def test_the_registry_is_consistent_with_the_page_table_and_the_planner():
    assert LAYOUT_NAMES == ("native", "omnipage", "eager") == tuple(LAYOUTS)
    for name, spec in LAYOUTS.items():
        assert spec.name == name and spec.placement in PLACEMENTS and spec.migration in MIGRATION_MODES
        with pytest.raises(AttributeError):  # frozen
            spec.migration = "eager"
    assert set(OMNIPAGE_MIGRATIONS) <= set(MIGRATION_MODES) and LAYOUTS["omnipage"].migration == OMNIPAGE_MIGRATIONS[0]
    variants = migration_variants()
    assert list(variants) == ["native", "ordered_suffix", "class_aware", "eager"]
    assert {v.name for v in variants.values()} == set(LAYOUT_NAMES)
    assert variants["ordered_suffix"] == layout_spec("omnipage", "ordered_suffix")


def test_policies_take_their_layout_from_the_registry():
    for name in POLICIES:
        assert make_policy(name).layout in LAYOUT_NAMES
    with pytest.raises(RetentionError, match="unknown layout"):
        make_policy("omnipick", layout="vattention")


def test_the_simulate_command_takes_its_migration_choices_from_the_registry():
    from omnitide_mlx.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["simulate"]
    (migration,) = [a for a in sub._actions if a.dest == "migration"]
    assert tuple(migration.choices) == OMNIPAGE_MIGRATIONS and migration.default == OMNIPAGE_MIGRATIONS[0]
