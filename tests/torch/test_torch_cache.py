"""OmniTorchCache without a model: after evictions and migrations its attention equals a float64 oracle that keeps
every token, masks the deleted ones and rotates each kept key at its shifted position; layouts do not change
outputs; migration allocates only the moved rows and writes the buffers in place; save / load round trips; misuse
is rejected."""

import numpy as np
import pytest
import torch
from stream_oracle import max_err, media_runs, run_session
from torch_stream import DEVICE, Stream, make_cache
from torch.utils._python_dispatch import TorchDispatchMode

from omnitide_mlx.core.page import AllocClass, MigrationPlanner
from omnitide_mlx.core.pick import H2O, OmniPick, TokenSliding
from omnitide_mlx.core.units import History, UnitKind
from omnitide_mlx.torch.cache import CacheError, OmniTorchCache
from omnitide_mlx.torch.rope import stochastic_round

TOL = 2e-5  # float32 cache against the float64 oracle; values are O(1)


@pytest.mark.parametrize("kernel", ["sdpa", "reference", "flex"])
def test_omnipick_stream_matches_oracle(kernel):
    s = run_session(Stream(make_cache(kernel=kernel), q_heads=4, seed=1), OmniPick(high=200, low=140), units=12,
                    rng_seed=1)
    assert s.evictions >= 2 and s.cache.rotated_rows > 0
    assert max_err(s) < TOL


def test_mrope_and_transformers_attention_mode_match_oracle():
    """M-RoPE keys re-rotated as one NeoX rotation; and the attention='transformers' mode (update returns the
    retained entries in logical order, the mask comes from get_mask_sizes) on a chunked, migrating OmniPage layout."""
    s = run_session(Stream(make_cache(head_dim=32), q_heads=4, seed=2, sections=(4, 6, 6)),
                    OmniPick(high=200, low=140), units=10)
    assert s.evictions >= 2 and max_err(s) < TOL
    s = Stream(make_cache(placement="first_fit", attention="transformers"), q_heads=4, seed=3,
               planner=MigrationPlanner("ordered_suffix"))
    run_session(s, TokenSliding(high=200, low=150), units=14, chunk=9)
    assert s.migrations >= 1 and s.evictions >= 2
    assert max_err(s) < TOL


def test_h2o_scores_are_the_attention_each_kept_token_received():
    s = Stream(make_cache(collect_scores=True, kernel="sdpa"), q_heads=4, seed=4)
    assert s.cache.kernel == "reference"  # the only kernel that exposes scores
    run_session(s, H2O(high=500, low=300), units=4, reply_every=0)
    np.testing.assert_allclose(s.cache.token_scores(s.history), [s.scores[t] for t in s.alive], rtol=1e-5, atol=1e-5)
    s.maintain(H2O(high=100, low=60))
    np.testing.assert_allclose(s.cache.token_scores(s.history), [s.scores[t] for t in s.alive], rtol=1e-5, atol=1e-5)
    assert abs(s.cache.token_scores().sum() - float(s.cache.storage.scores.sum())) < 1e-3  # freed slots forget theirs


@pytest.mark.parametrize("seed", range(2))
def test_layout_invariance_native_migrated_eager(seed):
    """One retention plan sequence, four layouts: outputs equal (the page table changes where, not what)."""
    layouts = {
        "native": (dict(placement="first_fit"), None),
        "ordered_suffix": (dict(placement="first_fit"), MigrationPlanner("ordered_suffix")),
        "class_aware": (dict(placement="class_aware"), MigrationPlanner("class_aware")),
        "eager": (dict(placement="first_fit"), MigrationPlanner("eager")),
    }
    runs = {}
    for name, (kw, planner) in layouts.items():
        s = Stream(make_cache(**kw), q_heads=4, seed=seed, planner=planner)
        runs[name] = run_session(s, OmniPick(high=220, low=150), units=14, rng_seed=seed, check_oracle=False)
    assert runs["ordered_suffix"].migrations >= 1 and runs["class_aware"].migrations >= 1
    assert runs["eager"].migrations >= 2
    spans = {n: s.cache.layout_stats().physical_span for n, s in runs.items()}
    assert spans["eager"] <= spans["ordered_suffix"] <= spans["native"]
    for name, s in runs.items():
        assert len(s.outputs) == len(runs["native"].outputs)
        for out, ref in zip(s.outputs, runs["native"].outputs):
            for o, r in zip(out, ref):
                np.testing.assert_allclose(o, r, rtol=0, atol=1e-5, err_msg=name)


