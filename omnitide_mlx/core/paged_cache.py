"""What the MLX OmniCache and the PyTorch OmniTorchCache share: every part of a paged KV cache that is not a tensor.

The page table, the owner of the next tokens, capacity growth, the checks and counters of eviction and migration,
the JSON side of a saved cache and the order of restoring one live here once, so the two backends cannot drift
apart (their files are interchangeable). A cache is composed with a storage (core/kv_storage.py: :class:`KVStorage`)
that holds its buffers and does the tensor work of re-rotation, moving rows, growing and reading / writing arrays;
each backend's cache class builds :class:`PagedKVCache` with its own storage and adds what is its own (writing a
step, attention, saving a file). Imports no array framework: the torch path uses it without MLX.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import numpy as np

from .errors import OmniTideError
from .kv_storage import KVStorage
from .page import AllocClass, LayoutError, LayoutStats, MigrationPlan, PageTable, check_move_order

CACHE_FORMAT = "omnitide-cache/1"  # both backends write it: a file saved by one loads in the other
TABLE_ARRAYS = ("slots", "seq", "unit", "cls")  # page-table state saved as int32 arrays ``table.<name>``
TABLE_SCALARS = ("page_size", "subblock_size", "placement", "capacity", "next_seq", "partial")  # saved in the JSON
ROUNDINGS = ("stochastic", "nearest")


class CacheError(OmniTideError, ValueError):
    """Misuse of the cache: a step left open, shapes that do not match, a plan for another layout, ..."""


class PagedKVCache:
    """The bookkeeping half of a paged KV cache, composed with a :class:`KVStorage` that touches the tensors.

    A backend's cache class calls this constructor, then sets ``layers`` (each with ``index``, ``keys``,
    ``values``, ``nbytes``) and ``storage`` (its :class:`KVStorage`, built for this cache); the bookkeeping calls
    only the storage's public methods. A backend restores a saved state with its own ``from_state`` classmethod:
    an empty cache of the saved configuration (:func:`saved_config`) filled by :meth:`load_state`.
    """

    DTYPES: ClassVar[dict[str, Any]] = {}  # dtype name -> the backend's dtype
    STATE_NAME: ClassVar[str] = "cache"  # what error messages call a saved state of this class

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rope, dtype, *, page_size: int,
                 subblock_size: int, placement: str, grow_pages: int, collect_scores: bool, rounding: str,
                 seed: int):
        for name, val in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                          ("grow_pages", grow_pages)):
            if not isinstance(val, (int, np.integer)) or val <= 0:
                raise CacheError(f"{name} must be a positive int, got {val!r}")
        self.dtype_name(dtype)
        if rounding not in ROUNDINGS:
            raise CacheError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        self.num_layers, self.kv_heads, self.head_dim = int(num_layers), int(kv_heads), int(head_dim)
        self.rope = rope
        self.dtype = dtype
        self.grow_pages = int(grow_pages)
        self.collect_scores = bool(collect_scores)
        self.rounding = rounding
        self.seed = int(seed)
        self.evictions = 0  # evict() calls so far (also numbers the rounding streams: reproducible)
        self.table = PageTable(page_size, subblock_size, placement=placement)
        self._capacity = 0  # slots backed by the buffers (>= table.capacity)
        self.max_capacity: int | None = None  # a hard ceiling on slots (a KV budget), a page multiple; None: none
        self._owner: tuple[int, AllocClass] | None = None
        self._step = None
        self.moved_rows = 0  # entries copied by migrations so far
        self.rotated_rows = 0  # kept keys re-rotated by evictions so far
        self.storage: KVStorage | None = None  # set by the backend's constructor

    @classmethod
    def dtype_name(cls, dtype) -> str:
        for name, d in cls.DTYPES.items():
            if d == dtype:
                return name
        raise CacheError(f"KV dtype must be float16, bfloat16 or float32, got {dtype}")

    # --- shape --------------------------------------------------------------------------------------------------
    @property
    def page_table(self) -> PageTable:
        return self.table

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def retained(self) -> int:
        return self.table.retained

    @property
    def in_step(self) -> bool:
        """Whether a forward step is open (its slots are allocated, not every layer has finished)."""
        return self._step is not None

    # --- one forward step ---------------------------------------------------------------------------------------
    def set_owner(self, uid: int, alloc_class: AllocClass | int = AllocClass.RECENT_CONTEXT) -> None:
        """The unit (and allocation class) the next written tokens belong to. Decode steps of a reply keep the
        reply's uid: their tokens append to that unit in order."""
        if self._step is not None:
            raise CacheError("set_owner() inside an open step")
        if not isinstance(uid, (int, np.integer)) or uid < 0:
            raise CacheError(f"owner uid must be a non-negative int, got {uid!r}")
        self._owner = (int(uid), AllocClass(alloc_class))

    def _allocate_step(self, tokens: int) -> np.ndarray:
        """The slots of a step of ``tokens`` tokens for the owner (begin_step has checked that one is set); the
        buffers grow to back them."""
        if not isinstance(tokens, (int, np.integer)) or tokens <= 0:
            raise CacheError(f"a step writes a positive number of tokens, got {tokens!r}")
        uid, alloc_class = self._owner
        if self.max_capacity is not None and self.table.free_slots_for(alloc_class, self.max_capacity) < tokens:
            raise CacheError(f"{tokens} new tokens do not fit under the cache's ceiling of {self.max_capacity} "
                             f"slots ({self.table.retained} retained): trim before writing")
        slots = self.table.allocate(int(tokens), uid, alloc_class)
        self._ensure_capacity(self.table.capacity)
        return slots

    def _slot_seq(self) -> np.ndarray:
        """The table's ``seq`` padded with free slots (-1) to the buffers' capacity."""
        seq = self.table.seq
        if seq.shape[0] == self._capacity:
            return seq
        out = np.full(self._capacity, -1, dtype=np.int64)
        out[: seq.shape[0]] = seq
        return out

    def _ensure_capacity(self, needed: int) -> None:
        """Grow the buffers by whole pages, at least ``grow_pages`` at a time, so growing copies them rarely."""
        if needed <= self._capacity:
            return
        page = self.table.page_size
        new = max(needed, self._capacity + self.grow_pages * page)
        new = -(-new // page) * page
        if self.max_capacity is not None:
            new = min(new, max(self.max_capacity, -(-needed // page) * page))
        self.storage.grow(self._capacity, new)
        self._capacity = new

    def shrink(self, capacity: int) -> None:
        """Give back the buffers' slots at and after ``capacity`` (rounded up to a page); they must be free."""
        if self._step is not None:
            raise CacheError("shrink() inside an open step")
        page = self.table.page_size
        capacity = -(-int(capacity) // page) * page
        if capacity >= self._capacity:
            return
        try:
            self.table.shrink(capacity)
        except LayoutError as e:
            raise CacheError(str(e)) from e
        self.storage.shrink(capacity)
        self._capacity = capacity

    # --- eviction -----------------------------------------------------------------------------------------------
    def logical_slots(self) -> np.ndarray:
        """The occupied slots in logical (seq) order: slot of the history's k-th token."""
        seq = self.table.seq
        occ = np.flatnonzero(seq >= 0)
        return occ[np.argsort(seq[occ], kind="stable")]

    def slots_of_unit(self, uid: int) -> np.ndarray:
        return self.table.slots_of_unit(uid)

    def evict(self, plan, history=None) -> np.ndarray:
        """Apply a :class:`~omnitide_mlx.core.pick.RetentionPlan`: free the deleted tokens' slots and re-rotate each
        kept key by ``-shift`` once, in float32, with the model's RopeSpec. ``history`` is the history the plan was
        made for (before ``apply_plan``); when given, the cache is checked against it. Returns the freed slots."""
        if self._step is not None:
            raise CacheError("evict() inside an open step")
        if history is not None:
            plan.validate(history)
            self.table.check_history(history)
        order = self.logical_slots()
        if order.size != plan.tokens_before:
            raise CacheError(f"the cache holds {order.size} tokens, the plan was made for {plan.tokens_before}")
        shifts = plan.kept_token_shifts()
        kept = order[plan.keep_mask()]
        moving = shifts != 0
        if moving.any():
            if self.rope is None:
                raise CacheError("this plan shifts positions, but the cache has no RopeSpec to re-rotate keys")
            self.storage.rerotate(kept[moving], shifts[moving],
                                  [self.rounding_seed(i) for i in range(self.num_layers)])
            self.rotated_rows += int(moving.sum())
        freed = self.table.apply_retention(plan)
        self.evictions += 1
        if freed.size:
            self.storage.release(freed)
        return freed

    def readmit(self, uid: int, serials: np.ndarray, keys, values,
                alloc_class: AllocClass = AllocClass.SELECTED_HISTORY) -> np.ndarray:
        """Put a recalled unit back (core/recall.py): its tokens get slots under ``uid`` and their own older
        ``serials`` (so the cache's logical order stays the history's), and the storage writes ``keys`` /
        ``values`` (its rows, keys rotated at the unit's new positions) there. Returns the slots, token order."""
        if self._step is not None:
            raise CacheError("readmit() inside an open step")
        n = len(serials)
        if self.max_capacity is not None and self.table.free_slots_for(alloc_class, self.max_capacity) < n:
            raise CacheError(f"a recalled unit of {n} tokens does not fit under the cache's ceiling of "
                             f"{self.max_capacity} slots")
        try:
            slots = self.table.allocate(n, uid, alloc_class, serials=serials)
        except LayoutError as e:
            raise CacheError(str(e)) from e
        self._ensure_capacity(self.table.capacity)
        self.storage.write_rows(slots, keys, values)
        return slots

    def shift_keys(self, slots: np.ndarray, shift: int) -> None:
        """Rotate the keys at ``slots`` forward by ``shift`` positions (recall moves the retained units up to make
        room after the system prefix; the release plan's shift rule moves them back)."""
        if self._step is not None:
            raise CacheError("shift_keys() inside an open step")
        if shift and slots.size:
            if self.rope is None:
                raise CacheError("recall shifts positions, but the cache has no RopeSpec to re-rotate keys")
            self.storage.rerotate(slots, np.full(slots.size, -int(shift), dtype=np.int64),
                                  [self.rounding_seed(i) + 2048 for i in range(self.num_layers)])
            self.rotated_rows += int(slots.size)

    def rounding_seed(self, layer: int) -> int:
        """The seed of one layer's stochastic rounding in the current eviction (reproducible, distinct)."""
        return (self.seed * 1_000_003 + self.evictions) * 4096 + layer

    # --- migration ----------------------------------------------------------------------------------------------
    def migrate(self, plan: MigrationPlan) -> int:
        """Execute an accepted OmniPage migration plan: one source / destination map moves every layer's rows
        (``storage.move_rows``: the sources are gathered into scratch before any destination is written), then the page
        table. Returns rows moved."""
        if self._step is not None:
            raise CacheError("migrate() inside an open step")
        if not plan.accepted:
            raise CacheError(f"migration plan ({plan.mode}) was not accepted: {plan.reason}")
        if plan.before != self.table.stats():
            raise CacheError("migration plan was made for a different layout (plan it on this cache's table, now)")
        check_move_order(plan.src, plan.dst, self.table.occupancy())
        if plan.src.size:
            self.storage.move_rows(plan.src, plan.dst)
        self.table.apply_migration(plan)
        self.moved_rows += int(plan.src.size)
        return int(plan.src.size)

    def migration_bytes(self, plan: MigrationPlan) -> int:
        """K and V bytes a plan copies across all layers."""
        return self.bytes_per_token * int(plan.src.size)

    # --- H2O ----------------------------------------------------------------------------------------------------
    def token_scores(self, history=None) -> np.ndarray:
        """Accumulated attention per token of the history, in logical order (needs ``collect_scores``)."""
        if not self.collect_scores:
            raise CacheError(f"token_scores() needs {type(self).__name__}(..., collect_scores=True)")
        if history is not None:
            self.table.check_history(history)
        return self.storage.scores_at(self.logical_slots())

    # --- introspection ------------------------------------------------------------------------------------------
    def layout_stats(self) -> LayoutStats:
        return self.table.stats()

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (allocated capacity, all layers)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def dtype_bytes(self) -> int:
        return self.storage.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers (the storage's: quantised rows count their scales)."""
        return self.storage.bytes_per_token

    def stats(self) -> dict:
        """Layout (retained cells, physical span, active pages / subblocks, holes, capacity) and KV bytes."""
        s = self.table.stats().to_json()
        s.update(buffer_capacity=self._capacity, kv_bytes=self.nbytes,
                 kv_bytes_retained=s["retained_cells"] * self.bytes_per_token,
                 kv_bytes_span=s["physical_span"] * self.bytes_per_token,
                 moved_rows=self.moved_rows, rotated_rows=self.rotated_rows)
        return s

    # --- persistence (safetensors + JSON, like mlx-lm prompt caches) --------------------------------------------
    @property
    def state(self) -> dict:
        """Every array needed to restore the cache exactly."""
        if self._step is not None:
            raise CacheError("state of a cache with an open step")
        arrays = self.storage.buffer_arrays()
        t = self.table.state()
        for name in TABLE_ARRAYS:
            arrays[f"table.{name}"] = self.storage.to_array(np.asarray(t[name], dtype=np.int64).astype(np.int32))
        if self.collect_scores:
            arrays["scores"] = self.storage.scores_state()
        return arrays

    @property
    def meta_state(self) -> dict:
        """The JSON side: configuration, page-table scalars, owner, counters."""
        t = self.table.state()
        return {
            "format": CACHE_FORMAT,
            "num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
            "dtype": self.dtype_name(self.dtype),
            "rope": self.rope.to_json() if self.rope is not None else None,
            "grow_pages": self.grow_pages, "collect_scores": self.collect_scores,
            "rounding": self.rounding, "seed": self.seed, "evictions": self.evictions,
            "capacity": self._capacity,
            "owner": list(self._owner) if self._owner is not None else None,
            "moved_rows": self.moved_rows, "rotated_rows": self.rotated_rows,
            "table": table_meta(t),
        }

    def file_metadata(self, metadata: dict | None = None) -> dict[str, str]:
        """The safetensors metadata of a saved cache: its JSON side and the caller's own."""
        return {"omnitide_cache": json.dumps(self.meta_state), "user": json.dumps(metadata or {})}

    def load_state(self, arrays: dict, meta: dict):
        """Fill this empty cache, built with the saved configuration (:func:`saved_config`), from ``state`` /
        ``meta_state`` (either backend's): counters, page table, buffers (checked against the table), scores and
        owner. A missing key or a bad table raises :class:`CacheError`. Returns the cache."""
        try:
            self.evictions = int(meta["evictions"])
            table_state = dict(meta["table"])
            for name in TABLE_ARRAYS:
                table_state[name] = self.storage.to_numpy(arrays[f"table.{name}"]).astype(np.int64).tolist()
            self.table = PageTable.from_state(table_state)
            cap = int(meta["capacity"])
            if cap:
                self.storage.load_buffers(arrays, cap)
            self._capacity = cap
            if cap < self.table.capacity:
                raise CacheError(f"buffers hold {cap} slots, the page table {self.table.capacity}")
            self.storage.load_scores(arrays, cap)
            self._owner = (int(meta["owner"][0]), AllocClass(meta["owner"][1])) if meta["owner"] else None
            self.moved_rows, self.rotated_rows = int(meta["moved_rows"]), int(meta["rotated_rows"])
        except KeyError as e:
            raise CacheError(f"incomplete {self.STATE_NAME} state: missing {e}") from e
        except LayoutError as e:
            raise CacheError(f"bad page table in the saved state: {e}") from e
        return self

    def from_table(self, table: PageTable, buffers: dict, scores: np.ndarray | None = None):
        """A new cache configured as this one that holds ``table`` (its slots, sequence numbers, owners and classes)
        with ``buffers`` at the table's capacity (the arrays ``state`` names per layer: ``layers.{i}.keys`` /
        ``.values``, or a quantised cache's packed parts) and, for a score-collecting cache, ``scores`` (one per
        slot); counters start at zero. The stream benchmark installs a simulated layout with it. Built by the
        backend class's ``from_state``."""
        t = table.state()
        arrays = dict(buffers)
        for name in TABLE_ARRAYS:
            arrays[f"table.{name}"] = self.storage.to_array(np.asarray(t[name], dtype=np.int64).astype(np.int32))
        if self.collect_scores:
            if scores is None:
                raise CacheError("a score-collecting cache needs scores for the table's slots")
            arrays["scores"] = self.storage.to_array(np.asarray(scores, dtype=np.float32))
        meta = dict(self.meta_state, capacity=table.capacity, evictions=0, moved_rows=0, rotated_rows=0,
                    table=table_meta(t))
        return type(self).from_state(arrays, meta)


def check_state_meta(meta: dict, state_name: str, quantised_kv: bool) -> None:
    """A saved cache's JSON side must be of this format, and a quantised state needs a backend that holds one."""
    if meta.get("format") != CACHE_FORMAT:
        raise CacheError(f"not an {state_name} state (format {meta.get('format')!r}, want {CACHE_FORMAT!r})")
    if meta.get("kv_quant") and not quantised_kv:
        raise CacheError(f"a quantised cache state (kv_bits {meta['kv_quant'].get('bits')}): {state_name} "
                         "holds float K/V only; load it with OmniCache (MLX)")


def saved_config(meta: dict, state_name: str) -> dict:
    """The constructor arguments both backends share, from a saved cache's JSON side: ``num_layers``,
    ``kv_heads``, ``head_dim``, ``rope`` (its JSON, or None), ``dtype`` (its name) and the keyword options."""
    try:
        tm = meta["table"]
        return dict(num_layers=meta["num_layers"], kv_heads=meta["kv_heads"], head_dim=meta["head_dim"],
                    rope=meta["rope"], dtype=meta["dtype"], page_size=tm["page_size"],
                    subblock_size=tm["subblock_size"], placement=tm["placement"], grow_pages=meta["grow_pages"],
                    collect_scores=meta["collect_scores"], rounding=meta["rounding"], seed=meta["seed"])
    except KeyError as e:
        raise CacheError(f"incomplete {state_name} state: missing {e}") from e


def check_saved_buffers(index: int, keys, values, shape: tuple, dtype) -> None:
    """A saved layer's K / V must have ``shape`` (the cache's at the saved capacity) and its dtype."""
    if tuple(keys.shape) != shape or tuple(values.shape) != shape:
        raise CacheError(f"layer {index}: saved buffers are {tuple(keys.shape)}, expected {shape}")
    if keys.dtype != dtype or values.dtype != dtype:
        raise CacheError(f"layer {index}: saved buffers are {keys.dtype}, expected {dtype}")


def load_file(cache_cls, path, arrays: dict, meta: dict, return_metadata: bool, **options):
    """The cache in a safetensors file's arrays and metadata, restored by ``cache_cls.from_state(arrays, meta,
    **options)`` (and the caller's metadata when asked)."""
    if "omnitide_cache" not in meta:
        raise CacheError(f"{path} holds no {cache_cls.STATE_NAME} (no 'omnitide_cache' metadata)")
    cache = cache_cls.from_state(arrays, json.loads(meta["omnitide_cache"]), **options)
    if return_metadata:
        return cache, json.loads(meta.get("user", "{}"))
    return cache


def table_meta(table_state: dict) -> dict:
    """The page-table scalars a saved cache keeps in its JSON side (``PageTable.state()`` holds them all)."""
    return {k: table_state[k] for k in TABLE_SCALARS}
