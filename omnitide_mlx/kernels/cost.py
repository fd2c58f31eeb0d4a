"""A written cost model of the attention paths on an Apple GPU: bytes read, FLOPs and per-key overheads.

Paths (kernels/dispatch.py picks one per call):

- ``vector``: our Metal kernel (metal/tile_skip_attention.metal). One simdgroup per (query, head) row walks the
  listed tiles key by key: per *visible* key ``VEC_KEY_INSTR(D)`` simdgroup instructions (D/32 loads and FMAs for
  Q.K, a ``simd_sum`` = 5 shuffles + 5 adds, the online-softmax update with two ``exp``, D/32 loads and 2 x D/32
  multiply-adds for V, addressing), per listed slot ``VEC_SLOT_INSTR`` more (its serial is loaded and compared
  before K/V are, so a hole costs only that). Useful work per visible key is 2 x D/32 FMAs per lane: at D = 128 the
  kernel spends 44 instructions for 8, so it runs at ~18 % of the ALUs' FMA rate (llama.cpp's and MLX's vector
  kernels share the design, and reserve it for a few queries).
- ``gather``: the active tiles' K/V are copied into scratch (read + write of 2 x Hkv x A x D elements), then MLX's
  fused attention (``sdpa_full``, steel: 32-query x 16/32-key tiles multiplied on the simdgroup matrix units,
  ``MMA_EFF`` of peak) runs per query block over the prefix of the scratch the block can see: every gathered slot is
  multiplied, holes included (masked), ``SOFTMAX_OPS`` lane operations per score element. For up to 8 queries MLX
  runs ``sdpa_vector`` instead (a vector kernel: ``VEC_KEY_INSTR`` per gathered key and row).
- ``dense``: the same fused call over the span of slots from the first listed tile to the last one a block can
  see, no copy; it multiplies every slot of the span.
- ``full`` (the benchmarks' baseline): fused attention over the whole contiguous history with MLX's causal mask
  (steel skips key tiles wholly above the diagonal).

A path's time is ``launches x LAUNCH_US + copy time + max(compute time, DRAM bytes / bandwidth)``. K/V are counted
once from DRAM per call (re-reads by other query blocks and heads of a KV head hit the GPU's caches: one KV head of a
5K-slot layer is 2.6 MB in float16). The machine constants are public specifications (``MACHINES``); ``MMA_EFF``,
the instruction counts and ``LAUNCH_US`` are estimates, which is why the dispatcher calibrates every path on a Mac
(measured / predicted on a small case, per shape) before it trusts the model. No Mac has run these kernels yet:
every figure this module produces is a prediction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

NO_SEQ = int(np.iinfo(np.int32).max)
PATHS = ("vector", "gather", "dense")  # the Metal-side paths the model prices (the reference is the CPU's)
VEC_SLOT_INSTR = 5  # per listed slot and row: load its serial, two compares, branch, loop counter
MMA_EFF = 0.5  # fraction of the FMA peak MLX's steel attention reaches on the matrix units (estimate)
SOFTMAX_OPS = 6  # lane operations per score element in the fused kernel: scale / mask, max, subtract, exp, sum
LAUNCH_US = 6.0  # per kernel launch, encoder and dispatch (MLX on Metal; estimate)
FUSED_BLOCK_MAX = 512  # kernels/fused.py: queries per fused call
SCORE_BUDGET = 1 << 25  # kernels/attention.py: the reference path's score elements per query block


def VEC_KEY_INSTR(d: int) -> int:  # noqa: N802 (a constant of the kernel, per head dim)
    """Simdgroup instructions per visible key and row of the vector kernel (module docstring)."""
    dpl = d // 32
    return 24 + 5 * dpl


@dataclass(frozen=True)
class Machine:
    """An Apple GPU: cores of 128 FP32 lanes (4 simdgroups issue per cycle per core), clock, DRAM bandwidth."""

    name: str
    cores: int
    clock_ghz: float
    bandwidth_gbs: float

    @property
    def lane_ops(self) -> float:  # lane operations per second (an FMA is one)
        return self.cores * 128 * self.clock_ghz * 1e9

    @property
    def simd_instr(self) -> float:  # simdgroup instructions per second
        return self.lane_ops / 32

    @property
    def peak_flops(self) -> float:  # FMA = 2 FLOPs
        return 2 * self.lane_ops


MACHINES = {
    "m2-max-38": Machine("M2 Max (38-core GPU)", 38, 1.398, 400.0),
    "m1-8": Machine("M1 (8-core GPU)", 8, 1.278, 68.25),
    "m3-pro-18": Machine("M3 Pro (18-core GPU)", 18, 1.398, 150.0),
    "m2-10": Machine("M2 (10-core GPU)", 10, 1.398, 100.0),
    "m4-max-40": Machine("M4 Max (40-core GPU)", 40, 1.578, 546.0),
}
DEFAULT_MACHINE = MACHINES["m2-max-38"]


@dataclass(frozen=True)
class Case:
    """One attention call, reduced to what the paths' costs depend on (every count is per KV head group)."""

    hq: int
    hkv: int
    d: int
    t: int  # queries
    dtype_bytes: int
    tile: int
    listed_slots: int  # slots in the listed tiles (the vector kernel checks each one's serial per row)
    visible: int  # sum over queries of the keys each sees (the vector kernel's work)
    active_slots: int  # slots in listed tiles some query can see (what the gather path copies)
    gathered: int  # sum over query blocks of queries x scratch prefix (what the gather path multiplies)
    span: int  # slots from the first listed tile to the last visible one (what the dense path reads)
    spanned: int  # sum over query blocks of queries x the block's span (what the dense path multiplies)
    launches_fused: int  # fused calls (query blocks)

    @property
    def phase(self) -> str:
        return "decode" if self.t <= 8 else "prefill"

    def to_json(self) -> dict:
        return asdict(self)


