"""KV layouts: where a paged cache places new entries and when it moves kept ones. The one registry of layout names.

A layout is a placement (``PageTable``'s ``first_fit`` or ``class_aware``) and a migration mode
(``MigrationPlanner``). Three are named, and every part of the package takes its layout names from here: a policy's
``layout`` (core/pick.py), the engine and the torch session, the simulator, both attention benchmarks and the CLI.

- ``native``: first-fit placement (llama.cpp's ``find_slot`` after ``seq_rm``), never moves.
- ``omnipage``: class-aware placement and selective migration. Its migration mode is a choice:
  ``class_aware`` (default; for tile-skipping kernels) or ``ordered_suffix`` (for span-traversing ones, which
  "replaces class-based placement", paper 6.2, so first-fit placement). ``class_aware`` comes with tail fill
  (``MigrationPlanner.tail_fill``, our extension: the last pages' entries also move down when that shortens the
  span; docs/simulator.md has the figures that made it the default); ``tail_fill=False`` is the paper's letter.
- ``eager``: first-fit placement, and everything packed to a contiguous prefix after every eviction.

The torch attention benchmark times OmniPage with both migration modes side by side and labels those rows by the
mode: :func:`migration_variants` is that list (``native``, ``ordered_suffix``, ``class_aware``, ``eager``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .page import LayoutError, MigrationPlanner, PageTable

OMNIPAGE_MIGRATIONS = ("class_aware", "ordered_suffix")  # the first is the default


@dataclass(frozen=True)
class LayoutSpec:
    """A named layout with its migration mode chosen: enough to build a page table and its planner."""

    name: str
    placement: str
    migration: str
    min_gain_pages: int = 1
    tail_fill: bool = False  # class_aware migration only

    def table(self, page_size: int = 64, subblock_size: int = 32) -> PageTable:
        return PageTable(page_size, subblock_size, placement=self.placement)

    def planner(self) -> MigrationPlanner:
        return MigrationPlanner(self.migration, min_gain_pages=self.min_gain_pages, tail_fill=self.tail_fill)

    def build(self, page_size: int = 64, subblock_size: int = 32) -> tuple[PageTable, MigrationPlanner]:
        """A fresh, empty page table of this layout and its migration planner."""
        return self.table(page_size, subblock_size), self.planner()

    def to_json(self) -> dict:
        return {"name": self.name, "placement": self.placement, "migration": self.migration,
                "min_gain_pages": self.min_gain_pages, "tail_fill": self.tail_fill}

    @classmethod
    def from_json(cls, d: dict) -> "LayoutSpec":
        """The spec ``to_json`` wrote, rebuilt through :func:`layout_spec` (so a saved spec is a valid one)."""
        try:
            spec = layout_spec(d["name"], d.get("migration"), int(d.get("min_gain_pages", 1)), d.get("tail_fill"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LayoutError(f"bad layout spec {d!r}: {e}") from None
        if spec.to_json() != {**spec.to_json(), **d}:
            raise LayoutError(f"bad layout spec {d!r}: not a layout this version builds ({spec.to_json()})")
        return spec


LAYOUTS: dict[str, LayoutSpec] = {
    "native": LayoutSpec("native", placement="first_fit", migration="native"),
    "omnipage": LayoutSpec("omnipage", placement="class_aware", migration=OMNIPAGE_MIGRATIONS[0], tail_fill=True),
    "eager": LayoutSpec("eager", placement="first_fit", migration="eager"),
}
LAYOUT_NAMES = tuple(LAYOUTS)


def layout_spec(name: str, migration: str | None = None, min_gain_pages: int = 1,
                tail_fill: bool | None = None) -> LayoutSpec:
    """The layout ``name`` (one of :data:`LAYOUT_NAMES`). ``migration`` picks OmniPage's mode (ignored by the
    other layouts, which have one); ``ordered_suffix`` comes with first-fit placement. ``tail_fill`` overrides
    OmniPage's class-aware tail fill (None: the registry's, on). Raises ``LayoutError``."""
    if name not in LAYOUTS:
        raise LayoutError(f"unknown layout {name!r}; choose from {LAYOUT_NAMES}")
    spec = replace(LAYOUTS[name], min_gain_pages=min_gain_pages)
    if name != "omnipage":
        return spec
    if migration is not None and migration != spec.migration:
        if migration not in OMNIPAGE_MIGRATIONS:
            raise LayoutError(f"OmniPage migration must be one of {OMNIPAGE_MIGRATIONS}, got {migration!r}")
        spec = replace(spec, migration=migration, placement="class_aware" if migration == "class_aware" else "first_fit")
    if tail_fill is not None:
        spec = replace(spec, tail_fill=bool(tail_fill))
    return replace(spec, tail_fill=spec.tail_fill and spec.migration == "class_aware")


def make_layout(name: str, page_size: int = 64, subblock_size: int = 32, migration: str = "class_aware",
                min_gain_pages: int = 1, tail_fill: bool | None = None) -> tuple[PageTable, MigrationPlanner]:
    """The page table and migration planner of a layout by name (``migration``: OmniPage's mode)."""
    return layout_spec(name, migration, min_gain_pages, tail_fill).build(page_size, subblock_size)


def migration_variants() -> dict[str, LayoutSpec]:
    """Every layout, OmniPage once per migration mode, keyed by label: native, ordered_suffix, class_aware, eager."""
    omnipage = {m: layout_spec("omnipage", m) for m in reversed(OMNIPAGE_MIGRATIONS)}
    return {"native": LAYOUTS["native"], **omnipage, "eager": LAYOUTS["eager"]}