class AllocationLog(TorchDispatchMode):
    """Every tensor an op allocates (outputs that alias no input), in bytes."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, schema in zip(outs, func._schema.returns):
            if isinstance(ret, torch.Tensor) and schema.alias_info is None:
                self.sizes.append(ret.numel() * ret.element_size())
        return out


def _fragmented_cache(rows_per_page: int, pages: int = 16, layers: int = 3, kv_heads: int = 2, head_dim: int = 64):
    """A cache whose units each leave ``rows_per_page`` entries in their page after an eviction (older units
    trimmed), ready for an eager migration."""
    from omnitide_mlx.core.pick import plan_from_mask
    from omnitide_mlx.core.units import History, Span, SpanKind, Unit, UnitKind

    c = make_cache(layers=layers, kv_heads=kv_heads, head_dim=head_dim, placement="first_fit",
                   attention="transformers")  # the step closes after the last layer's update
    h = History()
    for uid in range(pages):
        c.set_owner(uid)
        c.begin_step(64)
        for i in range(layers):
            k = torch.randn(1, kv_heads, 64, head_dim, device=DEVICE)
            c.update(k, torch.randn_like(k), i)
        h.append(Unit(uid=uid, kind=UnitKind.MEDIA, spans=(Span(SpanKind.IMAGE, 0, 64),),
                      positions=np.arange(uid * 64, uid * 64 + 64)[None]))
    keep = np.zeros(h.total_tokens, bool)
    for uid in range(pages):
        keep[uid * 64: uid * 64 + rows_per_page] = True
    keep[-64:] = True
    c.evict(plan_from_mask(h, keep, "test"), h)
    return c


@pytest.mark.parametrize("rows_per_page", [2, 8, 24])
def test_migration_allocates_only_the_moved_rows_and_writes_in_place(rows_per_page):
    c = _fragmented_cache(rows_per_page)
    plan = MigrationPlanner("eager").plan(c.page_table)
    assert plan.accepted and plan.moved > 0
    before = {i: (l.keys.data_ptr(), l.values.data_ptr()) for i, l in enumerate(c.layers)}
    snap = [(l.keys.clone(), l.values.clone()) for l in c.layers]
    log = AllocationLog()
    with log:
        moved = c.migrate(plan)
    assert moved == plan.moved
    row_bytes = c.kv_heads * c.head_dim * 4
    scratch = moved * row_bytes  # one of K or V of one layer, gathered
    big = [s for s in log.sizes if s > 1024]
    assert big and max(big) == scratch, (scratch, sorted(big)[-3:])
    assert sum(big) == 2 * c.num_layers * scratch  # K and V of every layer, nothing else sizeable
    assert sum(log.sizes) < 2 * c.num_layers * scratch + 64 * 1024  # index tensors are small
    assert scratch * 2 * c.num_layers == c.migration_bytes(plan)
    assert np.intersect1d(plan.src, plan.dst).size > 0  # eager reuses vacated slots: gather before scatter matters
    for i, l in enumerate(c.layers):  # in place: same storage, moved rows at their destinations
        assert (l.keys.data_ptr(), l.values.data_ptr()) == before[i]
        src, dst = torch.as_tensor(plan.src, device=DEVICE), torch.as_tensor(plan.dst, device=DEVICE)
        assert torch.equal(l.keys[:, :, dst], snap[i][0][:, :, src])
        assert torch.equal(l.values[:, :, dst], snap[i][1][:, :, src])


def test_the_allocation_log_would_catch_a_whole_buffer_copy():
    c = _fragmented_cache(4)
    log = AllocationLog()
    with log:
        c.layers[0].keys.clone()
    assert max(log.sizes) == c.layers[0].keys.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_save_load_round_trip_continues_identically(tmp_path, dtype):
    a = Stream(make_cache(dtype=dtype, placement="class_aware", collect_scores=True), q_heads=4, seed=5,
               planner=MigrationPlanner("class_aware"))
    run_session(a, OmniPick(high=200, low=140), units=8, check_oracle=False)
    a.cache.save(tmp_path / "kv.safetensors", metadata={"note": "x"})
    b_cache, user = OmniTorchCache.load(tmp_path / "kv.safetensors", device=DEVICE, return_metadata=True)
    assert user == {"note": "x"} and b_cache.seen_tokens == a.cache.seen_tokens
    assert b_cache.page_table.state() == a.cache.page_table.state()
    for la, lb in zip(a.cache.layers, b_cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    b = Stream(b_cache, q_heads=4, seed=5, planner=MigrationPlanner("class_aware"))
    b.history = History.from_json(a.history.to_json())
    b.alive, b.pos, b.next_id = list(a.alive), dict(a.pos), a.next_id
    b.raw_k, b.raw_v = a.raw_k, a.raw_v
    policy = OmniPick(high=200, low=140)
    for s in (a, b):
        s.outputs.clear()
        rng = np.random.default_rng(9)
        for _ in range(3):
            s.add_unit(UnitKind.MEDIA, media_runs(rng), check_oracle=False)
            s.maintain(policy)
    for out, ref in zip(a.outputs, b.outputs):
        for o, r in zip(out, ref):
            np.testing.assert_array_equal(o, r)


def test_load_rejects_foreign_or_broken_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CacheError, match="no OmniTide cache"):
        OmniTorchCache.load(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(CacheError, match="not a readable"):
        OmniTorchCache.load(tmp_path / "junk.safetensors")


def test_misuse_is_rejected():
    c = make_cache()
    k = torch.randn(1, 2, 3, 64, device=DEVICE)
    with pytest.raises(CacheError, match="before set_owner"):
        c.update(k, k, 0)
    c.set_owner(0, AllocClass.MUST_KEEP)
    with pytest.raises(CacheError, match="before layer 0"):
        c.update(k, k, 1)
    c.update(k, k, 0)
    with pytest.raises(CacheError, match="set_owner\\(\\) inside an open step"):
        c.set_owner(1)
    with pytest.raises(CacheError, match="out of order"):
        c.update(k, k, 0)
    assert not c.in_step and c.retained == 0  # the failed step gave its slots back
    with pytest.raises(CacheError, match="must be"):
        c.update(torch.randn(1, 2, 3, 32, device=DEVICE), torch.randn(1, 2, 3, 32, device=DEVICE), 0)
    assert c.retained == 0
    c.update(k, k, 0)
    with pytest.raises(CacheError, match="not this cache's buffer"):
        c.attend(0, torch.randn(1, 4, 3, 64, device=DEVICE), torch.randn(1, 2, c.capacity, 64, device=DEVICE), 0.1)
    with pytest.raises(CacheError, match="evict\\(\\) inside an open step"):
        c.evict(None)
    c.abort_step()
    with pytest.raises(CacheError, match="cannot be cropped"):
        c.crop(1)
    with pytest.raises(CacheError, match="KV dtype"):
        make_cache(dtype=torch.int8)
    with pytest.raises(CacheError, match="unknown kernel"):
        make_cache(kernel="flash")
    plan = MigrationPlanner("eager").plan(_fragmented_cache(4).page_table)
    with pytest.raises(CacheError, match="different layout"):
        make_cache().migrate(plan)


def test_stochastic_rounding_is_unbiased():
    y = torch.full((200_000,), 1.0 + 1e-4, device=DEVICE)  # between two float16 neighbours (ulp ~ 9.8e-4)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    r = stochastic_round(y, torch.float16, gen).to(torch.float32)
    assert set(r.unique().tolist()) == {1.0, float(torch.tensor(1.0, dtype=torch.float16).nextafter(
        torch.tensor(2.0, dtype=torch.float16)))}
    assert abs(r.mean().item() - (1.0 + 1e-4)) < 1e-5
    assert torch.equal(stochastic_round(y, torch.float32, gen), y)


def test_flex_failure_falls_back_to_sdpa_once_and_says_why(monkeypatch):
    """Where FlexAttention cannot run (no from_kv_blocks, a compile error), the cache goes on with SDPA over the
    span, warns once, and records the reason in its stats."""
    import omnitide_mlx.torch.attention as attention

    def broken(*args, **kwargs):
        raise RuntimeError("no flex here")

    monkeypatch.setattr(attention, "flex_attend", broken)
    s = Stream(make_cache(kernel="flex"), q_heads=4, seed=8)
    with pytest.warns(RuntimeWarning, match="falls back to SDPA"):
        run_session(s, OmniPick(high=200, low=140), units=6)
    assert s.cache.kernel == "sdpa" and "no flex here" in s.cache.stats()["kernel_fallback"]
    assert max_err(s) < TOL


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA allocator's peak is measured on CUDA (scripts/cuda_check.sh)")
def test_migration_peak_cuda_memory_is_the_moved_rows():
    c = _fragmented_cache(24, pages=64, layers=4, kv_heads=4, head_dim=128)
    plan = MigrationPlanner("eager").plan(c.page_table)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    c.migrate(plan)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    scratch = plan.moved * c.kv_heads * c.head_dim * 4
    buffer = c.layers[0].keys.numel() * 4
    assert scratch <= peak <= scratch + (1 << 20) < buffer, (peak, scratch, buffer)