def _block(hq: int, keys: int) -> int:
    return max(1, min(FUSED_BLOCK_MAX, SCORE_BUDGET // max(1, hq * keys)))


def make_case(key_seq, q_seq, tiles, tile: int, *, hq: int, hkv: int, d: int, dtype_bytes: int) -> Case:
    """The Case of one call: ``key_seq`` per slot (free = NO_SEQ or < 0), ``q_seq`` per query, listed ``tiles``."""
    key = np.asarray(key_seq, dtype=np.int64).reshape(-1)
    key = np.where(key < 0, NO_SEQ, key)
    qs = np.asarray(q_seq, dtype=np.int64).reshape(-1)
    tl = np.sort(np.asarray(tiles, dtype=np.int64).reshape(-1))
    t = int(qs.size)
    if tl.size == 0 or t == 0:
        return Case(hq, hkv, d, t, dtype_bytes, tile, 0, 0, 0, 0, 0, 0, 0)
    per_tile = key.reshape(-1, tile)[tl]
    mins = per_tile.min(axis=1)
    listed_keys = np.sort(per_tile[per_tile < NO_SEQ].reshape(-1))
    visible = int(np.searchsorted(listed_keys, qs, side="right").sum())
    qmax = qs.max()
    seen = mins <= qmax
    active = int(seen.sum()) * tile
    # gather: scratch tiles ordered by their smallest serial, a block sees a prefix
    order = np.sort(mins[seen])
    block = _block(hq, active)
    gathered = 0
    spanned = 0
    launches = 0
    vis_tiles, vis_mins = tl[seen], mins[seen]
    lo = int(vis_tiles[0]) * tile if vis_tiles.size else 0
    span = (int(vis_tiles[-1]) + 1) * tile - lo if vis_tiles.size else 0
    dblock = _block(hq, span)
    for i0 in range(0, t, block):
        blk = qs[i0:i0 + block]
        n = int(np.searchsorted(order, blk.max(), side="right")) * tile
        gathered += blk.size * n
        launches += n > 0
    for i0 in range(0, t, dblock):
        blk = qs[i0:i0 + dblock]
        s = vis_tiles[vis_mins <= blk.max()]
        if s.size:
            spanned += blk.size * ((int(s[-1]) + 1) * tile - lo)
    return Case(hq, hkv, d, t, dtype_bytes, tile, int(tl.size) * tile, visible, active, gathered, span, spanned,
                launches)


def dense_case(keys: int, t: int, *, hq: int, hkv: int, d: int, dtype_bytes: int, tile: int = 64) -> Case:
    """The benchmarks' "full" baseline: ``keys`` contiguous slots, the last ``t`` the chunk (causal)."""
    cap = -(-keys // tile) * tile
    seq = np.full(cap, NO_SEQ, np.int64)
    seq[:keys] = np.arange(keys)
    return make_case(seq, np.arange(keys - t, keys), np.arange(cap // tile), tile, hq=hq, hkv=hkv, d=d,
                     dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class Cost:
    """A path's predicted cost for one call (one layer)."""

    path: str
    dram_bytes: float  # bytes read from and written to DRAM
    flops: float  # useful multiply-add FLOPs the path executes (masked ones included)
    compute_ms: float
    memory_ms: float
    copy_ms: float
    launch_ms: float

    @property
    def ms(self) -> float:
        return self.launch_ms + self.copy_ms + max(self.compute_ms, self.memory_ms)

    def to_json(self) -> dict:
        return {**asdict(self), "ms": round(self.ms, 4)}


def _fused(path: str, c: Case, m: Machine, keys: int, products: int, copy_bytes: float, launches: int,
           mask: bool = True) -> Cost:
    """MLX's fused attention over ``keys`` slots per KV head, ``products`` = sum of queries x keys."""
    b = c.dtype_bytes
    kv_bytes = 2.0 * c.hkv * keys * c.d * b
    io_bytes = 2.0 * c.hq * c.t * c.d * b + (products if mask else 0)  # q, out, the boolean mask
    flops = 4.0 * c.hq * products * c.d
    if c.t <= 8:  # sdpa_vector: a vector kernel over every slot it is given
        compute = c.hq * products * VEC_KEY_INSTR(c.d) / m.simd_instr
    else:
        compute = flops / (m.peak_flops * MMA_EFF) + c.hq * products * SOFTMAX_OPS / m.lane_ops
    copy = copy_bytes / (m.bandwidth_gbs * 1e9)
    return Cost(path, kv_bytes + io_bytes + copy_bytes, flops, compute * 1e3,
                (kv_bytes + io_bytes) / (m.bandwidth_gbs * 1e9) * 1e3, copy * 1e3, launches * LAUNCH_US / 1e3)


def predict(path: str, c: Case, m: Machine = DEFAULT_MACHINE) -> Cost:
    """The predicted cost of ``path`` (vector / gather / dense / full) for case ``c`` on machine ``m``."""
    b = c.dtype_bytes
    if path == "vector":
        rows = c.hq  # per query: hq rows
        instr = rows * (c.visible * VEC_KEY_INSTR(c.d) + c.t * c.listed_slots * VEC_SLOT_INSTR)
        kv_bytes = 2.0 * c.hkv * c.listed_slots * c.d * b + 4.0 * c.listed_slots
        io_bytes = c.hq * c.t * c.d * (b + 4.0) + 4.0 * c.hq * c.t
        return Cost(path, kv_bytes + io_bytes, 4.0 * c.hq * c.visible * c.d, instr / m.simd_instr * 1e3,
                    (kv_bytes + io_bytes) / (m.bandwidth_gbs * 1e9) * 1e3, 0.0, 2 * LAUNCH_US / 1e3)
    if path == "gather":
        copy = 2.0 * 2.0 * c.hkv * c.active_slots * c.d * b  # K and V: read + write
        return _fused(path, c, m, c.active_slots, c.gathered, copy, 2 + c.launches_fused + 1)
    if path == "dense":
        return _fused(path, c, m, c.span, c.spanned, 0.0, c.launches_fused + 1)
    if path == "full":  # contiguous, causal mask in the kernel (no mask array), one call
        return _fused(path, c, m, c.span, c.visible, 0.0, 1, mask=False)
    raise ValueError(f"unknown path {path!r}; the cost model prices {PATHS + ('full',)}")


def best(c: Case, paths=PATHS, m: Machine = DEFAULT_MACHINE, factors: dict | None = None) -> tuple[str, dict]:
    """The cheapest of ``paths`` (each prediction times its calibration factor, default 1); and every estimate."""
    est = {p: predict(p, c, m).ms * (factors or {}).get(p, 1.0) for p in paths}
    return min(est, key=est.get), est


def limit(phase: str, full_keys: int, active_slots: int, t: int) -> float:
    """The speedup skipping allows (bench attention's *limit*): keys a query visits densely / keys in the active
    tiles; prefill counts the chunk's own causal keys, (t + 1) / 2 per query on average, on both sides."""
    if phase == "decode":
        return full_keys / active_slots
    causal = (t + 1) / 2
    return (full_keys - t + causal) / (active_slots - t + causal)
