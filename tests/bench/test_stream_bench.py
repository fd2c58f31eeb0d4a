"""``omnitide bench stream`` on the tiny shape (seconds): the CLI, the JSON schema, the plot, and the machinery
underneath (checkpoint states, restore, the keys-visited count, FLOPs, profiling that changes nothing)."""

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.bench import stream as bs
from omnitide_mlx.bench.common import Timing
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
    s = SHAPES["tiny"]  # hidden 64, intermediate 128, 4 q heads, 2 KV heads, head_dim 32
    macs = 64 * 128 + 2 * 64 * 64 + 128 * 64 + 3 * 64 * 128
    assert s.linear_macs_per_token() == macs
    assert update_flops(s, 2, 256, 10, 1000) == 2 * (2 * macs * 10 + 4 * 4 * 32 * 1000) + 2 * 64 * 256


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
            # None only where the separately probed attention outlasted the update (a loaded machine)
            assert r["cpu_cost_limit"] is None or r["cpu_cost_limit"] > 0
            if r["policy"] == "full" and r["cpu_cost_limit"] is not None:
                assert r["cpu_cost_limit"] == pytest.approx(1.0, abs=1e-3)


def test_cost_limit_is_none_when_the_probed_attention_outlasts_the_update():
    """Reproduces a CI flake under load: full context's probed attention CPU time above its update's made the
    predicted time negative and the cost-weighted limit negative (test_session_and_cost_limits asserted > 0)."""
    shape = SHAPES["qwen2.5-omni-3b"]
    timing = Timing(1.0, 1.0, 1.0, 1)
    zero = {f.name: 0 for f in dataclasses.fields(bs.UpdateRow) if f.default is dataclasses.MISSING}
    base = {**zero, "checkpoint": 4096, "chunk_tokens": 64, "keys_visited": 4096, "flops": 1e9,
            "flops_all_active": 1e9, "update_ms": 10.0, "attention_ms": 12.0, "maintenance_ms": 0.1,
            "timing": timing, "attention_timing": timing}
    full = bs.UpdateRow(**{**base, "policy": "full", "retention": "full", "update_cpu_ms": 10.0,
                           "attention_cpu_ms": 12.0})
    other = bs.UpdateRow(**{**base, "policy": "omnitide", "retention": "omnitide", "flops": 5e8,
                            "flops_all_active": 5e8, "keys_visited": 2048, "update_cpu_ms": 6.0,
                            "attention_cpu_ms": 5.0})
    rows = [full, other]
    bs.add_limits(rows, shape, shape)
    assert all(r.limits.cpu_cost_limit is None and r.limits.cpu_ratio_to_cost_limit is None for r in rows)
    assert other.limits.flop_limit == 2.0
    as_json = bs.row_json(other)  # the limits are flattened into the row's JSON, None values kept
    assert as_json["kind"] == "update" and as_json["flop_limit"] == 2.0 and as_json["cpu_cost_limit"] is None


