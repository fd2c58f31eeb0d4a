"""The PyTorch path against the MLX path on the same tiny checkpoint: the shared unit layouts give identical ids,
spans and positions, the encoders the same embeddings, and the two sessions streaming the bundled clip with the same
policy (evictions and migrations included) the same logits after every update and the same answers."""

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from omnitide_mlx.session import OmniSession  # noqa: E402
from omnitide_mlx.torch.session import TorchSession  # noqa: E402

HIGH, LOW = 300, 200
TOL = 2e-5  # float32 MLX (CPU, OpenBLAS or bundled) against float32 torch; logits of magnitude ~4


@pytest.fixture(scope="module")
def mlx_qwen(tiny_qwen):
    from omnitide_mlx.models import load

    return load(tiny_qwen)


def test_units_are_laid_out_identically(torch_qwen, mlx_qwen, clip_chunks):
    (tm, tp), (mm, mp) = torch_qwen, mlx_qwen
    ta, ma = tm.stream_adapter(tp), mm.stream_adapter(mp)
    start = 0
    for make in (lambda a, s: a.system_unit(None, s),
                 lambda a, s: a.media_unit(clip_chunks[0][0], clip_chunks[0][1], 0.0, s),
                 lambda a, s: a.media_unit(None, clip_chunks[1][1], 1.0, s),
                 lambda a, s: a.media_unit(clip_chunks[2][0], None, 2.0, s),
                 lambda a, s: a.context_unit("a caption", s),
                 lambda a, s: a.user_unit("What colour is the square?", s)):
        tu, mu = make(ta, start), make(ma, start)
        np.testing.assert_array_equal(tu.input_ids, mu.input_ids)
        np.testing.assert_array_equal(tu.positions, mu.positions)
        assert tu.spans == mu.spans and tu.kind == mu.kind and tu.label == mu.label
        np.testing.assert_allclose(tu.inputs_embeds.cpu().numpy(), np.array(mu.inputs_embeds), rtol=0, atol=1e-5)
        start = int(tu.positions.max()) + 1
    assert ta.turn_open == ma.turn_open and ta.stop_token_ids == ma.stop_token_ids
    assert ta.kv_spec == ma.kv_spec


def _stream(session, chunks):
    logits = []
    for frame, audio, t in chunks:
        session.push(frame=frame, audio=audio, t=t)
        logits.append(np.array(session._last_logits, dtype=np.float32) if not isinstance(session._last_logits,
                      torch.Tensor) else session._last_logits.float().cpu().numpy())
    answer = session.answer("What colour is the square?", max_tokens=6)
    return np.stack(logits), answer, session.stats()


@pytest.mark.parametrize("policy, migration", [("omnitide", "class_aware"), ("omnitide", "ordered_suffix"),
                                               ("fifo", "ordered_suffix"), ("h2o", "ordered_suffix")])
def test_sessions_agree_on_the_bundled_clip(torch_qwen, mlx_qwen, clip_chunks, policy, migration):
    t_logits, t_answer, t_stats = _stream(TorchSession(torch_qwen, policy=policy, high=HIGH, low=LOW,
                                                       migration=migration), clip_chunks)
    m_logits, m_answer, m_stats = _stream(OmniSession(mlx_qwen, policy=policy, high=HIGH, low=LOW), clip_chunks)
    assert t_stats["evictions"] == m_stats["evictions"] >= 1
    assert t_stats["evicted_tokens"] == m_stats["evicted_tokens"]
    assert t_stats["retained_cells"] == m_stats["retained_cells"]
    if migration == "class_aware":  # the MLX session's layout: the same pages and the same moves
        assert t_stats["migrated_cells"] == m_stats["migrated_cells"]
        assert t_stats["physical_span"] == m_stats["physical_span"]
    np.testing.assert_allclose(t_logits, m_logits, rtol=0, atol=TOL)
    assert t_answer == m_answer


def test_a_cache_saved_by_mlx_loads_in_torch(mlx_qwen, tmp_path, clip_chunks):
    """The two caches share their safetensors format: an MLX session's KV loads into an OmniTorchCache bit-exactly."""
    from omnitide_mlx.torch.cache import OmniTorchCache

    s = OmniSession(mlx_qwen, policy="omnitide", high=HIGH, low=LOW)
    for frame, audio, t in clip_chunks[:5]:
        s.push(frame=frame, audio=audio, t=t)
    s.cache.save(tmp_path / "kv.safetensors")
    c = OmniTorchCache.load(tmp_path / "kv.safetensors")
    assert c.page_table.state() == s.cache.page_table.state() and c.evictions == s.cache.evictions
    for lt, lm in zip(c.layers, s.cache.layers):
        np.testing.assert_array_equal(lt.keys.numpy(), np.array(lm.keys))
        np.testing.assert_array_equal(lt.values.numpy(), np.array(lm.values))
    c.page_table.check_history(s.history)


def test_both_attention_paths_plan_a_step_with_the_shared_core_plan():
    """One AttentionError and one tile plan (core/tiles.py): the MLX plan over the occupied tiles and the torch plan
    see the same tiles, smallest serials and query serials."""
    from omnitide_mlx.core import tiles
    from omnitide_mlx.kernels import AttentionError as MLXAttentionError
    from omnitide_mlx.kernels import plan_tiles
    from omnitide_mlx.torch.attention import AttentionError as TorchAttentionError
    from omnitide_mlx.torch.attention import plan_step

    assert MLXAttentionError is TorchAttentionError is tiles.AttentionError
    rng = np.random.default_rng(0)
    key = np.full(8 * 64, -1, dtype=np.int64)
    used = np.sort(rng.choice(key.size, 150, replace=False))
    key[used] = rng.permutation(150)
    q = np.arange(148, 150)
    occupied = tiles.plan_step_tiles(key, q, 64).tiles
    m, t = plan_tiles(key, q, occupied, 64), plan_step(key, q, 64, "cpu")
    assert m.tiles.tolist() == t.tiles.tolist() == occupied.tolist()
    assert m.q_seq_np.tolist() == t.step.q_seq.tolist() == q.tolist()
    assert m.active_slots == t.active_slots
    assert m.tile_min.tolist() == [int(key[p * 64:(p + 1) * 64][key[p * 64:(p + 1) * 64] >= 0].min()) for p in occupied]
