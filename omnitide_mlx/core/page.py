"""OmniPage: tile-aligned paged KV slots, retention-aware placement and selective migration (paper section 6).

OmniPage's public names, gathered from its two halves:

- core/page_table.py: the :class:`PageTable` (where every retained KV entry lives: serial, owner unit and
  allocation class per slot; the two placements ``"first_fit"`` and ``"class_aware"``) and
  :func:`check_move_order`, the contract a move list must meet before anyone applies it;
- core/migration.py: the :class:`MigrationPlanner` and its four modes ``"native"`` (never move),
  ``"class_aware"`` (paper 6.2, for tile-skipping kernels), ``"ordered_suffix"`` (paper 6.2, for kernels that
  traverse the span) and ``"eager"`` (pack everything after every eviction; the reference oracle).
"""


from .migration import MIGRATION_MODES, MigrationPlan, MigrationPlanner
from .page_table import (
    FREE,
    NUM_CLASSES,
    PLACEMENTS,
    AllocClass,
    LayoutError,
    LayoutStats,
    PageTable,
    check_move_order,
    stats_from_occupancy,
)

__all__ = ["FREE", "MIGRATION_MODES", "NUM_CLASSES", "PLACEMENTS", "AllocClass", "LayoutError", "LayoutStats",
           "MigrationPlan", "MigrationPlanner", "PageTable", "check_move_order", "stats_from_occupancy"]