# --- quantised KV side by side (--kv-bits) ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_kv_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream_kv")
    out, png = d / "s.json", d / "s.png"
    rc = main(["bench", "stream", "--shape", "tiny", "--checkpoints", "300,600", "--session-seconds", "6",
               "--question-every", "3", "--policies", "full,omnitide,mlx_kvcache,mlx_rotating", "--kv-bits", "4",
               "--kv-group-size", "32", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    return json.loads(out.read_text()), png


def test_kv_bits_adds_quantised_twins_and_the_mlx_lm_peer(tiny_kv_run):
    """--kv-bits 4 runs full_kv4 / omnitide_kv4 beside full / omnitide and mlx-lm's QuantizedKVCache beside its
    KVCache, in the same run; the rows keep every float key and add retention / kv_bits / kv_group_size."""
    result, png = tiny_kv_run
    names = ["full", "full_kv4", "omnitide", "omnitide_kv4", "mlx_kvcache", "mlx_rotating", "mlx_quantized"]
    upd = {(r["checkpoint"], r["policy"]): r for r in result["rows"] if r["kind"] == "update"}
    assert sorted(upd) == sorted((c, n) for c in (300, 600) for n in names)
    for r in upd.values():
        assert UPDATE_KEYS <= set(r), UPDATE_KEYS - set(r)
        quant = r["policy"] in ("full_kv4", "omnitide_kv4", "mlx_quantized")
        assert r["kv_bits"] == (4 if quant else None) and r["kv_group_size"] == (32 if quant else None)
        assert r["retention"] == bs.split_variant(r["policy"])[0]
    sess = {r["policy"]: r for r in result["rows"] if r["kind"] == "session"}
    assert set(sess) == set(names)
    assert len({r["decoded_tokens"] for r in sess.values()}) == 1
    assert result["kv_quant"]["bits"] == 4 and result["kv_quant"]["group_size"] == 32
    assert result["kv_quant"]["variants"] == ["full_kv4", "omnitide_kv4", "mlx_quantized"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quantised_twins_keep_the_same_cells_in_fewer_bytes(tiny_kv_run):
    """A twin retains exactly what its float policy retains; its buffers hold packed values plus scales and
    biases: tiny head_dim 32 at 4 bits in groups of 32 is 16 + 2 x 4 bytes a row against 128 in float32."""
    result, _ = tiny_kv_run
    kq = result["goals"]["kv_quant"]
    assert {(e["variant"], e["float"]) for e in kq["checkpoints"]} == {
        ("full_kv4", "full"), ("omnitide_kv4", "omnitide"), ("mlx_quantized", "mlx_kvcache")}
    assert len(kq["checkpoints"]) == 6 and len(kq["sessions"]) == 3
    for e in kq["checkpoints"] + kq["sessions"]:
        assert e["same_retained_cells"], e
        assert e["kv_bytes_ratio"] == pytest.approx(24 / 128, rel=1e-3), e
        # the real model's fp16 KV: 16 + 2 x 2 bytes of scale and bias against 64
        assert e["kv_bytes_real_model_ratio"] == pytest.approx(20 / 64, rel=1e-3), e
    info = result["kv_quant"]
    assert info["bench_kv_bytes_per_token"] * 128 == info["bench_kv_bytes_per_token_float"] * 24
    assert result["goals"]["memory"]["full_kv4"]["growth"] == "linear"
    assert result["goals"]["memory"]["mlx_quantized"]["growth"] == "linear"
    sess = {r["policy"]: r for r in result["rows"] if r["kind"] == "session"}
    assert sess["omnitide_kv4"]["evictions"] == sess["omnitide"]["evictions"] > 0
    assert sess["omnitide_kv4"]["prefill_attention_s"] > 0 and "prefill_attention_s" in kq["sessions"][1]


def test_engine_quantised_cache_computes_what_mlx_lm_quantized_kvcache_does():
    """Without eviction the engine over a 4-bit OmniCache and mlx-lm's QuantizedKVCache quantise the same K/V in
    the same groups: the same logits (up to float rounding), away from the float caches' logits."""
    model = ShapeTrueModel("tiny", layers=2)
    eng_q = bs.make_variant("full_kv4", model, kv_bits=4, kv_group_size=32)
    eng_f = bs.make_variant("full", model)
    lm_q = bs.make_variant("mlx_quantized", model, kv_bits=4, kv_group_size=32)
    lm_f = bs.make_variant("mlx_kvcache", model)
    for t in range(4):
        eng_q.media(float(t))
        eng_f.media(float(t))
        out_q = lm_q._prefill(lm_q.adapter.media_unit(bs._FRAME, bs._SECOND, float(t), lm_q.next_position))
        out_f = lm_f._prefill(lm_f.adapter.media_unit(bs._FRAME, bs._SECOND, float(t), lm_f.next_position))
    def gap(a, b):
        return float(mx.abs(a - b).max())
    assert gap(eng_q.session._last_logits, out_q) < 1e-5
    assert gap(eng_f.session._last_logits, out_f) < 1e-5
    assert gap(eng_q.session._last_logits, eng_f.session._last_logits) > 1e-3  # the twin really is quantised
    assert eng_q.session.cache.kv_bits == 4 and lm_q.caches[0].bits == 4


def test_quantised_checkpoint_state_installs_packed_rows():
    """The installed synthetic state of a quantised twin is packed (uint32 rows, scales, biases) and restores."""
    model = ShapeTrueModel("tiny", layers=1)
    stream = StreamSpec(20, question_every=5)
    st = bs.checkpoint_states(model.profile, "omnitide", [600], stream)[0]
    var = bs.EngineVariant("omnitide_kv8", model, kv_bits=8, kv_group_size=32)
    var.install(st.table, st.history, st.peak_span, np.random.default_rng(0))
    layer = var.session.cache.layers[0]
    assert isinstance(layer.keys, list) and layer.keys[0].dtype == mx.uint32
    assert layer.keys[0].shape[-1] == 32 * 8 // 32
    var.media(0.0)
    first = var.layout()
    var.restore()
    var.media(0.0)
    assert var.layout() == first and first["retained_cells"] <= model.profile.high


@pytest.mark.parametrize("argv, message", [
    (["--kv-bits", "4"], "does not divide"),  # group 64 > tiny head_dim 32
    (["--kv-bits", "4", "--kv-group-size", "32", "--kv-policies", "h2o"], "--kv-policies"),
])
def test_kv_bits_usage_errors(argv, message, capsys):
    rc = main(["bench", "stream", "--shape", "tiny", "--checkpoints", "300", "--no-sessions",
               "--policies", "full,omnitide", *argv])
    assert rc == 2 and message in capsys.readouterr().err


def test_run_bench_rejects_quantised_variants_without_bits():
    with pytest.raises(ValueError, match="kv_bits"):
        bs.run_bench("tiny", [300], policies=("full", "omnitide_kv4"), sessions=False)
    with pytest.raises(ValueError, match="kv_bits"):
        bs.run_bench("tiny", [300], policies=("full", "omnitide_kv8"), sessions=False, kv_bits=4,
                     kv_group_size=32)
