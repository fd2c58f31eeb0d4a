"""``omnitide bench stream`` on the tiny shape (seconds): the CLI, the JSON schema, the plot, and the machinery
underneath (checkpoint states, restore, the keys-visited count, FLOPs, profiling that changes nothing)."""

import json

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.bench import stream as bs
from omnitide_mlx.bench.shape_models import SHAPES, ShapeTrueModel, update_flops
from omnitide_mlx.cli import main
from omnitide_mlx.core.page import AllocClass, PageTable
from omnitide_mlx.core.profiles import StreamSpec

UPDATE_KEYS = {"policy", "checkpoint", "chunk_tokens", "active_slots", "update_ms", "attention_ms", "maintenance_ms",
               "retained_cells", "physical_span", "peak_memory_bytes", "active_pages", "peak_span", "kv_bytes",
               "update_cpu_ms", "attention_cpu_ms", "flops", "keys_visited", "synthetic_kv"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    out, png = d / "s.json", d / "s.png"
    rc = main(["bench", "stream", "--shape", "tiny", "--checkpoints", "300,600", "--session-seconds", "6",
               "--question-every", "3", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    return json.loads(out.read_text()), png


def test_cli_json_schema_and_plot(tiny_run):
    result, png = tiny_run
    assert result["shape"] == "tiny" and result["layers"] == 1
    assert {"mlx", "mlx_lm", "numpy", "cpu"} <= set(result["versions"])
    upd = [r for r in result["rows"] if r["kind"] == "update"]
    assert sorted((r["checkpoint"], r["policy"]) for r in upd) == sorted(
        (c, p) for c in (300, 600) for p in bs.VARIANTS)
    for r in upd:
        assert UPDATE_KEYS <= set(r), UPDATE_KEYS - set(r)
        assert r["synthetic_kv"] is True
        assert r["update_ms"] > 0 and r["attention_ms"] > 0 and r["peak_memory_bytes"] > 0
        assert r["chunk_tokens"] == 77
        assert r["ratio_to_limit"] == pytest.approx(r["speedup"] / r["flop_limit"], rel=1e-3)
    sess = {r["policy"]: r for r in result["rows"] if r["kind"] == "session"}
    assert set(sess) == set(bs.VARIANTS)
    for r in sess.values():
        assert r["session_s"] > 0 and r["synthetic_kv"] is False and r["units"] == 6 and r["questions"] == 2
        assert len(r["series"]) == 8
    prof = {r["policy"] for r in result["rows"] if r["kind"] == "attention_session"}
    assert prof == set(bs.LAYOUT_TRIO)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "omnitide_updates" in result["goals"] and "memory" in result["goals"]


def test_rows_follow_the_policies(tiny_run):
    """No-slide keeps everything; bounded policies stay under the high watermark; mlx-lm's KVCache holds what full
    context holds; every variant decodes the stream's reply lengths."""
    result, _ = tiny_run
    high = result["profile"]["high"]
    upd = {(r["checkpoint"], r["policy"]): r for r in result["rows"] if r["kind"] == "update"}
    for cp in (300, 600):
        full = upd[(cp, "full")]
        assert full["retained_cells"] == full["full_context_tokens"] + full["chunk_tokens"]
        assert upd[(cp, "mlx_kvcache")]["retained_cells"] == full["retained_cells"]
        assert full["flop_limit"] == 1.0 and full["key_limit"] == 1.0
        for p in ("fifo", "token", "streamingllm", "h2o", "omnipick", "omnitide", "eager"):
            assert upd[(cp, p)]["retained_cells"] <= high
            assert upd[(cp, p)]["flop_limit"] > 1.0
        assert upd[(cp, "mlx_rotating")]["retained_cells"] == high - 1 + full["chunk_tokens"]
    sess = {r["policy"]: r for r in result["rows"] if r["kind"] == "session"}
    assert len({r["decoded_tokens"] for r in sess.values()}) == 1
    assert sess["full"]["retained_cells"] == sess["full"]["full_context_tokens"] == sess["mlx_kvcache"][
        "retained_cells"]
    assert sess["omnitide"]["evictions"] > 0 and sess["full"]["evictions"] == 0


def test_tile_keys_visited_matches_brute_force():
    rng = np.random.default_rng(3)
    t = PageTable(64, 32, placement="first_fit")
    for uid in range(1, 12):
        t.allocate(int(rng.integers(20, 90)), uid, AllocClass.RECENT_CONTEXT)
    occ = np.flatnonzero(t.seq >= 0)
    t.free(rng.choice(occ, size=occ.size // 3, replace=False))
    slots = t.allocate(50, 99, AllocClass.RECENT_CONTEXT)
    active, visited = bs.tile_keys_visited(t, slots, 64)
    seq = t.seq
    tiles = [p for p in range(t.capacity // 64) if (seq[p * 64:(p + 1) * 64] >= 0).any()]
    assert active == 64 * len(tiles)
    brute = sum(64 for q in seq[slots] for p in tiles
                if (seq[p * 64:(p + 1) * 64][seq[p * 64:(p + 1) * 64] >= 0] <= q).any())
    assert visited == brute


def test_flop_limit_at_32k_for_the_3b_shape():
    """The issue's figure: about 2.35x at 32K for the 3B shape (every active slot for OmniTide's queries); with
    causal tile skipping inside the chunk the limit is a little higher."""
    shape = SHAPES["qwen2.5-omni-3b"]
    from omnitide_mlx.bench.shape_models import profile_for

    prof = profile_for(shape.name, "paper")  # the figure is at the paper's units (2,333 tokens)
    stream = StreamSpec(40, question_every=30)
    chunk = prof.media_unit_tokens
    keys = {}
    for policy in ("full", "omnitide"):
        st = bs.checkpoint_states(prof, policy, [32768], stream)[0]
        table = st.table.copy()
        slots = table.allocate(chunk, 10**6, AllocClass.RECENT_CONTEXT)
        keys[policy] = bs.tile_keys_visited(table, slots, 64)
    flops = {p: update_flops(shape, 36, shape.vocab, chunk, k[1]) for p, k in keys.items()}
    loose = update_flops(shape, 36, shape.vocab, chunk, keys["omnitide"][0] * chunk)
    assert flops["full"] / loose == pytest.approx(2.35, abs=0.05)
    assert 2.35 < flops["full"] / flops["omnitide"] < 2.6


def test_update_flops_by_hand():
    s = SHAPES["tiny"]  # hidden 64, intermediate 128, 4 q heads, 2 KV heads, head_dim 16
    macs = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert s.linear_macs_per_token() == macs
    assert update_flops(s, 2, 256, 10, 1000) == 2 * (2 * macs * 10 + 4 * 4 * 16 * 1000) + 2 * 64 * 256


def test_restore_repeats_the_same_update():
    """An installed checkpoint state, updated, restored and updated again, gives the same layout; the installed
    cache matches its history."""
    model = ShapeTrueModel("tiny", layers=1)
    stream = StreamSpec(20, question_every=5)
    st = bs.checkpoint_states(model.profile, "omnitide", [600], stream)[0]
    var = bs.EngineVariant("omnitide", model)
    var.install(st.table, st.history, st.peak_span, np.random.default_rng(0))
    var.session.cache.page_table.check_history(var.session.history)
    assert var.layout()["retained_cells"] == st.history.total_tokens
    var.media(0.0)
    first = var.layout()
    assert var.session.counters.evictions == 1
    var.restore()
    assert var.layout()["retained_cells"] == st.history.total_tokens and var.session.counters.evictions == 0
    var.media(0.0)
    assert var.layout() == first


def test_profiling_changes_no_result():
    """The profiled cache times attention and migration but computes the same logits."""
    model = ShapeTrueModel("tiny", layers=2)
    plain = bs.EngineVariant("omnitide", model)
    timed = bs.EngineVariant("omnitide", model, profiled=True)
    for t in range(5):
        plain.media(float(t))
        timed.media(float(t))
    assert mx.allclose(plain.session._last_logits, timed.session._last_logits, atol=1e-5).item()
    assert timed.session.cache.attention_s["prefill"] > 0
    assert plain.layout() == timed.layout()


def test_mlx_lm_checkpoint_state():
    model = ShapeTrueModel("tiny", layers=1)
    rng = np.random.default_rng(0)
    kv = bs.MlxLmVariant("mlx_kvcache", model, 200)
    kv.install(1000, 77, 1000, rng)
    assert kv.caches[0].offset == 1000 and kv.layout()["retained_cells"] == 1000
    rot = bs.MlxLmVariant("mlx_rotating", model, 200)
    rot.install(1000, 77, 1000, rng)
    assert rot.layout()["retained_cells"] == 199 + 77
    rot.media(0.0)
    assert rot.layout()["retained_cells"] == 199 + 77
    rot.restore()
    assert rot.caches[0].offset == 1000


def test_session_and_cost_limits(tiny_run):
    """Sessions carry FLOP counts and limits against full context; update rows the cost-weighted limit."""
    result, _ = tiny_run
    sess = {r["policy"]: r for r in result["rows"] if r["kind"] == "session"}
    assert sess["full"]["flop_limit"] == 1.0 and sess["omnitide"]["flop_limit"] > 1.0
    assert sess["mlx_kvcache"]["flops"] >= sess["full"]["flops"]  # SDPA scores every key, masked or not
    trio = {r["policy"]: r for r in result["rows"] if r["kind"] == "attention_session"}
    assert all(r["prefill_keys_visited"] > 0 and r["decode_keys_visited"] > 0 for r in trio.values())
    for r in result["rows"]:
        if r["kind"] == "update":
            assert r["cpu_cost_limit"] > 0
            if r["policy"] == "full":
                assert r["cpu_cost_limit"] == pytest.approx(1.0, abs=1e-3)
