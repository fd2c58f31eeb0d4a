"""The attention benchmark's machinery on a tiny shape: checkpoints from the simulator, rows, limits, goals."""

import json

import mlx.core as mx
import pytest

from omnitide_mlx.bench import attention as ba
from omnitide_mlx.cli import main


def test_limit_definition():
    # decode: history keys over active slots
    assert ba.limit("decode", 32769, 2400, 1) == pytest.approx(32769 / 2400)
    # prefill: the chunk's own causal keys, (T + 1) / 2 per query, on both sides
    t = 100
    assert ba.limit("prefill", 5000 + t, 1600 + t, t) == pytest.approx((5000 + 50.5) / (1600 + 50.5))


def test_checkpoints_follow_one_history_across_layouts():
    cps = ba.checkpoints("minicpm-o-4.5", [2048, 4096])
    assert [c.history for c in cps] == [2048, 4096]
    for c in cps:
        assert c.full_context_tokens >= c.history
        cells = {n: t.stats().retained_cells for n, t in c.tables.items()}
        assert len(set(cells.values())) == 1 and cells["native"] == c.retained
    assert cps[1].tables["eager"].stats().physical_span == -(-cps[1].retained // 64) * 64


def test_bench_rows_on_a_tiny_shape():
    cp = ba.checkpoints("minicpm-o-4.5", [2048])[0]
    rows = ba.bench_checkpoint(cp, q_heads=4, kv_heads=2, head_dim=32, chunk=40, reps=1)
    assert [(r["phase"], r["layout"]) for r in rows] == [(p, l) for p in ("prefill", "decode")
                                                         for l in ("full", "native", "omnipage", "eager")]
    for r in rows:
        assert r["median_ms"] > 0
        if r["layout"] == "full":
            assert r["active_slots"] == cp.full_context_tokens + r["chunk_tokens"]
        else:
            assert r["active_slots"] == r["tiles"] * r["tile"]
            assert r["tile"] == (64 if r["phase"] == "prefill" else 32)
            assert r["ratio_to_limit"] == pytest.approx(r["speedup_vs_full"] / r["limit"], rel=1e-2, abs=2e-3)  # both rounded
    omni = [r for r in rows if r["layout"] == "omnipage"]
    assert all("median_ms_with_migration" in r for r in omni)
    g = ba.goals(rows)
    assert {s["phase"] for s in g["omnipage_share"]} == {"prefill", "decode"}
    assert ba.markdown({"rows": rows}).count("\n") == len(rows) + 1


def test_cli_writes_json(tmp_path, monkeypatch):
    """The command end to end on a tiny profile (monkeypatched shape) with --json and --plot."""
    from omnitide_mlx.models import stream_units

    real = stream_units.get_profile
    small = real("minicpm-o-4.5").with_shape(q_heads=4, kv_heads=1, head_dim=32)
    monkeypatch.setattr(stream_units, "get_profile", lambda name: small if name == "minicpm-o-4.5" else real(name))
    out = tmp_path / "a.json"
    png = tmp_path / "a.png"
    rc = main(["bench", "attention", "--shape", "minicpm-o-4.5", "--history", "1024", "--reps", "1",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["shape"] == "minicpm-o-4.5" and res["versions"]["mlx"] == mx.__version__
    assert {r["layout"] for r in res["rows"]} == {"full", "native", "omnipage", "eager"}
    assert png.stat().st_size > 0
    assert main(["bench", "attention", "--history", "x"]) == 2


@pytest.mark.parametrize("path", ["auto", "gather", "dense"])
def test_path_forces_the_tile_skip_rows(path, monkeypatch):
    monkeypatch.delenv("OMNITIDE_KERNELS", raising=False)
    cp = ba.checkpoints("minicpm-o-4.5", [1024])[0]
    rows = ba.bench_checkpoint(cp, q_heads=4, kv_heads=2, head_dim=32, chunk=40, reps=1, path=path)
    want = "reference" if path == "auto" else path  # auto off Metal: the reference
    assert {r["impl"] for r in rows if r["layout"] != "full"} == {want}
    assert all(r["median_ms"] > 0 for r in rows)


def test_path_vector_needs_a_gpu(capsys):
    if mx.metal.is_available():
        pytest.skip("a Metal GPU is present")
    assert main(["bench", "attention", "--path", "vector", "--history", "1024"]) == 2
    assert "--path vector" in capsys.readouterr().err


def test_bench_quantised_rows_and_kv_held():
    """--kv-bits: every tile-skip row also carries the quantised timings (keys as written and keys with a pending
    shift); bytes per token count scales and biases; the KV a simulated stream holds shrinks with them."""
    from omnitide_mlx.bench.kv_quant import kv_bytes_per_token, kv_held
    from omnitide_mlx.models.stream_units import resolve_profile

    cp = ba.checkpoints("minicpm-o-4.5", [2048])[0]
    rows = ba.bench_checkpoint(cp, q_heads=4, kv_heads=2, head_dim=32, chunk=40, reps=1, kv_quant=(4, 32))
    for r in rows:
        if r["layout"] == "full":
            assert "kv_quant" not in r
        else:
            q = r["kv_quant"]
            assert q["bits"] == 4 and q["median_ms"] > 0 and q["shifted_median_ms"] > 0
            assert q["ratio_to_float"] == pytest.approx(q["median_ms"] / r["median_ms"], rel=1e-2)
    assert "| 2048 | decode | omnipage |" in ba.quant_markdown({"kv_quant": {"bits": 4}, "rows": rows})
    prof = resolve_profile("qwen2.5-omni-7b", None)
    assert kv_bytes_per_token(prof, None) == 57344  # 28 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes
    assert kv_bytes_per_token(prof, 4, 64) == 2 * 28 * 4 * (64 + 2 * 2 * 2)
    held = kv_held(prof, 3000, [(None, None), (8, 64), (4, 64)], high=1000, low=700)
    by = {r["kv_bits"]: r for r in held["rows"]}
    assert held["slots"]["retained"] <= 1000
    assert by[4]["retained_gib"] == pytest.approx(by[None]["retained_gib"] * 72 / 256, rel=1e-3)
    assert by[4]["capacity_gib"] < by[8]["capacity_gib"] < by[None]["capacity_gib"]
